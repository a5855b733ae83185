"""Regenerates tests/fixtures/diffusion_gemma_hf/ with transformers' own DiffusionGemma code:
the tiny orbax fixture gemma's code wrote (tests/fixtures/diffusion_gemma/params) converted by
transformers' published conversion script, saved by `save_pretrained`, reloaded by
`from_pretrained` and run.

Requirements (outside mdjax's environment and extras; nothing is downloaded at run time):

  torch 2.13 and transformers 5.25 (DiffusionGemmaForBlockDiffusion, model_type
      "diffusion_gemma"), and the conversion script's own imports: jax, numpy, accelerate,
      dm-tree, absl-py and orbax-checkpoint==0.11.33 (the version the script names: 0.12's
      restore refuses the script's placeholder shapes).
  the conversion script, which transformers' wheel does not ship:
      src/transformers/models/diffusion_gemma/convert_diffusion_gemma_weights.py of
      huggingface/transformers at 0ceab83d0dd193ddd2b50828925c9da97cb8862b (32309 bytes,
      sha256 7cb19adfe187889124e1479db221d4e4d87c95fd47f2908007a02ef5ad8a1ed1; the version
      whose config reads per_layer_config, as 5.25's does), saved anywhere:

  python -m tests.reference.diffusion_gemma_hf --convert PATH/convert_diffusion_gemma_weights.py \
      [--out tests/fixtures/diffusion_gemma_hf]
  python -m tests.reference.diffusion_gemma_hf --read FOLDER ...   # folders mdjax.io.save wrote

(`--read` loads each folder with `from_pretrained` and prints its decoder logits' largest
difference from the recorded `logits_prompt`: transformers reading what mdjax writes.)

(mdjax itself is not imported, so the writer runs where transformers does.) What it does,
step by step as the script's `main()` does, and where it departs:

  1. The orbax fixture in the published checkpoint's names: gemma's model tree stores the
     dense FeedForward leaves (layer_i/mlp2/{gating_einsum, linear},
     self_conditioner/ffw/{gating_einsum, linear}) without the trailing "w" that the
     published checkpoint has (gemma's checkpointer maps one to the other), and the script
     matches paths ending in "mlp2/gating_einsum" with param "w"; so the tree is re-saved
     with the "w" (orbax, a temporary folder). No value changes.
  2. `convert(checkpoint_path, config)` of the script on it, with TINY below in place of its
     `_MODEL_CONFIG` (the published shapes scaled down: 6 layers (sliding, sliding, full) x 2,
     hidden 32, 4 heads, sliding 2 KV heads of 8, full 1 KV head of 16 (k_eq_v, RoPE on 0.25),
     8 experts (2 a token) of 16, dense MLP and self-conditioning 48, vocabulary 128) and
     --text_dtype=float32. One stand-in: the script's kv_einsum branch reads
     `config.num_key_value_heads`, which transformers 5.25's per-layer config refuses to read
     (AmbiguousGlobalPerLayerAttributeError) once the full layers override it, as the
     published config does; the stand-in answers the sliding layers' count, the only layers
     with a kv_einsum. So the published script does not run as published under 5.25.
  3. The vision tower: the orbax fixture has none (gemma's text_only tree), so a tiny random
     one (seeded) is added to the state dict, then `load_state_dict(..., strict=True)` into
     a model built under `accelerate.init_empty_weights()` and `save_pretrained` with
     max_shard_size 200KB (three shards and model.safetensors.index.json), as `main()`.
     The processor is not copied (it is downloaded from the Hub in `main()`).
  4. generation_config.json: `main()`'s DiffusionGemmaGenerationConfig with other values
     (GENERATION) so that a reader's defaults cannot pass for them.
  5. The saved folder reloaded with `from_pretrained` (eager attention, float32, one thread):
     the decoder's logits over canvas_BxW with the prompt prompt_BxP encoded into a
     DynamicCache (`logits_prompt`), the same with `self_conditioning_logits` sc_logits (the
     first pass's logits divided by 0.8: gemma's shaping at its first temperature;
     `logits_prompt_sc`), and after the canvas was encoded into that cache
     (`model.model.encoder`), the decoder over next_BxW (`logits_second`).

The sliding window (TINY: 32) covers every row (9 prompt + 8 + 8 canvas positions):
transformers' decoder pass builds no attention mask with a DynamicCache and an all-ones mask
(`create_diffusion_decoder_attention_mask` returns None), so its sliding layers attend to the
whole canvas and to whatever the sliding cache kept, where gemma's sees keys within the
window of each position. With the window shorter than a row they differ: the same folder run
at sliding_window 4 (`logits_prompt_window4`) is what transformers gives there, which
mdjax (as gemma) does not reproduce.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import pathlib
import shutil
import tempfile

import numpy as np
import orbax.checkpoint as ocp
import torch
import transformers
from absl import flags
from transformers import (AutoConfig, DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion,
                          DiffusionGemmaGenerationConfig, DiffusionGemmaTextConfig,
                          DynamicCache, EntropyBoundSamplerConfig, Gemma4VisionConfig)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
ORBAX = FIXTURES / "diffusion_gemma" / "params"
GEMMA_REFERENCE = FIXTURES / "diffusion_gemma" / "reference.npz"
OUT = FIXTURES / "diffusion_gemma_hf"
SCRIPT_SHA256 = "7cb19adfe187889124e1479db221d4e4d87c95fd47f2908007a02ef5ad8a1ed1"
WINDOW = 32
ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
            num_global_key_value_heads=1, use_bidirectional_attention="vision", num_experts=8,
            moe_intermediate_size=16, top_k_experts=2, sliding_window=WINDOW,
            final_logit_softcapping=30.0, rope_parameters=ROPE, max_position_embeddings=64)
VISION = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
              num_key_value_heads=1, head_dim=8, global_head_dim=8, default_output_length=4,
              pooling_kernel_size=1, use_clipped_linears=False, standardize=True, patch_size=2,
              position_embedding_size=4)
GENERATION = dict(max_new_tokens=16, max_denoising_steps=6,
                  sampler_config=EntropyBoundSamplerConfig(entropy_bound=2.0), t_min=0.5,
                  t_max=1.0, stability_threshold=0, confidence_threshold=0.01,
                  eos_token_id=[1, 106, 50], pad_token_id=0)
FIRST_TEMPERATURE = 0.8  # gemma's shaping temperature at the first step (its Sampler default)
# The dense FeedForward leaves the published checkpoint stores with a trailing "w".
WITH_W = {("mlp2", "gating_einsum"), ("mlp2", "linear"), ("ffw", "gating_einsum"),
          ("ffw", "linear")}


def published_names(tree: dict, path: tuple = ()) -> dict:
  """gemma's model tree with the published checkpoint's "w" under the dense FeedForward
  leaves (step 1 of the module docstring)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out[key] = published_names(value, path + (key,))
    elif (path[-1:] + (key,)) in WITH_W:
      out[key] = {"w": np.asarray(value)}
    else:
      out[key] = np.asarray(value)
  return out


