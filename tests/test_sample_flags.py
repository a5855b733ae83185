"""Every sample.py flag in every mode is used or refused, never ignored.

The modes: samples from an exact oracle, samples from a workdir, completions of --prompts,
block-by-block generation (--blocks_of). The samplers and `mdjax.load` are replaced by
recorders (no compilation): a flag is *used* when giving it changes what the library is called
with, what is printed or what is written; *refused* when the run stops with a one-line usage
error. Any other outcome (the same calls, output and files) is a flag silently ignored.
"""

import json
import os
import re
import types

import jax
import numpy as np
import pytest
from absl import flags

import sample
from mdjax import loader, tasks
from mdjax import model as model_lib
from mdjax.denoiser import Denoiser
from tests.paths import REPO
from experiments.tiny_text import tiny_config, write_corpus

pytestmark = pytest.mark.slow

# A value for each flag (not its default), and the flags its sampler family needs.
LOCAL_REMASK = {"sampler": "local_remask"}
# DiffusionGemma's rule samples uniform-noise models: an oracle under --noise=uniform.
GEMMA = {"sampler": "diffusion_gemma", "noise": "uniform"}
FILTER = os.path.join(REPO, "tests", "fixtures", "learned_commit", "width5.json")
POLICY = os.path.join(REPO, "tests", "fixtures", "order_policy", "length25.json")
FLAG_VALUES = {
    "task": ("scan_and_add", {}), "oracle": ("true", {}), "workdir": ("/elsewhere", {}),
    "step": ("3", {}), "batch_size": ("1", {}), "prompt": ("1,0", {}), "prefix": ("Thou", {}),
    "suffix": ("art.", {}), "reference": ("/causal", {}), "show": ("1", {}),
    "sampler": ("confidence", {}), "steps": ("2", {}), "k": ("2", {"sampler": "speculative"}),
    "temperature": ("0.5", {}), "top_k": ("2", {}), "top_p": ("0.5", {}), "min_p": ("0.2", {}),
    "score": ("margin", {"sampler": "confidence"}), "eta": ("0.1", {"sampler": "remask"}),
    "gamma": ("0.3", {"sampler": "entropy_bounded"}),
    "threshold": ("0.9", {"sampler": "confidence"}),
    "score_groups": ("2", {"sampler": "revision"}), "block_length": ("2", {}),
    "kv_cache": ("dual", {"sampler": "confidence", "block_length": "2"}),
    "refresh_every": ("2", {"sampler": "confidence", "block_length": "2", "kv_cache": "dual"}),
    "order": ("[VOA][v×9]o×10[ht1]", {"sampler": "field_order", "task": "scan_and_add"}),
    "groups": ("0;1", {"sampler": "ordered"}), "base": ("ancestral", LOCAL_REMASK),
    "refill": ("confidence", LOCAL_REMASK), "refill_steps": ("2", LOCAL_REMASK),
    "rounds": ("3", LOCAL_REMASK), "seeds": ("2", LOCAL_REMASK),
    "window": ("3", LOCAL_REMASK), "context_fraction": ("0.2", LOCAL_REMASK),
    "blocks_of": ("2", {}), "length": ("4", {}), "context": ("4", {}),
    "num_samples": ("3", {}), "seed": ("1", {}), "out": (None, {}), "prompts": (None, {}),
    "max_new_tokens": ("2", {}), "eos": ("false", {}), "eos_penalty": ("0.5", {}),
    "eos_never": ("true", {}), "eos_rank_last": ("true", {}), "live": ("Thou", {}),
    "pretrained": ("/ckpt", {}), "chat": ("true", {}), "dtype": ("bfloat16", {}),
    "quantize": ("int8", {}), "devices": ("1", {}), "parallel": ("tensor", {}),
    "cfg_scale": ("0.5", {}), "remasking": ("random", {}), "logits_eos_inf": ("true", {}),
    "confidence_eos_eot_inf": ("true", {}), "factor": ("1.0", {"sampler": "confidence"}),
    "alg": ("entropy", {"sampler": "dream"}), "alg_temp": ("0.5", {"sampler": "dream"}),
    "eps": ("0.01", {"sampler": "dream"}),
    # The knobs sample.py gained from the registry (every spec field declared with knob()).
    "block_size": ("4", {"sampler": "fast_dllm_v2"}),
    "sub_block_length": ("2", {"sampler": "fast_dllm_v2"}), "cache": ("true", {}),
    "grid": ("cosine", {}), "schedule": ("cosine", {}), "skip_idle_steps": ("true", {}),
    "count_rule": ("even", {"sampler": "confidence"}),
    "count_schedule": ("cosine", {"sampler": "confidence"}),
    "gumbel_temperature": ("0.5", {"sampler": "confidence"}),
    "score_transformed": ("true", {"sampler": "confidence"}),
    "threshold_floor": ("count", {"sampler": "confidence", "threshold": "0.9"}),
    "final_temperature": ("0.5", {"sampler": "entropy_bounded"}),
    "first_hitting": ("false", {"sampler": "bd3lm"}), "nucleus_p": ("0.5", {"sampler": "bd3lm"}),
    "keep_visible": ("true", {"sampler": "revision"}),
    "loop_t_on": ("0.8", {"sampler": "remask"}), "loop_t_off": ("0.2", {"sampler": "remask"}),
    "sigma": ("rescale", {"sampler": "remask"}),
    "noise_removal": ("false", {"sampler": "mdlm"}),
    "per_row_count": ("true", {"sampler": "dream"}),
    "noise": ("uniform", {"sampler": "uniform_ancestral"}),
    "entropy_bound": ("0.5", GEMMA), "max_temperature": ("0.9", GEMMA),
    "min_temperature": ("0.3", GEMMA), "exponent": ("2.0", GEMMA), "early_stop": ("true", GEMMA),
    "final_renoise": ("true", GEMMA), "entropy_stop": ("0.5", GEMMA),
    "self_condition": ("true", {**GEMMA, "condition_width": "4"}),
    "condition_width": ("4", GEMMA),
    "reference_draws": ("true", {**GEMMA, "reference_length": "2"}),
    "reference_length": ("2", GEMMA),
    "canvases": ("2", {**GEMMA, "sampler": "diffusion_gemma_canvases", "reference_length": "2"}),
    "editing_threshold": ("0.5", {"sampler": "llada21"}),
    "max_post_steps": ("2", {"sampler": "llada21"}),
    "num_to_transfer": ("2", {"sampler": "llada21"}),
    # learned_commit's filter file (a notation) and knobs; the recorders never check its width.
    "filter_file": (FILTER, {"sampler": "learned_commit"}),
    "accept_threshold": ("0.5", {"sampler": "learned_commit", "filter_file": FILTER}),
    "eot_exit": ("true", {"sampler": "learned_commit", "filter_file": FILTER}),
    # order_policy's policy file (a notation) and knob; the recorders never check its length.
    "policy_file": (POLICY, {"sampler": "order_policy"}),
    "policy_temperature": ("0.5", {"sampler": "order_policy", "policy_file": POLICY}),
    # The reference samplers' own (LLaDA2, SDAR, BD3-LM): refused with the LLaDA fixture.
    "minimal_topk": ("2", {}), "denoising_steps": ("2", {}), "eb_threshold": ("0.5", {}),
    "remasking_strategy": ("sequential", {}), "confidence_threshold": ("0.5", {}),
    "steps_per_block": ("2", {}),
}
# Flags given only together: the partner joins the run with the flag.
TOGETHER = {"loop_t_on": {"loop_t_off": "0.2"}, "loop_t_off": {"loop_t_on": "0.8"}}
MODES = {
    "oracle": {"oracle": "true", "num_samples": "4", "batch_size": "4"},
    "workdir": {"workdir": "/run", "num_samples": "4"},
    "prompts": {"workdir": "/run", "prompts": None, "max_new_tokens": "4"},
    "blocks": {"workdir": "/run", "blocks_of": "4", "length": "8", "num_samples": "2"},
    "pretrained": {"pretrained": "/ckpt", "prompts": None, "max_new_tokens": "4"},
}


