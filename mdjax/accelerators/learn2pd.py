"""Learn2PD's filter objective: the oracle "commit now" labels of a teacher, and the filter
fitted to them (`python -m mdjax.accelerators.learn2pd`).

What the reference does (ims-kdks/Learning-to-Parallel-Decoding: generate_training_data.py,
train.ipynb), and what this module does the same way:

1. The teacher decodes each prompt with the reference sampler (LLaDA's low-confidence
   remasking, one position a step, greedy: `teacher_spec`); its output is the final answer.
2. A second rollout of the same prompt (the "Extremely Greedy Parallel" oracle) proposes
   every position at each step and commits exactly the masked positions of the block whose
   proposal already equals the final token; when a block's proposals repeat the last step's,
   it commits the whole block from the answer (the reference's way out of a stall). Each
   step of each row gives one example: the W proposal probabilities of the block (written
   positions included) and W labels (proposal == final token).
3. The filter (`sampling.commit_filter`: W -> H -> W, ReLU) is fitted to the examples by
   full-batch AdamW (lr 3e-3, PyTorch's weight decay 0.01) on the mean binary cross-entropy
   of its logits, the examples split 80/10/10 (train, validation, test) after one shuffle;
   its weights start as PyTorch's nn.Linear does (uniform in +-1/sqrt(fan in)).

Where it differs, and why:
- The filter's module (the reference's model/small_model.py, class LogisticRegression) was
  not in the snapshot of the reference read here; its use fixes its shape: a (1, 32) block of
  probabilities in, 32 logits out, a checkpoint named layer_2_flan.pth, "a 2-layer MLP, ~2K
  parameters" in the paper. So W -> H -> W with H = 32 (2,112 parameters at W = 32); the
  ReLU between the layers is assumed.
- The reference trains 40,000 epochs; the default here is 4,000 (the loss is flat long
  before on these tasks; `--epochs` sets it).
- A stall at temperature > 0 (proposals redrawn each step never repeat) is also cut after
  `max_block_steps` steps of one block (4 W by default).
- The proposal probabilities are computed in float32 (the reference: float64 on LLaDA).
- The reference's width is its block (32 of 256 generated tokens); on mdjax's oracle tasks
  one block of every generated position is the default (`--block_length` gives blocks).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mdjax import loader, sampling
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError, check
from mdjax.sampling import base, commit_filter, transforms
from mdjax.sampling.families.learned_commit import block_view

SEED = 0
STREAMS = ("teacher", "oracle", "init", "prompts")  # the seed's key split in this order


def stream_keys(seed: int) -> dict:
  """The run's random streams by name: split(key(seed), 4) in `STREAMS` order."""
  return dict(zip(STREAMS, jax.random.split(jax.random.key(seed), len(STREAMS))))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilterConfig:
  """How the labels are made and the filter fitted (the reference's values by default)."""

  rows: int = 512  # prompts the teacher decodes
  temperature: float = 0.0  # of the teacher's and the oracle's proposals (reference: greedy)
  block_length: int | None = None  # the filter's width; None: every generated position
  hidden: int = 32  # H (the reference: 32 inputs, a 2-layer MLP of ~2K parameters)
  epochs: int = 4000  # full-batch AdamW steps (the reference: 40,000)
  lr: float = 3e-3
  weight_decay: float = 0.01  # torch.optim.AdamW's default
  accept_threshold: float = 0.96  # the test split's false positives are counted at it
  max_block_steps: int | None = None  # oracle steps per block before it is forced (None: 4 W)
  seed: int = SEED

  def __post_init__(self):
    for name in ("rows", "hidden", "epochs"):
      value = getattr(self, name)
      check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
            "must be an integer >= 1")
    check(self.rows >= 10, "rows", self.rows, "must be >= 10 (the examples are split 80/10/10)")
    check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
          self.temperature, "must be a finite number >= 0")
    check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0")
    check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
          self.weight_decay, "must be a finite number >= 0")
    check(0.0 <= self.accept_threshold <= 1.0, "accept_threshold", self.accept_threshold,
          "must lie in [0, 1]")
    base.check_block_length(self.block_length)
    check(self.max_block_steps is None or (isinstance(self.max_block_steps, int)
                                           and self.max_block_steps >= 1),
          "max_block_steps", self.max_block_steps, "must be None or an integer >= 1")


def teacher_spec(generated: int, cfg: FilterConfig) -> sampling.ConfidenceSpec:
  """The reference sampler: one position a step (steps = the generation length) by the
  probability of the proposal (LLaDA's low_confidence), blocks of the filter's width."""
  return sampling.ConfidenceSpec(steps=generated, score="prob", count_rule="even",
                                 temperature=cfg.temperature, block_length=cfg.block_length)


