"""The models of `mdjax.bench.accelerators` trained here: a task's teacher (a config of
configs/) and its students (configs/distill_*.py), each in a folder of its own under one
root, a finished run only loaded.

Each task of the trained part has a setting (`SETTINGS`): its teacher's config, the
temperature its teacher and students decode at, and the CDLM student's block. sudoku4's
students decode greedily, the references' setting (the 16 given cells fix the answer);
ScanAndAdd is unconditional (no prompt: the whole sequence is generated), where greedy
decoding would write one sequence for every row, so its teacher's pool and every sampler run
at temperature 1, the law's own, as are permutation and the list tasks (their laws draw the
order or the replaced item: greedy decoding would write one of them), whose teachers are one
config (configs/oracle_task_teacher.py, `module:task`). CDLM's block divides the task's
length (25 = 5 blocks of 5 on ScanAndAdd; the list tasks' prompt, then their answer).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time
from typing import Sequence

from mdjax.accelerators import cdlm, distill

STUDENTS = distill.NAMES + (cdlm.NAME,)  # the bidirectional ones, then the block-causal
STUDENT_CONFIGS = dict(dparallel="distill_dparallel", d3llm="distill_d3llm",
                       cdlm="distill_cdlm")


@dataclasses.dataclass(frozen=True)
class TaskSetting:
  """A task's trained part: its teacher's config module, the decoding temperature of the
  teacher's pool and of every sampler on the trained models, CDLM's block, and the oracle's
  temperatures (`--temperatures`' default)."""

  teacher: str
  temperature: float
  cdlm_block: int
  oracle_temperatures: tuple[float, ...]


SETTINGS = {
    "sudoku4": TaskSetting("sudoku4_teacher", 0.0, 8, (0.0, 1.0)),
    "scan_and_add": TaskSetting("scan_and_add_cpu", 1.0, 5, (1.0,)),
    "permutation": TaskSetting("oracle_task_teacher:permutation", 1.0, 3, (1.0,)),
    **{task: TaskSetting(f"oracle_task_teacher:{task}", 1.0, 4, (1.0,))
       for task in ("list_copy", "list_replace", "list_shuffle")},
}


def setting(task: str) -> TaskSetting:
  """The trained part's setting of `task`, or a ValueError naming those that have one."""
  if task not in SETTINGS:
    raise ValueError(f"task={task!r}: a trained teacher exists for {sorted(SETTINGS)}; "
                     "--teacher_steps=0 runs the oracle alone.")
  return SETTINGS[task]


def config_modules(names: dict) -> dict:
  """configs/ (at the repository root) importable: {name: its module}."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if root not in sys.path:
    sys.path.insert(0, root)
  return {name: importlib.import_module(f"configs.{m}") for name, m in names.items()}


def teacher_config_of(task_setting: TaskSetting):
  """The setting's teacher config: `module` or `module:argument` (train.py's
  --config=configs/module.py:argument), its get_config called with the argument."""
  module, _, argument = task_setting.teacher.partition(":")
  get_config = config_modules({"teacher": module})["teacher"].get_config
  return get_config(argument) if argument else get_config()


def check_sizes(task_setting: TaskSetting, oracle_task) -> None:
  """A ValueError unless the setting's teacher trains on the oracle task's sizes (length and
  vocabulary: `--sizes=tiny` shrinks some oracle tasks, never their teachers)."""
  from mdjax import tasks
  trained = tasks.from_config(teacher_config_of(task_setting))
  if (trained.length, trained.vocab_size) != (oracle_task.length, oracle_task.vocab_size):
    raise ValueError(
        f"task={oracle_task.name!r}: its teacher ({task_setting.teacher}) trains on length "
        f"{trained.length}, vocabulary {trained.vocab_size}, the oracle task here has "
        f"{oracle_task.length}, {oracle_task.vocab_size} (--sizes=tiny shrinks it); run it "
        "with --sizes=full or --teacher_steps=0.")


def finished(workdir: str, num_steps: int) -> bool:
  """Whether `workdir` holds a run's checkpoint at `num_steps`."""
  from mdjax.train import state_io
  return (os.path.isdir(os.path.join(workdir, "checkpoints")) and num_steps in
          state_io.step_dirs(state_io.checkpoint_manager(workdir, read_only=True)))


