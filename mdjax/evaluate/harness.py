"""The lm-evaluation-harness (>= 0.4) model "mdjax": masked diffusion LMs under lm-eval's tasks.

Importing this module registers the model (`lm_eval.api.registry`); `mdjax` itself never
imports lm_eval. lm-eval 0.4 finds models only in its registry, so run its command line
through `python -m mdjax.evaluate.lm_eval` (the same arguments as `lm_eval`), or call
`lm_eval.simple_evaluate(model=MdjaxLM(...), ...)` from Python.

The model is a train.py workdir or a published folder (`checkpoint=DIR`, read by
`mdjax.io.load`), a task's exact denoiser (`task=NAME,oracle=true`), or in Python any of
those as objects (`model=`).

  loglikelihood          `evaluate.loglikelihood` (an estimate of a lower bound on
                         log p(continuation | context)); is_greedy by `check_greedy=true`.
  loglikelihood_rolling  `evaluate.loglikelihood_rolling` over the text's tokens.
  generate_until         any mdjax sampler family (`sampler=` and the spec's knobs) on the
                         left-padded prompts, EOS on, the text cut at the first stop sequence.

Every model argument is in `MODEL_ARGS` (and the spec fields in `SPEC_KNOBS`); any other is a
ValueError listing them.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from mdjax import generation, loader, sampling, tasks
from mdjax.errors import ArgumentError
from mdjax.evaluate.loglikelihood import ESTIMATORS, loglikelihood
from mdjax.evaluate.rolling import loglikelihood_rolling
from mdjax.model import Model

logger = logging.getLogger(__name__)

# The adapter's own arguments (model_args keys), with what they mean.
MODEL_ARGS = {
    "checkpoint": "a train.py workdir or a published Hugging Face folder (config.json: LLaDA, "
                  "Dream)",
    "step": "the workdir's checkpoint step (default: the newest readable)",
    "dtype": "pretrained folders: float32 or bfloat16 (default: the checkpoint's)",
    "add_special_tokens": "pretrained folders: the tokenizer's BOS before each context and "
                          "prompt, as LLaDA's eval (default true)",
    "task": "a task name whose exact denoiser is the model (with oracle=true)",
    "oracle": "true: the task's exact denoiser (task=NAME)",
    "estimator": "loglikelihood's estimator: stratified (default), antithetic or iid",
    "num_samples": "Monte Carlo draws per request (default 64; LLaDA's mc_num is 128)",
    "mc_batch_size": "draws per denoiser call (default 8; divides num_samples); a call sees "
                     "mc_batch_size x batch_size rows",
    "cfg_scale": "LLaDA's unsupervised classifier-free guidance (default 0)",
    "likelihood_eps": "the antithetic estimator's smallest masking probability (1e-3)",
    "check_greedy": "true: is_greedy by LLaDA's greedy check (default false: is_greedy False)",
    "seed": "the PRNG seed of every draw (default 0)",
    "context_bucket": "left-pad contexts to a multiple of this many tokens (default 1: none); "
                      "fewer shapes, fewer compilations; the denoiser must take valid_BxL",
    "max_length": "the longest context + continuation (default: the model's length)",
    "rolling_window": "tokens scored per window of loglikelihood_rolling (default max_length "
                      "// 2)",
    "sampler": "generate_until's sampler family (default confidence)",
    "max_new_tokens": "generate_until: tokens generated per request (default: the request's "
                      "max_gen_toks)",
    "eos": "generate_until: stop rows at the model's EOS (default true)",
    "batch_size": "requests per call (lm-eval's --batch_size; an integer)",
    "max_batch_size": "lm-eval's; unused",
    "device": "lm-eval's; unused (JAX places the arrays)",
    "model": "Python only: a mdjax.Model (mdjax.load)",
    "spec": "Python only: a sampler spec (instead of sampler= and its knobs)",
}
# Sampler spec fields settable as model_args (scalars; see mdjax.sampling).
_NOT_KNOBS = {"groups", "fields", "counts", "notation", "base", "refill", "positions",
              "schedule", "count_schedule", "banned_ids", "score_excluded_ids",
              "record_trajectory", "eos_id"}
SPEC_KNOBS = sorted({f.name for family in sampling.families().values()
                     for f in dataclasses.fields(family.spec_type)} - _NOT_KNOBS)
# Spec defaults of the adapter: greedy values (LLaDA's eval), unless the arguments say otherwise.
DEFAULT_KNOBS = {"temperature": 0.0}


def known_args() -> list[str]:
  return sorted(set(MODEL_ARGS) | set(SPEC_KNOBS))


def check_model_args(args: dict, *, values: bool = False) -> None:
  """A ValueError naming an argument the adapter does not know, and listing those it does;
  with `values`, also the first value `MdjaxLM` would refuse before loading its model (a
  checkpoint that is not a folder, an unknown sampler or estimator, num_samples not a
  multiple of mc_batch_size, ...): the same checks, nothing loaded."""
  unknown = sorted(set(args) - set(known_args()))
  if unknown:
    raise ValueError(f"model_args {unknown} unknown to the mdjax model; known: "
                     f"{', '.join(known_args())}.")
  if values:
    parameters = inspect.signature(MdjaxLM.__init__).parameters
    given = {**{name: p.default for name, p in parameters.items()
                if p.default is not inspect.Parameter.empty}, **args}
    _one_source(given["checkpoint"], given["task"], given["oracle"], given["model"])
    _settings(**{k: v for k, v in given.items() if k in parameters},
              knobs={k: v for k, v in args.items() if k not in parameters})


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
  """The model (`mdjax.Model`) and the text codec lm-eval's requests go through."""

  model: Model
  encode: Callable[[str], list[int]]  # a text that starts a sequence (BOS, if any, added)
  decode: Callable[[Sequence[int]], str]
  encode_plain: Callable[[str], list[int]]  # a piece inside one

  # The model's fields the adapter reads, by their names.
  denoiser = property(lambda self: self.model.denoiser)
  params = property(lambda self: self.model.params)
  mask_id = property(lambda self: self.model.mask_id)
  max_len = property(lambda self: self.model.max_len)
  eos_id = property(lambda self: self.model.eos_id)
  pad_id = property(lambda self: self.model.pad_id)


