"""A mdjax causal Transformer (a workdir trained with objective "causal") as a Hugging Face
LlamaForCausalLM folder: the input `mdjax.convert` turns into a diffusion model.

  python -m mdjax.convert.causal_export --workdir=WORKDIR --out=DIR

mdjax's Transformer with rope, rms, swiglu, no time conditioning and causal attention is
Llama's network: pre-norm RMSNorm (eps 1e-6, weight only), q/k/v without biases, RoPE with
theta 10000 on the half-split head, silu(gate) * up, an untied head. The mapping:

  embed.embedding [V + 1, D]           -> model.embed_tokens ([V + 1, D]: id V is the start id)
  blocks.n.qkv.kernel [D, 3D]          -> q, k, v (the first, second and third D columns)
  blocks.n.proj.kernel                 -> o_proj
  blocks.n.norm1.scale / norm2.scale   -> input_layernorm / post_attention_layernorm
  blocks.n.mlp_in.kernel [D, 2F]       -> gate_proj (first F columns), up_proj (last F)
  blocks.n.mlp_out.kernel              -> down_proj
  final_norm.scale, head.kernel [D, V] -> model.norm, lm_head ([V + 1, D]: row V zero)

The causal objective starts every window with the task's mask id V (`diffusion.
causal_lm_loss`), so the folder's vocabulary is V + 1: ids 0..V-1 are the task's tokens and V
is the start token (config.json's bos_token_id, `<s>` in the tokenizer). Llama has no head
bias, so the start id's logit is 0 rather than -inf: the folder's logits over ids 0..V-1
equal the workdir model's (a test), and a row's softmax differs only by that one extra id.
A character task's tokenizer is written as tokenizer.json (one id per character, the same
ids), so `mdjax.load` of the folder encodes and decodes text and the folder is a generative
perplexity judge (`mdjax.evaluate.gen_ppl`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np

from mdjax import files as files_lib
from mdjax.convert.a2d import make_partial
from mdjax.models.published import PublishedConfig

START_TOKEN = "<s>"
# The mdjax Transformer fields a Llama network expresses, and the value each must have.
LLAMA_FIELDS = {"positions": "rope", "norm": "rms", "mlp": "swiglu", "time_conditioning": False,
                "causal": True, "block_size": None}
NORM_EPS = 1e-6  # flax nnx.RMSNorm's epsilon, which mdjax's Transformer keeps
ROPE_THETA = 10_000.0  # mdjax.models.layers.rope_table's base


def check_exportable(config) -> None:
  """A ValueError naming the first `config.model` field a Llama folder cannot express."""
  if config.get("objective") != "causal":
    raise ValueError(f"objective={config.get('objective')!r}: only a model trained with "
                     "objective 'causal' is a left-to-right LM to export as Llama.")
  model = config.model
  for name, wanted in LLAMA_FIELDS.items():
    if model.get(name) != wanted:
      raise ValueError(f"model.{name}={model.get(name)!r}: a Llama folder needs {wanted!r}.")


def llama_config(config, vocab_size: int, max_len: int) -> PublishedConfig:
  """The PublishedConfig ("llama") of a mdjax causal model over `vocab_size` task ids (the
  folder holds one more: the start id)."""
  m = config.model
  return PublishedConfig(
      family="llama", vocab_size=vocab_size + 1, d_model=m.d_model, num_layers=m.num_layers,
      num_heads=m.num_heads, num_kv_heads=m.num_heads, head_dim=m.d_model // m.num_heads,
      mlp_hidden=m.d_ff, rope_theta=ROPE_THETA, norm_eps=NORM_EPS, qkv_bias=False,
      logit_shift=False, mask_id=None, causal=True, eos_id=None, max_len=max_len,
      dtype="float32")


def llama_params(params: dict, config: PublishedConfig) -> dict:
  """The published ("llama") params pytree of a mdjax causal Transformer's params."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  d, f = config.d_model, config.mlp_hidden
  blocks = [p["blocks"][n] for n in range(config.num_layers)]
  stack = lambda fn: np.stack([fn(b) for b in blocks])
  head_DxV = p["head"]["kernel"]
  return {
      "embed": p["embed"]["embedding"],
      "layers": {
          "attn_norm": stack(lambda b: b["norm1"]["scale"]),
          "q": stack(lambda b: b["qkv"]["kernel"][:, :d]),
          "k": stack(lambda b: b["qkv"]["kernel"][:, d:2 * d]),
          "v": stack(lambda b: b["qkv"]["kernel"][:, 2 * d:]),
          "o": stack(lambda b: b["proj"]["kernel"]),
          "mlp_norm": stack(lambda b: b["norm2"]["scale"]),
          "gate": stack(lambda b: b["mlp_in"]["kernel"][:, :f]),
          "up": stack(lambda b: b["mlp_in"]["kernel"][:, f:]),
          "down": stack(lambda b: b["mlp_out"]["kernel"]),
      },
      "final_norm": p["final_norm"]["scale"],
      # The start id is never a target: its column is zero (Llama has no head bias).
      "head": np.concatenate([head_DxV, np.zeros((d, 1), np.float32)], axis=1),
  }


