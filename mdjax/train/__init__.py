"""Training: a pure train step, optax, orbax checkpoints, data-parallel sharding.

`train(config, workdir)` runs a whole job and resumes from the newest good checkpoint in
`workdir`. It builds the task once (`tasks.from_config`) and passes the `Task` value down.
The batch a step sees is a function of (seed, step), so a resumed run sees exactly what an
uninterrupted one would; the random streams are named in `mdjax.streams`.

The rooms: `state` (factories from the config, the train step, sharding), `state_io`
(orbax saves, the newest readable step, `load`), `config_checks`, `workdir` (the lock,
signals, the metrics log, the train clock), `loop` (`train`, evaluation, progress),
`objectives` (the table of training objectives: each one's loss, start model and export),
`sft` (supervised fine-tuning: start points, its loss and export; it registers the objective
'sft' when imported here, and gives 'nelbo' its start points) and `a2d` (the objective 'a2d':
a model converted from a causal LM, `mdjax.convert`).
"""

from mdjax import tasks
from mdjax.train.state_io import (CORRUPT_DIR, CheckpointMismatch, checkpoint_manager, load,
                                  load_for_sampling, quiet_orbax, restore_latest, save)
from mdjax.train.config_checks import CONFIG_RANGES, OBJECTIVES, ConfigError, check_config
from mdjax.data.pipeline import batch_for_step, eval_batch
from mdjax.train.loop import ensure_trained, evaluate, sample_and_score, train
from mdjax.train import objectives, sft  # sft: registers the objective 'sft'
from mdjax.train import a2d  # registers the objective 'a2d'
from mdjax.train.state import (TrainState, block_nelbo_options, init_state,
                               learning_rate_schedule, make_loss_fn, make_mesh, make_optimizer,
                               masking_schedule, model_config, param_sharding, state_sharding,
                               train_step)
from mdjax.train.workdir import (Interrupts, MetricsLog, TrainClock, UnsafeWorkdir, WorkdirBusy,
                                 WorkdirLock, read_train_seconds)

__all__ = [
    "a2d", "CONFIG_RANGES", "CORRUPT_DIR", "CheckpointMismatch", "ConfigError", "Interrupts", "MetricsLog",
    "OBJECTIVES", "TrainClock", "TrainState", "UnsafeWorkdir", "WorkdirBusy",
    "WorkdirLock", "batch_for_step", "block_nelbo_options", "check_config", "checkpoint_manager",
    "ensure_trained", "eval_batch", "evaluate", "init_state", "learning_rate_schedule", "load",
    "load_for_sampling", "make_loss_fn", "make_mesh", "make_optimizer", "masking_schedule",
    "model_config", "objectives", "param_sharding", "quiet_orbax", "read_train_seconds",
    "restore_latest", "sample_and_score", "save", "sft", "state_sharding", "tasks", "train",
    "train_step",
]