def _train(config, workdir: str, log) -> dict:
  """Trains `config` in `workdir` (a finished run there is only loaded, without building its
  loss: a student's teacher pool is the teacher's decodings): its record."""
  from mdjax import train
  started = time.perf_counter()
  if not finished(workdir, config.train.num_steps):
    train.train(config, workdir, log=lambda *a: None)
  seconds = time.perf_counter() - started
  trained = train.read_train_seconds(workdir)
  log(f"trained {config.objective}: {workdir} ({config.train.num_steps} steps, {trained or 0:.0f} s "
      f"of training; {seconds:.0f} s in this call)")
  # train_seconds: the run's own training clock (its cost, wherever it was trained);
  # this_run_seconds: this call's (a finished run is only loaded).
  record = {"objective": config.objective, "steps": config.train.num_steps,
            "batch_size": config.batch_size, "train_seconds": trained,
            "this_run_seconds": seconds,
            "model": {k: v for k, v in config.model.to_dict().items() if v is not None}}
  if "distill" in config:  # a student: how many of the teacher's decodings it learned from
    record["num_prompts"] = config.distill.num_prompts
  return record


def student_config(module, teacher_config, teacher_dir: str, task_setting: TaskSetting, *,
                   seed: int, prompt_length: int, generated: int, eval_at_end: bool = False):
  """A student's config (configs/distill_*.py, written for sudoku4) on the teacher's task:
  its task and task fields, the prompt, the pool's temperature, the sampler's steps and
  temperature, CDLM's block (sudoku4's config unchanged by it), `eval_at_end`."""
  config = module.get_config()
  config.seed = seed
  config.task = teacher_config.task
  config.task_kwargs = teacher_config.task_kwargs
  config.train.init_from = teacher_dir
  config.distill.teacher = teacher_dir
  config.distill.prompt_length = prompt_length
  config.distill.temperature = task_setting.temperature
  config.sampler.update(steps=generated, temperature=task_setting.temperature)
  if config.objective == cdlm.NAME:
    config.model.block_size = task_setting.cdlm_block
    config.sampler.block_length = task_setting.cdlm_block
  config.eval_at_end = eval_at_end
  return config


def train_models(root: str, task: str, *, seed: int, prompt_length: int, generated: int,
                 teacher_steps: int | None, student_steps: int | None,
                 students: Sequence[str] = STUDENTS, student_prompts: int | None = None,
                 log=print) -> dict:
  """The task's teacher (`SETTINGS`) and its students (configs/distill_*.py, from the
  teacher, the teacher's own rollouts; `student_prompts` of them, None the configs' 3,200):
  {name: (Model, record)}."""
  import mdjax
  task_setting = setting(task)
  cfgs = config_modules(STUDENT_CONFIGS)
  teacher_config = teacher_config_of(task_setting)
  teacher_config.seed = seed
  if teacher_steps:
    teacher_config.train.num_steps = teacher_steps
    teacher_config.checkpoint.every = teacher_steps
  teacher_dir = os.path.join(root, "teacher")
  models = {"teacher": (None, _train(teacher_config, teacher_dir, log))}
  for name in students:
    config = student_config(cfgs[name], teacher_config, teacher_dir, task_setting, seed=seed,
                            prompt_length=prompt_length, generated=generated)
    if student_steps:
      config.train.num_steps = student_steps
      config.checkpoint.every = student_steps
    if student_prompts:
      config.distill.num_prompts = student_prompts
    models[name] = (None, _train(config, os.path.join(root, name), log))
  return {name: (mdjax.load(os.path.join(root, name)), record)
          for name, (_, record) in models.items()}