def char_tokenizer_json(vocab: str) -> str:
  """A tokenizer.json of one id per character of `vocab` (ids 0..n-1, the CharTokenizer's),
  then the start token `<s>` at id n; text it cannot encode is an error (no unknown token)."""
  import tokenizers
  from tokenizers import Regex, decoders, models, pre_tokenizers

  ids = {c: i for i, c in enumerate(vocab)}
  ids[START_TOKEN] = len(vocab)
  tokenizer = tokenizers.Tokenizer(models.WordLevel(ids, unk_token=None))
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer.add_special_tokens([START_TOKEN])
  return tokenizer.to_str()


def write_folder(params: dict, config, task, out: str) -> str:
  """Writes a causal Transformer's `params` (a pure dict; `config` its run config, `task` its
  task) to the Llama folder `out`, built in OUT.partial (refused when it exists: never
  deleted unless this run made it) and renamed at the end."""
  from mdjax import io

  check_exportable(config)
  if task.mask_id != task.vocab_size:
    raise ValueError(f"the task's mask id {task.mask_id} is not its vocab_size "
                     f"{task.vocab_size}: the start id must follow the tokens.")
  llama = llama_config(config, task.vocab_size, task.length)
  out = os.fspath(out)
  if os.path.exists(out):
    raise ValueError(f"out={out!r} exists: the export writes a new folder.")
  partial = make_partial(out)  # an OUT.partial there already is refused, never deleted
  try:
    io.save(llama_params(params, llama), partial, config=llama)
    config_path = os.path.join(partial, "config.json")
    with open(config_path) as f:
      raw = json.load(f)
    raw["bos_token_id"] = task.mask_id
    with files_lib.atomic_write(config_path, "w") as f:
      f.write(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    vocab = getattr(task.tokenizer, "vocab", None)
    if isinstance(vocab, str) and not getattr(task.tokenizer, "eos", False):
      with files_lib.atomic_write(os.path.join(partial, "tokenizer.json"), "w") as f:
        f.write(char_tokenizer_json(vocab))
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  os.replace(partial, out)
  return out


def export(workdir: str, out: str, *, step: int | None = None) -> str:
  """Writes the causal model of `workdir` (its newest checkpoint, or `step`) to the Llama
  folder `out`; returns `out`."""
  from mdjax import train

  model = train.load(workdir, step)
  check_exportable(model.config)
  return write_folder(model.params, model.config, model.task, out)


def export_fresh(config, out: str, *, seed: int = 0) -> str:
  """Writes a freshly initialised causal Transformer of run config `config` (objective
  'causal') to the Llama folder `out`: the same network and init as that run's step 0, the
  start of a from-scratch baseline in the converted layout."""
  from flax import nnx

  from mdjax import models, tasks
  from mdjax.train.state import model_config

  check_exportable(config)
  task = tasks.from_config(config)
  _, params, _ = models.init(model_config(config, task), seed)
  return write_folder(nnx.to_pure_dict(params), config, task, out)


def main(argv=None) -> int:
  from mdjax import cli

  name = "mdjax.convert.causal_export"
  parser = cli.Parser(name, prog="python -m mdjax.convert.causal_export",
                      description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a mdjax workdir (objective 'causal')")
  parser.add_argument("--out", required=True, help="the Llama folder to write")
  parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default newest)")
  args = parser.parse_args(argv)
  try:
    out = export(args.workdir, args.out, step=args.step)
  except ValueError as error:
    return cli.report(name, error, cli.USAGE)
  except OSError as error:
    return cli.report(name, error, cli.RUNTIME)
  print(f"wrote {out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
