"""`Model`: any model mdjax samples or scores, as one record.

A train.py workdir, a published Hugging Face folder (LLaDA, Dream, MDLM, BD3-LM, the Llama /
Qwen2 judges) and a task's exact denoiser all load (`mdjax.load`) into a `Model`: the
`Denoiser` and its params, the special ids, the text codec, the length, the family and the
sampler it is sampled with by default (`sampler`). Every consumer (`mdjax.generate`,
sample.py, the lm-eval model, generative perplexity, SFT) takes a `Model`, so none asks where
a model came from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError

WORKDIR_FAMILY = "mdjax"  # a model trained by train.py
ORACLE_FAMILY = "oracle"  # a task's exact denoiser


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
  """How a model's default sampler runs one call: the denoiser it samples (a published
  sampler may wrap the model's: guidance, a prefix cache), the spec, and the params it reads
  (None: the model's). `blocks_of` (with `window`): block by block after a window of context
  (`sampling.sample_blocks`), else one canvas."""

  denoiser: Denoiser
  spec: Any
  params: Any = None
  blocks_of: int | None = None
  window: int | None = None


class DefaultSampler(Protocol):
  """The sampler a model is sampled with when no spec is given: a published checkpoint's
  reference sampler, a workdir's configured one. `knobs` are the keyword arguments `plan`
  takes (its defaults are its own)."""

  knobs: tuple[str, ...]
  # What an mdjax family picked by name inherits unless given (a reference sampler that is
  # greedy by default: {"temperature": 0.0}).
  spec_defaults: dict

  def plan(self, model: "Model", *, prompt_length: int, max_new_tokens: int,
           **knobs) -> SamplerPlan:
    ...


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Model:
  """A loaded model.

  denoiser: the `Denoiser` (carrying the model's `max_len`). params: its parameters (a
  workdir's EMA parameters when it kept them). family: the published family ("llada",
  "dream", "mdlm", "bd3lm", "llama", "qwen2"), "mdjax" for a train.py workdir, "oracle" for a
  task's exact denoiser. vocab_size: the ids a prompt or a sample may hold are [0,
  vocab_size), the mask id among them (a published LLaDA, Dream) or just past them (mdjax's
  models, MDLM, BD3-LM: mask id V). max_len: the positions it holds.
  mask_id: None for a causal LM, a judge or a workdir of objective 'causal' (reading `mask_id`
  is then an ArgumentError, a ValueError). eos_id / eot_id /
  pad_id: end of sequence, end of turn, the id left padding carries (never attended).
  encode(text, add_special_tokens=False) -> ids and decode(ids) -> text: its text codec (None
  for an id-only model). tokenizer: the codec's own object (a `tokenizers.Tokenizer`, a task's
  tokenizer). chat_template: the checkpoint's Jinja template, which `render_chat` renders
  with `chat_renderer` (the published folders' sandboxed Jinja). sampler: the default sampler
  (`DefaultSampler`). takes_padding: False for an exact denoiser, whose positions are fixed
  (prompts of one length, no `valid_BxL`). padding_invariant: a row's logits do not depend
  on the padding before it (positions count from its first real token: mdjax's models,
  Dream), so it can be served on a longer canvas (`mdjax.serve`); LLaDA's positions are
  absolute.

  noise: the `mdjax.noise` process the denoiser is exact under or was trained for (None:
  absorbing, what every sampler assumes).

  Where it came from: config (a workdir's ConfigDict, a published PublishedConfig /
  DiTConfig), source (the folder or workdir), task (a workdir's or oracle's `Task`), step (a
  workdir's checkpoint step); a published folder's hf_config (config.json as read), buffers
  (stored non-parameter tensors, written back by `save`) and bytes_read.
  """

  denoiser: Denoiser
  params: Any
  family: str
  vocab_size: int
  max_len: int
  mask_id_or_none: int | None
  eos_id: int | None = None
  eot_id: int | None = None
  pad_id: int = 0
  encode: Callable[..., list[int]] | None = None
  decode: Callable[[Sequence[int]], str] | None = None
  tokenizer: Any = None
  chat_template: str | None = None
  chat_renderer: Callable[["Model", list], str] | None = None
  sampler: DefaultSampler | None = None
  takes_padding: bool = True
  padding_invariant: bool = False
  noise: Any = None
  config: Any = None
  source: str | None = None
  task: Any = None
  step: int | None = None
  hf_config: dict | None = None
  buffers: dict | None = None
  bytes_read: int = 0

  def __post_init__(self):
    denoiser = Denoiser.of(self.denoiser)
    if denoiser.max_len != self.max_len:
      denoiser = dataclasses.replace(denoiser, max_len=self.max_len)
    object.__setattr__(self, "denoiser", denoiser)

  @property
  def mask_id(self) -> int:
    if self.mask_id_or_none is None:  # every diffusion entry point reads it first
      if self.family == WORKDIR_FAMILY:
        raise ArgumentError("model", f"workdir {self.source!r} holds a causal LM (objective "
                            "'causal'), not a denoiser: the diffusion samplers do not sample "
                            "it. It scores samples (sample.py --reference, mdjax.evaluate."
                            "generative_perplexity) and draws left to right by mdjax.evaluate."
                            "causal_sample.")
      raise ArgumentError("model", f"this {self.family!r} checkpoint is a causal LM: it has no "
                          "mask id and is not sampled by the diffusion samplers; it scores "
                          "samples (mdjax.evaluate.generative_perplexity).")
    return self.mask_id_or_none

  @property
  def causal(self) -> bool:
    """A causal LM (a judge of generative perplexity), not a denoiser."""
    return self.mask_id_or_none is None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The ids a completion ends before: EOS and end of turn."""
    return tuple(dict.fromkeys(i for i in (self.eos_id, self.eot_id) if i is not None))

  @property
  def workdir(self) -> str | None:
    return self.source if self.family == WORKDIR_FAMILY else None

  def render_chat(self, messages: Sequence[dict]) -> str:
    """The messages through the model's chat template, the assistant's turn opened."""
    if self.chat_template is None or self.chat_renderer is None:
      raise ValueError(f"the {self.family!r} model has no chat template (chat_template.jinja "
                       "or tokenizer_config.json's chat_template).")
    return self.chat_renderer(self, list(messages))

  def replace(self, **changes) -> "Model":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ConfiguredSampler:
  """A default sampler by family name and settings (`sampling.make_spec`): a workdir's
  `config.sampler`, or ancestral for a task's exact denoiser. `eos_id` ends rows at the
  model's EOS when the spec leaves it unset; `steps` defaults to `max_new_tokens` (as many steps
  as new tokens: an ancestral step still reveals any number of positions, so two_color's
  oracle writes invalid pairs at 1/(2K) = 25% with K = 2)."""

  family: str = "ancestral"
  settings: tuple[tuple[str, Any], ...] = ()
  eos_id: int | None = None
  spec_defaults = {}

  @property
  def knobs(self) -> tuple[str, ...]:
    return tuple(sorted(f.name for f in dataclasses.fields(self._spec_type())))

  def _spec_type(self):
    name = "ordered" if self.family == "left_to_right" else self.family
    families = sampling.families()
    if name not in families:
      raise ValueError(f"sampler family={self.family!r} is unknown; known: "
                       f"{sorted(families) + ['left_to_right']}.")
    return families[name].spec_type

  def plan(self, model: Model, *, prompt_length: int, max_new_tokens: int,
           **knobs) -> SamplerPlan:
    settings = {**dict(self.settings), **knobs}
    if "steps" in self.knobs and settings.get("steps") is None and self.family != "left_to_right":
      settings["steps"] = max_new_tokens
    if self.eos_id is not None and "eos_id" in self.knobs and settings.get("eos_id") is None:
      settings["eos_id"] = int(self.eos_id)
    return SamplerPlan(model.denoiser, sampling.make_spec(self.family, length=max_new_tokens,
                                                          **settings))


def task_codec(task) -> tuple[Callable | None, Callable | None]:
  """(encode, decode) of a task: its tokenizer's text codec, or for a task without one
  (two_color, scan_and_add) decode only (`task.decode`)."""
  decode = lambda ids: task.decode(np.asarray(ids, np.int32))
  if task.encode is None:
    return None, decode
  encode = lambda text, add_special_tokens=False: [int(i) for i in task.encode(text)]
  return encode, decode


def task_model(task, denoiser, params, *, family: str = WORKDIR_FAMILY,
               sampler: DefaultSampler | None = None, causal: bool = False, **fields) -> Model:
  """The `Model` of a task's denoiser: a trained one (a workdir) or its exact one (family
  "oracle": fixed positions, no padding). `causal`: a left-to-right LM trained on the task
  (objective 'causal'), which has no mask id for the samplers (its start id is the task's)."""
  encode, decode = task_codec(task)
  return Model(denoiser=denoiser, params=params, family=family, vocab_size=task.vocab_size,
               max_len=task.length, mask_id_or_none=None if causal else task.mask_id,
               eos_id=task.eos_id,
               encode=encode, decode=decode, tokenizer=task.tokenizer,
               sampler=sampler or ConfiguredSampler(eos_id=task.eos_id), task=task,
               takes_padding=family != ORACLE_FAMILY,
               padding_invariant=family != ORACLE_FAMILY, **fields)
