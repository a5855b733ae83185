"""Shakespeare with a byte-level BPE tokenizer on a 2-core CPU: 64-token windows of speeches
joined by EOS, the model of configs/shakespeare_char.py.

The tokenizer (`tokenizers`, 1,024 ids with EOS) is trained on the training split when the task
is first built and saved with every checkpoint. Documents are the speeches (pieces between blank
lines), packed: the EOS id stands where the blank line was, so a window codes the text exactly
and bits per character compare with the character model's. `task_kwargs.documents="padded"`
gives one speech per window with EOS after it instead (LLaDA's SFT layout).
3,000 steps: the budget of the character model it is compared with (results/generation.md).
"""

from configs.shakespeare_char import get_config as char_config


def get_config():
  c = char_config()
  c.task_kwargs.update(tokenizer="bpe", bpe_vocab_size=1024, documents="packed")
  c.train.update(num_steps=3000)
  c.eval_every = 1000
  return c