@functools.partial(jax.jit, static_argnames=("mask_id", "width", "blocks", "temperature",
                                             "num_steps"))
def _oracle_step(bound, tokens_BxL, final_BxL, prev_BxW, prev_block_B, block_step_B, row_keys_B,
                 index, editable_BxL, max_block_steps, *, mask_id, width, blocks, temperature,
                 num_steps):
  """One step of the Extremely Greedy Parallel oracle: the examples it gives and its commits."""
  masked_BxL = (tokens_BxL == mask_id) & editable_BxL
  view = block_view(editable_BxL, masked_BxL, width, blocks)
  logits_BxLxV = bound(tokens_BxL, 1.0 - index / num_steps)  # the sampler's time at step i
  keys_B = jax.vmap(jax.random.fold_in, (0, None))(row_keys_B, index)
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, temperature=temperature,
                                      top_k=None, top_p=1.0)
  _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
  correct_BxL = values_BxL == final_BxL
  block_values_BxW = view.gather(values_BxL)
  same_block_B = view.block_B == prev_block_B
  block_step_B = jnp.where(same_block_B, block_step_B + 1, 0)
  stalled_B = same_block_B & (block_values_BxW == prev_BxW).all(-1)
  forced_B = stalled_B | (block_step_B + 1 >= max_block_steps)
  commit_BxL = masked_BxL & view.in_block_BxL & (correct_BxL | forced_B[:, None])
  return dict(tokens_BxL=jnp.where(commit_BxL, final_BxL, tokens_BxL),
              features_BxW=view.gather(conf_BxL),
              labels_BxW=view.gather(correct_BxL.astype(jnp.float32)),
              block_values_BxW=block_values_BxW, block_B=view.block_B,
              block_step_B=block_step_B, active_B=masked_BxL.any(-1), forced_B=forced_B)


def oracle_examples(bound: base.BoundDenoiser, canvas_BxL: np.ndarray, fixed_BxL: np.ndarray,
                    final_BxL: np.ndarray, key, *, mask_id: int, width: int, blocks: bool,
                    temperature: float, num_steps: int, max_block_steps: int) -> dict:
  """The oracle's rollout of every row towards `final_BxL`: the examples (features and
  labels, one W-vector each per active row and step) and its steps per row."""
  batch = canvas_BxL.shape[0]
  tokens = jnp.asarray(canvas_BxL)
  editable = jnp.asarray(~fixed_BxL)
  final = jnp.asarray(final_BxL)
  prev = jnp.full((batch, width), -1, jnp.int32)
  prev_block = jnp.full((batch,), -2, jnp.int32)
  block_step = jnp.zeros((batch,), jnp.int32)
  row_keys = jax.random.split(key, batch)
  features, labels = [], []
  steps_B = np.zeros(batch, np.int64)
  forced = 0
  generated = int((~fixed_BxL).sum(-1).max())
  for index in range(generated * max_block_steps + 1):
    out = _oracle_step(bound, tokens, final, prev, prev_block, block_step, row_keys,
                       jnp.int32(index), editable, jnp.int32(max_block_steps), mask_id=mask_id,
                       width=width, blocks=blocks, temperature=float(temperature),
                       num_steps=num_steps)
    active = np.asarray(out["active_B"])
    if not active.any():
      break
    features.append(np.asarray(out["features_BxW"])[active])
    labels.append(np.asarray(out["labels_BxW"])[active])
    steps_B += active
    forced += int(np.asarray(out["forced_B"])[active].sum())
    tokens, prev, prev_block, block_step = (out["tokens_BxL"], out["block_values_BxW"],
                                            out["block_B"], out["block_step_B"])
  if (np.asarray(tokens) != final_BxL).any():
    raise RuntimeError("the oracle rollout did not reach the teacher's answers")
  return {"features_NxW": np.concatenate(features), "labels_NxW": np.concatenate(labels),
          "steps_B": steps_B, "forced_steps": forced}


def _init(key, width: int, hidden: int) -> dict:
  """PyTorch's nn.Linear start: weights and biases uniform in +-1/sqrt(fan in)."""
  k = jax.random.split(key, 4)
  def u(key, shape, fan_in):
    return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) / math.sqrt(fan_in)

  return {"w1": u(k[0], (width, hidden), width), "b1": u(k[1], (hidden,), width),
          "w2": u(k[2], (hidden, width), hidden), "b2": u(k[3], (width,), hidden)}