def _plain(x):
  """A comparable record of an argument."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if isinstance(x, (np.ndarray, jax.Array)):
    return ("array", np.asarray(x).shape, np.asarray(x).tobytes())
  return repr(x)


class Recorder:
  """Stands in for the samplers and `mdjax.load`; keeps what each call was given."""

  def __init__(self, task):
    self.task, self.calls = task, []

  def sample(self, apply_fn, params, key, tokens_BxL, spec, fixed_BxL=None, **kw):
    self.calls.append(("sample", repr(apply_fn), _plain(key), _plain(tokens_BxL), spec,
                       sorted((k, _plain(v)) for k, v in kw.items())))
    tokens = np.asarray(tokens_BxL)
    filled = np.where(tokens == kw["mask_id"], 1, tokens)
    return types.SimpleNamespace(tokens_BxL=filled, nfe=1,
                                 generated_length_B=np.full(len(tokens), tokens.shape[1]))

  def sample_blocks(self, apply_fn, params, key, prompt_BxP, spec, **kw):
    self.calls.append(("blocks", _plain(key), _plain(prompt_BxP), spec,
                       sorted((k, _plain(v)) for k, v in kw.items())))
    prompt = np.asarray(prompt_BxP)
    tokens = np.concatenate([prompt, np.ones((len(prompt), kw["length"]), np.int32)], 1)
    return types.SimpleNamespace(tokens_BxT=tokens, nfe=1,
                                 generated_length_B=np.full(len(prompt), kw["length"]))

  def load(self, path, step=None, dtype=None, **kw):
    """`mdjax.load`: the tiny LLaDA fixture for --pretrained, the real oracle for --oracle,
    a workdir's model whose denoiser is never called otherwise."""
    self.calls.append(("load", path, step, dtype, sorted(kw.items())))
    if path.startswith(loader.ORACLE_PREFIX):
      return self.real_load(path, **kw)
    if path == "/ckpt":
      return self.checkpoint

    def apply_fn(params, tokens_BxL, t_B, valid_BxL=None):
      raise AssertionError("the recorders never call the denoiser")

    # Block-causal: --blocks_of on the exact cache.
    denoiser = Denoiser(apply_fn, block_size=4)
    return model_lib.task_model(self.task, denoiser, None, step=step or 7, source=path)

  def reference(self, workdir, task, tokens_NxL):
    self.calls.append(("reference", workdir, _plain(tokens_NxL)))
    return 1.5