def word_codec(task) -> tuple[Callable, Callable]:
  """Text codec of a task without a tokenizer (two_color, scan_and_add): each id is the word
  `task.decode` writes for it, words separated by whitespace."""
  words = [task.decode([i]) for i in range(task.vocab_size)]
  ids = {w: i for i, w in enumerate(words)}

  def encode(text: str) -> list[int]:
    unknown = [w for w in text.split() if w not in ids]
    if unknown:
      raise ValueError(f"text holds {unknown[:3]} outside task {task.name!r}'s words {words}.")
    return [ids[w] for w in text.split()]

  return encode, lambda ids_: " ".join(words[int(i)] for i in ids_)


def backend_of(model: Model, add_special_tokens: bool = True) -> Backend:
  """The adapter's view of a model: a published checkpoint's tokenizer (BOS before a
  sequence with add_special_tokens, as LLaDA's eval), a task's codec, or a task's words."""
  if model.noise is not None:  # the estimators mask positions: an absorbing model's bound
    raise ArgumentError("model", f"the {model.family!r} model at {model.source!r} denoises "
                        f"{model.noise.name} noise; lm-eval's log-likelihoods are estimated "
                        "by masking (absorbing noise) and would not bound its likelihood.")
  if model.encode is not None:
    special = add_special_tokens and model.task is None  # a task's codec has no BOS
    encode = lambda text: list(model.encode(text, add_special_tokens=special))
    plain = lambda text: list(model.encode(text, add_special_tokens=False))
    return Backend(model, encode, model.decode, plain)
  if model.task is not None:
    encode, decode = word_codec(model.task)
    return Backend(model, encode, decode, encode)
  raise ValueError(f"the {model.family!r} model at {model.source!r} has no tokenizer: "
                   "lm-eval's requests are texts.")


