"""diffu-GRPO on GSM8K from LLaDA-8B-Instruct with LoRA, as d1 runs it (one GPU; not run here).

Prepared, not run (no GPU here). d1's prompts: its SYSTEM_PROMPT then the question, one user
turn through the chat template; the rewards check the text after '####' of the reference:

  python - <<'EOF'   # GSM8K's train.jsonl ({"question", "answer"}) -> d1's prompts
  import json
  SYSTEM = ("\\nRespond in the following format:\\n<reasoning>\\n...\\n</reasoning>\\n"
            "<answer>\\n...\\n</answer>\\n")
  with open("gsm8k/train.jsonl") as f, open("/data/gsm8k_d1.jsonl", "w") as out:
    for line in f:
      row = json.loads(line)
      out.write(json.dumps({"prompt": SYSTEM + "\\n\\n" + row["question"],
                            "response": row["answer"],
                            "answer": row["answer"].split("####")[1].strip()}) + "\\n")
  EOF
  python train.py --config=configs/grpo_gsm8k_gpu.py --workdir=/ckpt/llada_gsm8k_grpo \\
      --config.train.init_from=pretrained:/models/LLaDA-8B-Instruct \\
      --config.task_kwargs.path=/data/gsm8k_d1.jsonl

d1's settings (diffu-grpo/slurm_scripts/train.yaml): LoRA r 128, alpha 64 (dropout 0.05
there; mdjax's adapters merge into the weights, so 0); AdamW lr 3e-6 constant, betas (0.9,
0.99), weight decay 0.1, grad norm 0.2; G = 6, 12 completions a step (d1: 6 per device x 2
accumulation steps); 12 inner iterations, epsilon 0.5, beta 0.04, p_mask_prompt 0.15;
completions of 256 tokens in blocks of 32, 128 sampler steps, low-confidence remasking at
temperature 0.9 (its GRPOConfig's default); prompts cut to their last 200 tokens; d1's
five GSM8K rewards. Not reproduced: d1's reference sync every 64 steps (the reference here
is the start, adapters off), and its 8-GPU data parallelism (one process here: 12 rows).
The workdir resumes after SIGTERM; `mdjax.load(workdir)` is the merged model, and
`WORKDIR/checkpoints` holds the adapters.
"""

from configs import grpo


def get_config():
  c = grpo.get_config()
  c.task = "sft"  # the prompts' JSONL in the start's tokenizer (`mdjax.rl.trainer.JsonlSource`)
  c.task_kwargs = dict(path="", chat=True)
  c.objective = "grpo"
  c.batch_size = 12  # 2 prompts x 6 completions
  c.log_every = 1
  c.train.update(init_from="", num_steps=2000, lr=3e-6, lr_floor=1.0, warmup_steps=1,
                 b1=0.9, b2=0.99, weight_decay=0.1, grad_clip=0.2)
  c.train.lora.update(rank=128, alpha=64.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
                      dropout=0.0)
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.checkpoint.update(every=100, keep=3)
  c.rl.update(num_generations=6, num_iterations=12, epsilon=0.5, beta=0.04, p_mask_prompt=0.15,
              cfg_scale=0.0, estimator="one_step", max_prompt_length=200,
              max_completion_length=256, chat=True,
              rewards=("gsm8k_xmlcount", "gsm8k_soft_format", "gsm8k_strict_format",
                       "gsm8k_int", "gsm8k_correctness"))
  c.sampler.update(family="confidence", steps=128, block_length=32, score="prob",
                   count_rule="even", temperature=0.9)
  return c