@pytest.fixture(scope="module")
def text_task(tmp_path_factory):
  """A character task of documents (it has an EOS), built without training."""
  config = tiny_config(write_corpus(tmp_path_factory.mktemp("flags") / "corpus.txt"))
  config.task_kwargs.update(documents="packed")
  return tasks.from_config(config)


def _run(sample_cli, recorder, tmp_path, args: dict, seen: dict | None = None):
  """One in-process run: (returncode, a record of everything the run did); `seen` keeps the
  runs done (the same flags run once)."""
  key = tuple(sorted(args.items()))
  if seen is not None and key in seen:
    return seen[key]
  recorder.calls = []
  out_dir = tmp_path / f"out{np.random.default_rng().integers(1 << 30)}"
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "Thou art"}\n{"prompt": "The"}\n{"prompt": "Fair love"}\n')
  fill = {"out": str(out_dir), "prompts": str(prompts)}
  argv = [f"--{k}={fill.get(k, v) if v is None else v}" for k, v in args.items()]
  proc = sample_cli(*argv)
  # Timings vary between runs: decimals are not part of the record.
  printed = re.sub(r"\d+\.\d+", "#", proc.stdout)
  written = sorted((p.name, re.sub(r"\d+\.\d+", "#", p.read_text()))
                   for p in out_dir.glob("*")) if out_dir.exists() else None
  if seen is not None:
    seen[key] = proc, (recorder.calls, printed, written)
  return proc, (recorder.calls, printed, written)


