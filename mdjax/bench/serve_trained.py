"""The cached lane against the uncached one on a model trained here, where Fast-dLLM's
threshold fires (`python -m mdjax.bench.serve --parts=cached_trained`: the `cached_trained`
record of results/serve.json; `--parts=cached_trained_partial`: the same recipe trained for
fewer steps, `cached_trained_partial`, whose threshold passes a few positions a step).

`mdjax.bench.serve_cached`'s random checkpoint never reaches the 0.9 threshold, so every
block runs all its 32 steps. Here the same LLaDA-shaped network (`serve_cached.llada_config`)
is trained from a fixed seed for `RECIPE["steps"]` steps on a task whose continuation the
prompt decides: each row counts up modulo `RECIPE["alphabet"]` ids from a random start
(`task_rows`), so a masked position follows from any visible one and its distance. The loss
is LLaDA's SFT NELBO (`diffusion.nelbo_loss` over the response positions, the prompt
visible, per response token) on rows of the served canvas (PROMPT_LEN + MAX_TOKENS), with
AdamW. The weights are saved in the published layout (each record's folder of `RECORDS`, with
the recipe and the training's losses in `TRAIN_FILE`) once and loaded after; a changed recipe
trains again.
The rows are `serve_cached.measure`'s on 16 held-out rows of the task (another seed): both
lanes served and offline, paired, every 16-client request against `mdjax.generate`, and the
steps a block each request took; beside them how many served tokens are the task's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from mdjax.bench import serve_cached
from mdjax.bench.serve_cached import BLOCK, MAX_TOKENS, PROMPT_LEN, PROMPTS

DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "mdjax_bench_serve_llada_trained")
TRAIN_FILE = "mdjax_training.json"
# How the checkpoint is trained (a change trains it again): ~1 s a step on 2 CPU cores.
RECIPE = dict(task="count", alphabet=64, steps=300, batch=16, lr=3e-3, warmup=10,
              lr_floor=0.1, seed=0)
# Fully trained, a block takes ~1 step (the threshold passes all 32 positions at once, so the
# dual cache saves no pass); this many steps of the same recipe (its cosine over them) leave a
# model between that and the random one's 32 steps a block: ~2 positions a step (measured on
# the held-out prompts alone: 160 steps 32 a block, 175 14.9, 200 1.66; the step is steep).
PARTIAL_STEPS = 175
# Each trained record of results/serve.json: its recipe and the folder its checkpoint lives in.
RECORDS = {
    "cached_trained": (RECIPE, DEFAULT_PATH),
    "cached_trained_partial": (dict(RECIPE, steps=PARTIAL_STEPS), DEFAULT_PATH + "_partial"),
}


def task_rows(rng: np.random.Generator, rows: int, alphabet: int) -> np.ndarray:
  """[rows, PROMPT_LEN + MAX_TOKENS] int32: each row (s + position) mod `alphabet`, s drawn
  by `rng`; the first PROMPT_LEN ids are the prompt, the rest its only continuation."""
  start_Bx1 = rng.integers(0, alphabet, (rows, 1))
  return ((start_Bx1 + np.arange(PROMPT_LEN + MAX_TOKENS)[None]) % alphabet).astype(np.int32)


def train(recipe: dict, log=print) -> tuple[dict, dict]:
  """(float32 params, what the training did) of `serve_cached.llada_config()` trained by
  `recipe` (RECIPE's fields)."""
  import jax
  import jax.numpy as jnp
  import optax

  from mdjax import diffusion
  from mdjax.models import published
  from mdjax.train.sft import PublishedView

  config = serve_cached.llada_config()
  denoiser = PublishedView(config).denoiser()  # its mask id is the vocabulary size
  length, batch = PROMPT_LEN + MAX_TOKENS, recipe["batch"]
  maskable_BxL = jnp.broadcast_to(jnp.arange(length) >= PROMPT_LEN, (batch, length))
  schedule = diffusion.get_schedule("linear")  # LLaDA's: weight 1/t
  lr = optax.warmup_cosine_decay_schedule(0.0, recipe["lr"], recipe["warmup"], recipe["steps"],
                                          recipe["lr"] * recipe["lr_floor"])
  optimizer = optax.adamw(lr, weight_decay=0.0)

  def loss_fn(params, key, rows_BxL):
    return diffusion.nelbo_loss(denoiser, params, key, rows_BxL, schedule=schedule,
                                mask_id=config.vocab_size, maskable_BxL=maskable_BxL,
                                per_token=True)[0]

  @jax.jit
  def step(params, opt_state, key, rows_BxL):
    loss, grads = jax.value_and_grad(loss_fn)(params, key, rows_BxL)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(recipe["seed"])
  key, init = jax.random.split(key)
  params = published.init_params(config, init)
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(recipe["seed"])
  losses, started = [], time.perf_counter()
  cpu = serve_cached.cpu_seconds()
  for i in range(recipe["steps"]):
    key, draw = jax.random.split(key)
    rows_BxL = jnp.asarray(task_rows(rng, batch, recipe["alphabet"]))
    params, opt_state, loss = step(params, opt_state, draw, rows_BxL)
    losses.append(float(loss))
    if (i + 1) % 25 == 0:
      log(f"trained {i + 1} steps: loss {np.mean(losses[-25:]):.3f} nats a response token")
  tail = min(25, len(losses))
  info = dict(recipe=recipe, seconds=round(time.perf_counter() - started, 1),
              cpu_s=round(serve_cached.cpu_seconds() - cpu, 1),
              loss_first=round(losses[0], 3), loss_last_mean=round(float(np.mean(losses[-tail:])),
                                                                   3),
              uniform_loss=round(float(np.log(recipe["alphabet"])), 3))
  return jax.device_get(params), info


def checkpoint(path: str = DEFAULT_PATH, recipe: dict | None = None, log=print) -> dict:
  """What the training of the checkpoint at `path` did: that of a checkpoint trained by
  `recipe` (default RECIPE) found there, else of one trained now and written there."""
  from mdjax import io

  recipe = dict(RECIPE if recipe is None else recipe)
  record_path = os.path.join(path, TRAIN_FILE)
  if os.path.exists(record_path) and os.path.exists(os.path.join(path, "config.json")):
    with open(record_path, encoding="utf-8") as f:
      info = json.load(f)
    if info.get("recipe") == recipe:
      return info
  params, info = train(recipe, log)
  io.save(params, path, config=serve_cached.llada_config())
  with open(record_path, "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  log(f"trained the LLaDA-shaped checkpoint ({info['seconds']} s) into {path}")
  return info


def run(*, levels, repeats: int, max_batch: int, seed: int, record: str = "cached_trained",
        log=print) -> dict:
  """The `record` record of results/serve.json (a name of RECORDS: its recipe and folder)."""
  import jax

  import mdjax

  if record not in RECORDS:
    raise ValueError(f"record={record!r}: expected one of {sorted(RECORDS)}")
  recipe, path = RECORDS[record]
  training = checkpoint(path, recipe, log)
  model = mdjax.load(path)
  alphabet = training["recipe"]["alphabet"]
  held_out = task_rows(np.random.default_rng(seed + 1), PROMPTS, alphabet)
  prompts = [[int(t) for t in row[:PROMPT_LEN]] for row in held_out]
  result = serve_cached.measure(
      model, prompts, levels=levels, repeats=repeats, max_batch=max_batch, seed=seed,
      about=dict(shape=serve_cached.SHAPE, weights=f"trained here ({training['recipe']['task']} "
                 f"task, {training['recipe']['steps']} steps)"), log=log)
  # The task's answer against each lane's offline batch (served == offline, checked above).
  right = {}
  for lane, fields in serve_cached.lanes_of(model).items():
    knobs = {k: v for k, v in fields.items() if k not in ("max_tokens", "sampler")}
    out = mdjax.generate(model, prompts, max_new_tokens=MAX_TOKENS, key=jax.random.key(seed),
                         **knobs)
    right[lane] = round(float(np.mean([
        np.mean(np.asarray(c.token_ids[:MAX_TOKENS]) == row[PROMPT_LEN:len(c.token_ids)
                                                            + PROMPT_LEN])
        for c, row in zip(out, held_out)])), 3)
  result["training"] = training
  result["task_tokens_right"] = right
  result["notes"] = notes(result)
  return result


def notes(result: dict) -> str:
  """serve_cached's notes with the training and the task's answers."""
  training = result["training"]
  return (f"{serve_cached.notes(result)} Trained {training['recipe']['steps']} steps at batch "
          f"{training['recipe']['batch']} in {training['seconds']} s ({training['cpu_s']} CPU s): "
          f"loss {training['loss_first']} -> {training['loss_last_mean']} nats a response "
          f"token (uniform over the alphabet: {training['uniform_loss']}); the offline "
          f"batches' tokens equal to the task's: {result['task_tokens_right']}. Blocks of "
          f"{BLOCK}.")