def import_script(path: str):
  data = pathlib.Path(path).read_bytes()
  digest = hashlib.sha256(data).hexdigest()
  if digest != SCRIPT_SHA256:
    raise SystemExit(f"{path}: sha256 {digest}, not the script this writer was checked "
                     f"against ({SCRIPT_SHA256})")
  spec = importlib.util.spec_from_file_location("convert_diffusion_gemma_weights", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class SlidingHeads:
  """The text config as the script's kv_einsum branch reads it (step 2): its global
  num_key_value_heads is the sliding layers' (5.25 refuses to read it)."""

  def __init__(self, config):
    self._config = config

  def __getattr__(self, name):
    if name == "num_key_value_heads":
      layer = self._config.layer_types.index("sliding_attention")
      return self._config.per_layer_config[layer].num_key_value_heads
    return getattr(self._config, name)


def tiny_config() -> DiffusionGemmaConfig:
  config = DiffusionGemmaConfig(canvas_length=8, text_config=DiffusionGemmaTextConfig(**TINY),
                                vision_config=Gemma4VisionConfig(**VISION))
  config.text_config.dtype = torch.float32  # as main() with --text_dtype=float32
  config.vision_config.dtype = torch.float32
  return config


def convert(script, workdir: pathlib.Path, out: pathlib.Path) -> None:
  """Steps 1-4 of the module docstring: the folder written to `out`."""
  published = workdir / "published"
  ocp.PyTreeCheckpointer().save(published, published_names(
      ocp.PyTreeCheckpointer().restore(ORBAX.resolve())))
  flags.FLAGS(["convert", f"--checkpoint_path={published}", f"--output_path={out}",
               "--text_dtype=float32", "--vision_dtype=float32"])
  convert_layer = script.convert_transformer_weights
  script.convert_transformer_weights = lambda c, *a: convert_layer(SlidingHeads(c), *a)
  config = tiny_config()
  state = script.convert(str(published), config)
  torch.manual_seed(0)
  vision = {k: v for k, v in DiffusionGemmaForBlockDiffusion(config).state_dict().items()
            if k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))}
  assert not set(vision) & set(state)
  state.update(vision)
  with script.accelerate.init_empty_weights():
    model = DiffusionGemmaForBlockDiffusion(config=config)
  model.load_state_dict(state, assign=True, strict=True)
  model.save_pretrained(out, max_shard_size="200KB")
  DiffusionGemmaGenerationConfig(**GENERATION).save_pretrained(out)