def test_every_flag_in_every_mode_is_used_or_refused(sample_cli, text_task, tmp_path,
                                                     monkeypatch):
  sample_flags = {f.name for f in flags.FLAGS.get_key_flags_for_module(sample)}
  assert sample_flags == set(FLAG_VALUES), "give each sample.py flag a test value"
  recorder = Recorder(text_task)
  monkeypatch.setattr(sample.sampling, "sample", recorder.sample)
  monkeypatch.setattr(sample.sampling, "sample_blocks", recorder.sample_blocks)
  monkeypatch.setattr(sample, "reference_bits_per_char", recorder.reference)
  import mdjax
  from mdjax import io
  recorder.real_load = mdjax.load
  monkeypatch.setattr(mdjax, "load", recorder.load)
  # The tiny LLaDA fixture (its tokenizer and chat template encode the prompts).
  recorder.checkpoint = io.load(os.path.join(REPO, "tests/fixtures/pretrained/llada"))
  table, ignored, unnamed, seen = {}, [], [], {}
  for mode, base in MODES.items():
    assert _run(sample_cli, recorder, tmp_path, base)[0].returncode == 0, mode
    for name, (value, needs) in sorted(FLAG_VALUES.items()):
      without = {**base, **needs}
      with_flag = {**without, name: value, **TOGETHER.get(name, {})}
      if base.get(name, "") == value:  # --oracle, --prompts: what makes the mode
        table[mode, name] = "the mode"
        continue
      plain, plain_record = _run(sample_cli, recorder, tmp_path, without, seen)
      given, given_record = _run(sample_cli, recorder, tmp_path, with_flag)
      if given.returncode:
        message = given.stderr.strip()
        assert "\n" not in message, (mode, name, message)
        outcome = "refused" if plain.returncode == 0 else "family refused"
        if outcome == "refused" and f"--{name}" not in message:  # refused for what it is
          unnamed.append((mode, name, message))
      else:
        outcome = "used" if (plain.returncode or plain_record != given_record) else "IGNORED"
      table[mode, name] = outcome
      if outcome == "IGNORED":
        ignored.append(f"--{name} in {mode} mode")
  print(json.dumps({f"{m}/{n}": o for (m, n), o in sorted(table.items())}, indent=0))
  assert not ignored, f"flags silently ignored: {ignored}"
  assert not unnamed, f"refusals that do not name the flag: {unnamed}"
  # --order needs a task with named fields (scan_and_add), which a workdir of text is not:
  # its family is refused there, so --order cannot be ignored either. Nothing else is.
  # DiffusionGemma's knobs need a uniform-noise model, which only --oracle --noise=uniform is.
  family_refused = {key for key, outcome in table.items() if outcome == "family refused"}
  assert family_refused == {(mode, name)
                            for mode in ("workdir", "prompts", "blocks", "pretrained")
                            for name in ("order", *(n for n, (_, needs) in FLAG_VALUES.items()
                                                    if needs.get("noise") == "uniform"))}
  # The ones the modes exist for are used there.
  for mode, name in (("prompts", "max_new_tokens"), ("prompts", "blocks_of"),
                     ("blocks", "length"), ("blocks", "context"), ("workdir", "step"),
                     ("oracle", "num_samples"), ("prompts", "batch_size"), ("oracle", "order"),
                     ("pretrained", "chat"), ("pretrained", "dtype"), ("pretrained", "cfg_scale"),
                     ("pretrained", "remasking"), ("pretrained", "batch_size"),
                     ("pretrained", "alg"), ("pretrained", "factor")):
    assert table[mode, name] == "used", (mode, name, table[mode, name])
  for mode, name in (("prompts", "length"), ("prompts", "num_samples"), ("prompts", "prefix"),
                     ("workdir", "task"), ("oracle", "step"), ("blocks", "suffix"),
                     ("blocks", "reference"), ("oracle", "max_new_tokens"),
                     ("pretrained", "task"), ("pretrained", "eos"), ("pretrained", "top_k"),
                     ("oracle", "chat"), ("workdir", "cfg_scale")):
    assert table[mode, name] == "refused", (mode, name, table[mode, name])