@functools.partial(jax.jit, static_argnames=("epochs", "lr", "weight_decay"))
def _fit(weights, x_train, y_train, x_val, y_val, *, epochs, lr, weight_decay):
  """Full-batch AdamW on the mean binary cross-entropy; the train and validation loss of
  every epoch."""
  optimizer = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  loss = lambda w, x, y: optax.sigmoid_binary_cross_entropy(
      commit_filter.apply_arrays(w, x), y).mean()

  def epoch(state, _):
    w, opt_state = state
    value, grads = jax.value_and_grad(loss)(w, x_train, y_train)
    updates, opt_state = optimizer.update(grads, opt_state, w)
    w = optax.apply_updates(w, updates)
    return (w, opt_state), (value, loss(w, x_val, y_val))

  (weights, _), (train_E, val_E) = jax.lax.scan(epoch, (weights, optimizer.init(weights)),
                                                None, length=epochs)
  return weights, train_E, val_E


def split(num: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The reference's split after one shuffle: 80% train, 10% validation, the rest test."""
  order = np.random.default_rng(seed).permutation(num)
  a, b = int(num * 0.8), int(num * 0.8) + int(num * 0.1)
  return order[:a], order[a:b], order[b:]


def test_metrics(filt: commit_filter.CommitFilter, x_NxW, y_NxW, threshold: float) -> dict:
  """The notebook's figures at a threshold: accuracy, false positives among the predicted
  commits, false negatives among the predicted non-commits."""
  probs = np.asarray(jax.nn.sigmoid(filt.logits(jnp.asarray(x_NxW))))
  pred = probs > threshold
  y = y_NxW > 0.5
  return {"threshold": threshold, "accuracy": float((pred == y).mean()),
          "false_positive": float((pred & ~y).sum() / max(pred.sum(), 1)),
          "false_negative": float((~pred & y).sum() / max((~pred).sum(), 1)),
          "positive_rate": float(y.mean())}


def fit_filter(features_NxW: np.ndarray, labels_NxW: np.ndarray, cfg: FilterConfig,
               key) -> tuple[commit_filter.CommitFilter, dict]:
  """The filter fitted to the examples, and its losses and test figures."""
  num, width = features_NxW.shape
  check(num >= 10, "rows", cfg.rows, f"gave {num} examples; at least 10 are needed")
  check(commit_filter.CommitFilter.param_count(width, cfg.hidden) <= commit_filter.MAX_PARAMS,
        "hidden", cfg.hidden, f"with width {width} exceeds {commit_filter.MAX_PARAMS} parameters")
  train, val, test = split(num, cfg.seed)
  x, y = jnp.asarray(features_NxW, jnp.float32), jnp.asarray(labels_NxW, jnp.float32)
  weights, train_E, val_E = _fit(_init(key, width, cfg.hidden), x[train], y[train], x[val],
                                 y[val], epochs=cfg.epochs, lr=cfg.lr,
                                 weight_decay=cfg.weight_decay)
  filt = commit_filter.CommitFilter.from_arrays(*(np.asarray(weights[k]) for k in
                                                  ("w1", "b1", "w2", "b2")))
  train_E, val_E = np.asarray(train_E), np.asarray(val_E)
  return filt, {"examples": {"train": len(train), "validation": len(val), "test": len(test)},
                "train_loss": float(train_E[-1]), "validation_loss": float(val_E[-1]),
                "first_train_loss": float(train_E[0]),
                "test": test_metrics(filt, features_NxW[test], labels_NxW[test],
                                     cfg.accept_threshold)}


def train_filter(denoiser, params, canvas_BxL: np.ndarray, fixed_BxL: np.ndarray, cfg: FilterConfig,
                 *, mask_id: int, vocab_size: int | None = None,
                 log=print) -> tuple[commit_filter.CommitFilter, dict]:
  """Labels the teacher's rollouts from `canvas_BxL` (prompts fixed by `fixed_BxL`, the rest
  masked) and fits the filter: (filter, info)."""
  canvas_BxL, fixed_BxL = np.asarray(canvas_BxL, np.int32), np.asarray(fixed_BxL, bool)
  generated = np.unique((~fixed_BxL).sum(-1))
  check(len(generated) == 1, "prompt_length", None, "must leave one generation length per row")
  generated = int(generated[0])
  width = cfg.block_length or generated
  check(generated % width == 0, "block_length", cfg.block_length,
        f"must divide the generation length {generated}")
  max_block_steps = cfg.max_block_steps or 4 * width
  keys = stream_keys(cfg.seed)
  started = time.perf_counter()
  spec = teacher_spec(generated, cfg)
  teacher = sampling.sample(denoiser, params, keys["teacher"], canvas_BxL, spec, fixed_BxL,
                            mask_id=mask_id)
  final_BxL = np.asarray(teacher.tokens_BxL)
  teacher_seconds = time.perf_counter() - started
  bound = base.BoundDenoiser(Denoiser.of(denoiser), params,
                             mask_in_vocab=base.mask_inside(mask_id, vocab_size))
  started = time.perf_counter()
  oracle = oracle_examples(bound, canvas_BxL, fixed_BxL, final_BxL, keys["oracle"], mask_id=mask_id,
                           width=width, blocks=cfg.block_length is not None,
                           temperature=cfg.temperature, num_steps=generated,
                           max_block_steps=max_block_steps)
  label_seconds = time.perf_counter() - started
  started = time.perf_counter()
  filt, fit = fit_filter(oracle["features_NxW"], oracle["labels_NxW"], cfg, keys["init"])
  fit_seconds = time.perf_counter() - started
  info = {
      "method": "learn2pd", "config": dataclasses.asdict(cfg), "width": width,
      "generated": generated, "teacher_spec": repr(spec), "params": filt.num_params,
      "oracle_tpf": generated / float(oracle["steps_B"].mean()),  # as the bench's TPF
      "oracle_forced_steps": oracle["forced_steps"],
      **fit,
      "seconds": {"teacher": teacher_seconds, "labels": label_seconds, "fit": fit_seconds},
  }
  log(f"learn2pd: {len(oracle['labels_NxW'])} examples from {len(canvas_BxL)} rows (oracle "
      f"{info['oracle_tpf']:.2f} tokens a step); filter {width}x{cfg.hidden}x{width} "
      f"({filt.num_params} parameters): loss {fit['first_train_loss']:.3f} -> "
      f"{fit['train_loss']:.3f} (validation {fit['validation_loss']:.3f}); test at "
      f"{cfg.accept_threshold}: false positives {fit['test']['false_positive']:.3f}; "
      f"{teacher_seconds + label_seconds + fit_seconds:.1f} s")
  return filt, info


def prompts(task, rows: int, prompt_length: int, key) -> tuple[np.ndarray, np.ndarray]:
  """(canvas, fixed): `rows` draws of the task's law, positions from `prompt_length` masked."""
  check(0 <= prompt_length < task.length, "prompt_length", prompt_length,
        f"must lie in [0, {task.length - 1}] (the task's length is {task.length})")
  canvas = np.array(task.sample_data(key, rows), np.int32)
  canvas[:, prompt_length:] = task.mask_id
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :prompt_length] = True
  return canvas, fixed