def _one_source(checkpoint, task, oracle, model) -> None:
  """A ValueError unless exactly one model source is given: a checkpoint folder, a task's
  exact denoiser (a known task, oracle=true) or a model object."""
  given = [name for name, value in (("checkpoint", checkpoint), ("task", task),
                                    ("model", model)) if value is not None]
  if len(given) != 1:
    raise ValueError(f"give exactly one of checkpoint=DIR, task=NAME (with oracle=true) or "
                     f"model=; got {given or 'none'}.")
  if checkpoint is not None and not os.path.isdir(checkpoint):
    raise ValueError(f"checkpoint={checkpoint!r} is not a folder (a train.py workdir or a "
                     "published Hugging Face folder).")
  if task is not None:
    if task not in tasks.TASKS:
      raise ValueError(f"task={task!r} is unknown; known: {sorted(tasks.TASKS)}.")
    if oracle is not True:
      raise ValueError(f"task={task!r} needs oracle=true (the task's exact denoiser is the "
                       "model); a trained model is checkpoint=DIR.")


def load_backend(checkpoint=None, step=None, dtype=None, task=None, oracle=False,
                 model=None, add_special_tokens: bool = True) -> Backend:
  """The model of the arguments (`mdjax.load` of a folder or a task's exact denoiser, or a
  `Model` given) and its codec."""
  _one_source(checkpoint, task, oracle, model)
  if model is None:
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if step is not None:
      kwargs["step"] = step
    model = loader.load(checkpoint if task is None else loader.ORACLE_PREFIX + task, **kwargs)
  if not isinstance(model, Model):
    raise ValueError(f"model={type(model).__name__} must be a mdjax.Model (mdjax.load).")
  return backend_of(model, add_special_tokens)


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r} must be an integer >= 1.")
  return int(value)


def _settings(*, estimator, num_samples, mc_batch_size, batch_size, context_bucket, sampler,
              max_new_tokens, spec, knobs: dict, **_) -> types.SimpleNamespace:
  """The adapter's settings checked (a ValueError naming the first one refused) and
  normalised: every check `MdjaxLM` makes before it loads a model."""
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is unknown; known: {list(ESTIMATORS)}.")
  num_samples = _positive_int("num_samples", num_samples)
  mc_batch_size = _positive_int("mc_batch_size", mc_batch_size)
  if num_samples % mc_batch_size:
    raise ValueError(f"num_samples={num_samples} must be a multiple of "
                     f"mc_batch_size={mc_batch_size}.")
  if isinstance(batch_size, str) and batch_size.isdigit():
    batch_size = int(batch_size)
  if spec is not None and knobs:
    raise ValueError(f"spec= carries the sampler's knobs; {sorted(knobs)} given as well.")
  if spec is None and sampler not in sampling.families() and sampler != "left_to_right":
    raise ValueError(f"sampler={sampler!r} is unknown; known: "
                     f"{sorted(sampling.families()) + ['left_to_right']}.")
  out = types.SimpleNamespace(
      num_samples=num_samples, mc_batch_size=mc_batch_size,
      batch_size=_positive_int("batch_size", batch_size),
      context_bucket=_positive_int("context_bucket", context_bucket),
      knobs={**DEFAULT_KNOBS, **knobs} if spec is None else {},
      max_new_tokens=None if max_new_tokens is None else _positive_int(
          "max_new_tokens", max_new_tokens))
  if spec is None:  # a bad knob fails now, before the checkpoint loads
    _sampler_spec(sampler, out.knobs, out.max_new_tokens or 8)
  return out