def run(model, prompt, canvas, next_canvas, sc_logits=None) -> dict:
  """Step 5: the decoder's logits after the prompt, with and without self-conditioning
  logits, and over the next canvas once the first was encoded."""
  text = model.config.text_config
  with torch.no_grad():
    cache = DynamicCache(config=text)
    first = model(input_ids=prompt, decoder_input_ids=canvas, cache=cache).logits
    out = {"logits_prompt": first}
    if sc_logits is not None:
      out["logits_prompt_sc"] = model(input_ids=prompt, decoder_input_ids=canvas,
                                      self_conditioning_logits=sc_logits,
                                      cache=DynamicCache(config=text)).logits
      model.model.encoder(input_ids=canvas, cache=cache)
      out["logits_second"] = model(decoder_input_ids=next_canvas, cache=cache).logits
  return {k: v.numpy().astype(np.float32) for k, v in out.items()}


def read(folders, out: pathlib.Path) -> None:
  """Each folder through `from_pretrained` and the decoder after the prompt, against the
  recorded logits (the folders mdjax writes: transformers reads them)."""
  records = np.load(out / "reference.npz")
  ids = {k: torch.tensor(records[k], dtype=torch.long) for k in ("prompt_BxP", "canvas_BxW",
                                                                 "next_BxW")}
  for folder in folders:
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, attn_implementation="eager")
    got = run(model.eval(), ids["prompt_BxP"], ids["canvas_BxW"], ids["next_BxW"])
    diff = np.abs(got["logits_prompt"] - records["logits_prompt"]).max()
    print(f"{folder}: largest |logit - recorded| {diff:.2e} (largest logit "
          f"{np.abs(records['logits_prompt']).max():.2f})")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--convert", help="convert_diffusion_gemma_weights.py")
  parser.add_argument("--out", default=str(OUT))
  parser.add_argument("--read", nargs="+", help="folders to read with from_pretrained")
  args = parser.parse_args()
  torch.set_num_threads(1)
  if args.read:
    read(args.read, pathlib.Path(args.out))
    return
  if not args.convert:
    parser.error("--convert PATH is required to write the fixture")
  out = pathlib.Path(args.out)
  folder = out / "model"
  shutil.rmtree(folder, ignore_errors=True)
  script = import_script(args.convert)
  with tempfile.TemporaryDirectory() as workdir:
    convert(script, pathlib.Path(workdir), folder)

  gemma = np.load(GEMMA_REFERENCE)
  ids = {k: torch.tensor(gemma[k], dtype=torch.long)
         for k in ("prompt_BxP", "canvas_BxW", "next_BxW")}
  model = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, attn_implementation="eager")
  model.eval()
  first = run(model, ids["prompt_BxP"], ids["canvas_BxW"], ids["next_BxW"])["logits_prompt"]
  sc_logits = torch.tensor(first / FIRST_TEMPERATURE)
  records = run(model, ids["prompt_BxP"], ids["canvas_BxW"], ids["next_BxW"], sc_logits)
  narrow = AutoConfig.from_pretrained(folder)
  narrow.text_config.sliding_window = 4
  windowed = DiffusionGemmaForBlockDiffusion.from_pretrained(
      folder, config=narrow, attn_implementation="eager").eval()
  records["logits_prompt_window4"] = run(windowed, ids["prompt_BxP"], ids["canvas_BxW"],
                                         ids["next_BxW"])["logits_prompt"]
  np.savez(out / "reference.npz", **{k: gemma[k] for k in ids}, sc_logits=sc_logits.numpy(),
           **records)
  info = {"transformers": transformers.__version__, "torch": torch.__version__,
          "orbax-checkpoint": ocp.__version__, "script_sha256": SCRIPT_SHA256,
          "script_commit": "0ceab83d0dd193ddd2b50828925c9da97cb8862b",
          "sliding_window": WINDOW, "first_temperature": FIRST_TEMPERATURE,
          "files": sorted(p.name for p in folder.iterdir())}
  (out / "reference.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
  print(json.dumps(info, indent=2))


if __name__ == "__main__":
  main()
