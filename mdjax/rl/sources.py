"""Where an RL run's prompts come from (`mdjax.rl.trainer`): an id task (its rows a prompt,
possibly empty, then its completion), or a JSONL of text prompts for a published chat model.
A source draws a step's `Prompts` from the step's key and turns completions into the texts
the rewards read."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mdjax import generation, tasks
from mdjax.tasks import sft as sft_data, sudoku4
from mdjax.train.config_checks import ConfigError


@dataclasses.dataclass(frozen=True)
class Prompts:
  """A step's prompts: their ids (P x Lp, left padded), valid flags (None: no padding), the
  texts the rewards read and the answers they check; an id task's also the completions of
  the draws they came from (P x C: a true completion of each, IGPO's hints)."""

  ids_PxLp: np.ndarray
  valid_PxLp: np.ndarray | None
  texts: list
  targets: list
  truths_PxC: np.ndarray | None = None


def _scan_and_add_prompt(params) -> int:
  return params.n + 1  # VALS and the values; the completion: ANS, the answer, OPS, commands


# Leading positions an id task's prompt holds, of the task's parameters (None: prompt-less,
# the completion is the whole row).
PROMPT_LENGTHS = {
    "two_color": lambda params: 0,
    "permutation": lambda params: 0,
    "list_copy": lambda params: params.prompt_length,
    "list_replace": lambda params: params.prompt_length,
    "list_shuffle": lambda params: params.prompt_length,
    "sudoku4": lambda params: sudoku4.CELLS,
    "scan_and_add": _scan_and_add_prompt,
}


class IdTaskSource:
  """Prompts of an id task: the first `prompt_length` positions of fresh draws of the task's
  law, a function of the key (`PROMPT_LENGTHS`: none for two_color and permutation, the
  list for the list tasks, the puzzle for Sudoku 4x4, VALS and the values for ScanAndAdd);
  the completion is the rest of the row. The rewards read the task's decoding of the prompt
  ids and of the completion ids, and the task's parameters as the target (the exact checks
  of `rewards.TASK_CHECKS` take them). Sudoku 4x4 keeps d1's forms, so that d1's `sudoku`
  reward reads them too: the completion as "<answer>DIGITS</answer>", the target
  {"puzzle", "solution"} (d1's CSV strings)."""

  def __init__(self, task: tasks.Task):
    if task.name not in PROMPT_LENGTHS:
      raise ConfigError(f"config field task={task.name!r}: RL prompts come from the id tasks "
                        f"{sorted(PROMPT_LENGTHS)} or rl.prompts (a JSONL file).")
    self.task = task
    self.prompt_length = PROMPT_LENGTHS[task.name](task.params)
    self.completion_length = task.length - self.prompt_length
    self.mask_id = task.mask_id
    self.eos_id = None

  def draw(self, key: jax.Array, count: int) -> Prompts:
    rows = np.asarray(self.task.sample_data(key, count))
    prompt_ids = rows[:, :self.prompt_length]
    if self.task.name == "sudoku4":
      targets = [{"puzzle": r["Puzzle"], "solution": r["Solution"]} for r in sudoku4.to_d1(rows)]
    else:
      targets = [self.task.params] * count
    return Prompts(ids_PxLp=prompt_ids, valid_PxLp=None,
                   texts=[self.task.decode(row) for row in prompt_ids], targets=targets,
                   truths_PxC=rows[:, self.prompt_length:])

  def completion_texts(self, ids_BxL: np.ndarray, completion_mask_BxC) -> list[str]:
    del completion_mask_BxC
    if self.task.name == "sudoku4":
      return [f"<answer>{r['Solution']}</answer>" for r in sudoku4.to_d1(ids_BxL)]
    return [self.task.decode(row) for row in np.asarray(ids_BxL)[:, self.prompt_length:]]


class JsonlSource:
  """Text prompts for a published chat model: the lines of a JSONL file (`rl.prompts`, by
  default the SFT task's `task_kwargs.path`) with "prompt" and "response" (the reference,
  e.g. GSM8K's worked answer) or "messages" (`mdjax.tasks.sft`'s format), and optionally
  "answer" (what the rewards check; default the response). A step draws its prompts
  uniformly (with replacement) by its key; each goes through the start's chat template
  (`chat`), keeps its last `max_prompt_length` ids (d1) and is left padded with EOS,
  padding invalid to the denoiser."""

  def __init__(self, path: str, start: str, opts: dict):
    self.vocab = sft_data.vocabulary(start)
    self.examples = sft_data.read_jsonl(path)
    self.chat = opts["chat"]
    self.prompt_length = opts["max_prompt_length"]
    self.completion_length = opts["max_completion_length"]
    self.mask_id = self.vocab.vocab_size  # mdjax's mask id: the view maps it to the model's
    self.eos_id = self.vocab.eos_id

  def draw(self, key: jax.Array, count: int) -> Prompts:
    picks = np.asarray(jax.random.randint(key, (count,), 0, len(self.examples)))
    # d1 keeps a prompt's end; EOS pads the left, invalid to the denoiser.
    ends = [np.asarray(self.vocab.encode(sft_data.prompt_text(
        self.examples[i], self.vocab, self.chat)), np.int32)[-self.prompt_length:]
            for i in picks]
    ids_PxLp, valid_PxLp, _ = generation.left_padded(
        ends, self.prompt_length, self.eos_id, pad_id=self.eos_id, start=self.prompt_length)
    prompts = [self.examples[i].prompt for i in picks]
    return Prompts(ids_PxLp=ids_PxLp, valid_PxLp=valid_PxLp,
                   texts=[p if isinstance(p, str) else p[-1]["content"] for p in prompts],
                   targets=[self.examples[i].response if self.examples[i].answer is None
                            else self.examples[i].answer for i in picks])

  def completion_texts(self, ids_BxL: np.ndarray, completion_mask_BxC) -> list[str]:
    out = []
    for row, mask in zip(ids_BxL[:, self.prompt_length:], np.asarray(completion_mask_BxC)):
      out.append(self.vocab.decode([int(t) for t, m in zip(row, mask)
                                    if m and t != self.eos_id]))
    return out


def make_source(config, task, opts: dict):
  """The run's prompts: an id task's (`IdTaskSource`), or a JSONL's for a published start (task
  'sft': `rl.prompts`, by default its `task_kwargs.path`)."""
  if config.task == "sft" or opts["prompts"] is not None:
    path = opts["prompts"] or config.task_kwargs.get("path")
    return JsonlSource(path, config.train.init_from, opts)
  return IdTaskSource(task)