def _sampler_spec(sampler: str, knobs: dict, max_new_tokens: int) -> sampling.SamplerSpec:
  """`sampler=` with its knobs (steps defaults to one token a step)."""
  fields = {f.name for f in dataclasses.fields(
      sampling.families()["ordered" if sampler == "left_to_right" else sampler].spec_type)}
  knobs = {k: v for k, v in knobs.items() if k in fields or k not in DEFAULT_KNOBS}
  if "steps" in fields and "steps" not in knobs:
    knobs["steps"] = max_new_tokens
  try:
    return sampling.make_spec(sampler, length=max_new_tokens, **knobs)
  except TypeError as error:  # a required field that is no scalar (groups, fields)
    raise ValueError(f"sampler={sampler!r} cannot be built from model_args: "
                     f"{error}; pass spec= from Python.") from None


def _cut(text: str, until: Sequence[str]) -> str:
  """The text before the first stop sequence (lm-eval's `until`)."""
  for stop in until:
    if stop:
      text = text.split(stop)[0]
  return text


@register_model("mdjax")
class MdjaxLM(LM):
  """An mdjax denoiser as an lm-eval model; arguments in `MODEL_ARGS` and `SPEC_KNOBS`."""

  def __init__(self, checkpoint: str | None = None, step: int | None = None,
               dtype: str | None = None, task: str | None = None, oracle: bool = False,
               add_special_tokens: bool = True,
               estimator: str = "stratified", num_samples: int = 64, mc_batch_size: int = 8,
               cfg_scale: float = 0.0, likelihood_eps: float = 1e-3, check_greedy: bool = False,
               seed: int = 0, context_bucket: int = 1, max_length: int | None = None,
               rolling_window: int | None = None, sampler: str = "confidence",
               max_new_tokens: int | None = None, eos: bool = True, batch_size: Any = 1,
               max_batch_size: Any = None, device: Any = None, model: Any = None,
               spec: sampling.SamplerSpec | None = None, **knobs):
    super().__init__()
    check_model_args(knobs)
    del max_batch_size, device  # lm-eval passes them to every model
    settings = _settings(estimator=estimator, num_samples=num_samples,
                         mc_batch_size=mc_batch_size, batch_size=batch_size,
                         context_bucket=context_bucket, sampler=sampler,
                         max_new_tokens=max_new_tokens, spec=spec, knobs=knobs)
    self.num_samples, self.mc_batch_size = settings.num_samples, settings.mc_batch_size
    self.batch_size, self.context_bucket = settings.batch_size, settings.context_bucket
    self.knobs, self.max_new_tokens = settings.knobs, settings.max_new_tokens
    self.sampler, self.spec, self.eos = sampler, spec, bool(eos)
    self.backend = load_backend(checkpoint, step, dtype, task, oracle, model,
                                bool(add_special_tokens))
    self.max_len = self.backend.max_len
    if max_length is not None:
      if _positive_int("max_length", max_length) > self.backend.max_len:
        raise ValueError(f"max_length={max_length} exceeds the model's "
                         f"{self.backend.max_len} positions.")
      self.max_len = int(max_length)
    self.rolling_window = rolling_window
    self.estimator, self.cfg_scale = estimator, float(cfg_scale)
    self.likelihood_eps, self.check_greedy = float(likelihood_eps), bool(check_greedy)
    self.key = jax.random.key(int(seed))

  # --------------------------------------------------------------------------
  # Chat (lm-eval's --apply_chat_template): the checkpoint's own template.
  # --------------------------------------------------------------------------

  @property
  def tokenizer_name(self) -> str:
    model = self.backend.model
    return (model.source or "pretrained") if model.task is None else "mdjax"

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.backend.model.chat_template or ""

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The messages through the checkpoint's chat template, the assistant's turn opened
    (`mdjax.io.render_chat`); a ValueError for a model without one."""
    model = self.backend.model
    if not model.chat_template:
      raise ValueError("--apply_chat_template needs a pretrained folder with a chat template.")
    return model.render_chat(chat_history)

  # --------------------------------------------------------------------------
  # loglikelihood
  # --------------------------------------------------------------------------

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context move to the continuation; the pair is
    encoded whole and the context's ids cut off it (word boundaries as in running text)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(self.backend.encode(context + continuation))
    context_ids = list(self.backend.encode(context))
    if whole[:len(context_ids)] != context_ids:  # the tokenizer merged across the boundary
      return context_ids, list((self.backend.encode_plain or self.backend.encode)(continuation))
    return context_ids, whole[len(context_ids):]

  def _fit(self, context_ids, continuation_ids, where: str) -> list[int]:
    """The context cut from the left so that context + continuation fit max_length."""
    if not continuation_ids:
      raise ValueError(f"{where}: the continuation encodes to no token; nothing to score.")
    if len(continuation_ids) > self.max_len:
      raise ValueError(f"{where}: the continuation has {len(continuation_ids)} tokens, more "
                       f"than max_length={self.max_len}.")
    return list(context_ids)[max(0, len(context_ids) + len(continuation_ids) - self.max_len):]

  def score(self, pairs: Sequence[tuple[list[int], list[int]]], disable_tqdm: bool = True
            ) -> list[tuple[float, bool]]:
    """(log-likelihood estimate, is_greedy) of each (context ids, continuation ids).

    Requests are grouped by shape: the continuation's length and the context's, rounded up
    to `context_bucket` (left padding, not attended); each group runs in calls of
    `batch_size` rows (the last one filled with copies), so each shape compiles once. All
    calls share one key: a request's estimate does not depend on its batch, and candidates
    of one context are compared under common random numbers.
    """
    bucket = self.context_bucket
    shapes: dict[tuple[int, int], list[int]] = {}
    fitted = []
    for index, (context, continuation) in enumerate(pairs):
      context = self._fit(context, continuation, f"request {index}")
      fitted.append((context, list(continuation)))
      width = min(-(-len(context) // bucket) * bucket, self.max_len - len(continuation))
      shapes.setdefault((width, len(continuation)), []).append(index)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    pad = self.backend.pad_id
    steps = [(shape, rows[i:i + self.batch_size]) for shape, rows in
             sorted(shapes.items(), key=lambda item: -sum(item[0]))
             for i in range(0, len(rows), self.batch_size)]
    progress = _progress(len(pairs), "mdjax loglikelihood", disable_tqdm)
    for (width, length), rows in steps:
      filled = rows + [rows[-1]] * (self.batch_size - len(rows))
      context_BxC = np.full((len(filled), width), pad, np.int32)
      valid_BxC = np.zeros((len(filled), width), bool)
      for b, index in enumerate(filled):
        ids = fitted[index][0]
        if ids:
          context_BxC[b, width - len(ids):], valid_BxC[b, width - len(ids):] = ids, True
      continuation_BxT = np.array([fitted[index][1] for index in filled], np.int32)
      result = loglikelihood(
          self.backend.denoiser, self.backend.params, context_BxC, continuation_BxT,
          estimator=self.estimator, num_samples=self.num_samples,
          batch_size=self.mc_batch_size, key=self.key, mask_id=self.backend.mask_id,
          cfg_scale=self.cfg_scale, max_len=self.max_len, eps=self.likelihood_eps,
          check_greedy=self.check_greedy,
          context_valid_BxC=valid_BxC if bucket > 1 else None)
      for b, index in enumerate(rows):
        greedy = bool(result.is_greedy_B[b]) if self.check_greedy else False
        out[index] = (float(result.estimate_B[b]), greedy)
      progress.update(len(rows))
    progress.close()
    return out

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    pairs = [self.encode_pair(*request.args) for request in requests]
    results = self.score(pairs, disable_tqdm=disable_tqdm)
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", request.args, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """log p of each text by `evaluate.loglikelihood_rolling` (windows of `rolling_window`
    tokens, each given up to max_length - rolling_window tokens before it)."""
    out = []
    for index, request in enumerate(_progress(requests, "mdjax rolling", disable_tqdm)):
      ids = np.asarray(self.backend.encode(request.args[0]), np.int32)
      if not len(ids):
        raise ValueError(f"request {index}: the text encodes to no token; nothing to score.")
      result = loglikelihood_rolling(
          self.backend.denoiser, self.backend.params, ids, max_len=self.max_len,
          window=self.rolling_window, key=self.key, mask_id=self.backend.mask_id,
          estimator=self.estimator, num_samples=self.num_samples,
          batch_size=self.mc_batch_size, rows=self.batch_size, cfg_scale=self.cfg_scale,
          eps=self.likelihood_eps)
      out.append(result.estimate)
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, result.estimate)
    return out

  # --------------------------------------------------------------------------
  # generate_until
  # --------------------------------------------------------------------------

  def _base_spec(self, max_new_tokens: int) -> sampling.SamplerSpec:
    """`spec=`, or `sampler=` with its knobs (steps defaults to one token a step)."""
    if self.spec is not None:
      return self.spec
    return _sampler_spec(self.sampler, self.knobs, max_new_tokens)

  def spec_for(self, max_new_tokens: int) -> sampling.SamplerSpec:
    """The sampler spec for `max_new_tokens` new tokens, EOS added unless eos=false."""
    spec = self._base_spec(max_new_tokens)
    if self.eos and self.backend.eos_id is not None and spec.eos_id is None:
      spec = generation.with_eos(spec, self.backend.eos_id)
    return spec

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's completion, cut at its first stop sequence.

    Requests with the same generation arguments are generated together, `batch_size` prompts
    a batch, each prompt left-padded (the padding not attended) and cut from the left to
    max_length - max_new_tokens tokens. max_new_tokens: the adapter's, or the request's
    max_gen_toks (lm-eval's default 256), rounded up to whole blocks of the spec's
    block_length, the text then cut to max_gen_toks tokens. Row i of a group draws with
    fold_in(key, i).
    """
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
      kwargs = dict(request.args[1]) if len(request.args) > 1 else {}
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      wanted = self.max_new_tokens or int(kwargs.pop("max_gen_toks", 256))
      groups.setdefault((tuple(until), wanted), []).append(index)
    out = [""] * len(requests)
    progress = _progress(len(requests), "mdjax generate_until", disable_tqdm)
    for number, ((until, wanted), indices) in enumerate(groups.items()):
      spec = self.spec_for(wanted)
      block = sampling.family_of(spec).block_length(spec)
      new = -(-wanted // block) * block if block else wanted
      if new >= self.max_len:
        raise ValueError(f"max_new_tokens={new} leaves no room for a prompt in the model's "
                         f"{self.max_len} positions.")
      prompts = [np.asarray(self.backend.encode(requests[i].args[0]),
                            np.int32)[-(self.max_len - new):] for i in indices]
      token_ids = self._generate(prompts, spec, new, jax.random.fold_in(self.key, number))
      for index, ids in zip(indices, token_ids):
        text = _cut(self.backend.decode(np.asarray(ids)[:wanted]), until)
        out[index] = text
        self.cache_hook.add_partial("generate_until", requests[index].args, text)
      progress.update(len(indices))
    progress.close()
    return out

  def _generate(self, prompts: list[np.ndarray], spec, new: int, key) -> list[np.ndarray]:
    """The new ids of each prompt, up to its EOS (or end of turn): `mdjax.generate`, row i
    drawing with fold_in(key, i)."""
    return generation.generate(self.backend.model, prompts, spec=spec, max_new_tokens=new,
                               key=key, batch_size=self.batch_size).token_ids


def _progress(total, desc: str, disable: bool):
  from tqdm import tqdm
  return tqdm(total, desc=desc, disable=disable) if not isinstance(total, int) else tqdm(
      total=total, desc=desc, disable=disable)
