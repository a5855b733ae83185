"""The PyTorch side: fixture writers and reference loops (the `[reference]` extra).

  python -m tests.reference.pretrained   # tests/fixtures/pretrained/ (LLaDA, Dream)
  python -m tests.reference.dit --bd3lms PATH --mdlm PATH   # tests/fixtures/dit/ (MDLM, BD3-LM)
  python -m tests.reference.judge        # tests/fixtures/judge/ (Llama, Qwen2 judges)
  python -m tests.reference.llada21 --source21 PATH   # tests/fixtures/llada21/ (LLaDA2.1's decoder)

They write the small fixtures the parity tests compare against, so CI needs no torch.
`dit_loops` holds the MDLM / BD3-LM sampler loops transcribed in torch, which
`python -m mdjax.bench.dit` times against mdjax's, and `pretrained`'s LLaDA loops serve
`python -m mdjax.bench.pretrained`.
"""