def train_model_filter(model, cfg: FilterConfig, prompt_length: int,
                       log=print) -> tuple[commit_filter.CommitFilter, dict]:
  """`train_filter` on a loaded `mdjax.Model` (a workdir, or a task's exact oracle), its
  prompts drawn from its task's law."""
  if model.task is None:
    raise ArgumentError("model", "the filter's prompts are drawn from the model's task; this "
                        "model has none (a published checkpoint)")
  canvas, fixed = prompts(model.task, cfg.rows, prompt_length, stream_keys(cfg.seed)["prompts"])
  filt, info = train_filter(model.denoiser, model.params, canvas, fixed, cfg,
                            mask_id=model.mask_id, vocab_size=model.vocab_size, log=log)
  info.update(teacher=model.source or model.family, task=model.task.name,
              prompt_length=prompt_length)
  return filt, info


def main(argv: Sequence[str] | None = None, log=print) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True, help="the teacher: a workdir, or a task's "
                      "exact oracle (sudoku4, oracle:permutation)")
  parser.add_argument("--out", required=True, help="the filter file (JSON) to write")
  parser.add_argument("--prompt_length", type=int, default=0,
                      help="positions of each draw kept as the prompt (sudoku4: 16)")
  defaults = FilterConfig()
  for name in ("rows", "hidden", "epochs", "seed"):
    parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
  for name in ("temperature", "lr", "weight_decay", "accept_threshold"):
    parser.add_argument(f"--{name}", type=float, default=getattr(defaults, name))
  parser.add_argument("--block_length", type=int, default=None)
  args = parser.parse_args(argv)

  cfg = FilterConfig(**{name: getattr(args, name) for name in (
      "rows", "hidden", "epochs", "seed", "temperature", "lr", "weight_decay",
      "accept_threshold", "block_length")})
  filt, info = train_model_filter(loader.load(args.model), cfg, args.prompt_length, log=log)
  commit_filter.save_filter(filt, args.out, info)
  log(f"wrote {args.out} ({filt!r})")
  return info


if __name__ == "__main__":
  main()
