"""Defaults every config starts from; task configs override what they need."""

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = "two_color"
  c.task_kwargs = ml_collections.ConfigDict()  # task parameters, e.g. max_command_id=9
  c.seed = 0
  c.batch_size = 64
  c.objective = "nelbo"  # or "mlm"
  c.schedule = "linear"  # masking schedule of the NELBO and of evaluation
  c.schedule_kwargs = ml_collections.ConfigDict()  # e.g. power=3 for "polynomial"
  # The forward noise process of objective 'nelbo' (mdjax.noise): "absorbing" (MD4's masking,
  # its NELBO), "uniform" (UDLM's NELBO) or "hybrid" (GIDD's mask + uniform mix, its NELBO).
  c.noise = "absorbing"
  c.hybrid = ml_collections.ConfigDict(dict(p_uniform=0.1, gamma=1.0))  # noise="hybrid" only
  # GIDD's loss weighting (noise "uniform" / "hybrid"): "elbo" (the NELBO itself), "clip" (the
  # ELBO weights clipped to [min_loss_weight, max_loss_weight]), "dynamic" (hybrid only).
  c.gidd = ml_collections.ConfigDict(dict(weighting="elbo", min_loss_weight=0.0,
                                          max_loss_weight=2.0))
  c.num_devices = 0  # 0: all local devices
  c.log_every = 50
  c.eval_every = 0  # evaluate every this many steps (0: never before the end)
  c.eval_at_end = True  # and after the last step (False: no end-of-run evaluation)
  c.eval_batches = 4
  c.num_eval_samples = 200
  c.log_tensorboard = False  # also write metrics for TensorBoard (needs tensorboardX)
  c.model = ml_collections.ConfigDict(dict(
      d_model=64, num_layers=2, num_heads=4, d_ff=256, positions="rope", norm="rms",
      mlp="swiglu", time_conditioning=False, causal=False, dtype="float32",
      # remat: recompute each block's activations in the backward pass (less memory).
      remat=False,
      # block_size: block diffusion (BD3-LM), block-causal attention; a divisor of the length.
      block_size=config_dict.placeholder(int)))
  # The block NELBO's times (models with block_size): BD3-LM's clipped noise range
  # [t_min, t_max] (a training objective, not a bound; evaluation uses the full range) and
  # antithetic times over the batch's blocks.
  c.block_nelbo = ml_collections.ConfigDict(dict(t_min=1e-5, t_max=1.0, antithetic=True))
  c.train = ml_collections.ConfigDict(dict(
      num_steps=1000, lr=1e-3, lr_floor=0.1, warmup_steps=100, b1=0.9, b2=0.99,
      weight_decay=0.0, grad_clip=1.0, ema_decay=0.0, fsdp=False,
      # The batch in grad_accum_steps micro-batches, one optimizer update per step.
      grad_accum_steps=1,
      # MFU's peak FLOP/s per device: None takes the device's known bf16 figure, or a
      # measured matmul when measure_peak_flops (else no MFU is logged).
      peak_flops=config_dict.placeholder(float), measure_peak_flops=False,
      # LoRA (mdjax.lora): adapters of this rank on the targets (q, k, v, o, gate, up, down;
      # groups attention, mlp), scaled by alpha / rank; only they train. rank 0: off.
      # dropout must stay 0 (the adapters are merged into the weights).
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets=("q", "k", "v", "o"),
                                          dropout=0.0)),
      # Layer-wise learning rates: {name: multiplier of lr}, names as lora's targets and
      # groups plus embed, head, norm (e.g. attention=1.0, mlp=0.1); 0 freezes.
      lr_scales=ml_collections.ConfigDict()))
  c.checkpoint = ml_collections.ConfigDict(dict(every=500, keep=3))
  c.sampler = ml_collections.ConfigDict(dict(family="ancestral", steps=32))
  return c


def distill_config(objective: str, num_steps: int, **knobs):
  """A sudoku4 distillation run (configs/distill_*.py): the student started from the teacher
  (`train.init_from`; its model fields left unset, so they are the start's), 64 rows a step at
  a constant 3e-4, the teacher's 3,200 greedy decodings of the bench's puzzles as its data,
  `knobs` the objective's own distill fields; decoded at threshold 0.9, greedily."""
  c = base_config()
  c.task = "sudoku4"
  c.task_kwargs.given_probability = 0.5  # the bench's puzzles (sudoku4.DEFAULT)
  c.objective = objective
  c.batch_size = 64
  c.train.update(init_from="", num_steps=num_steps, lr=3e-4, lr_floor=1.0, warmup_steps=0,
                 weight_decay=0.01)
  c.checkpoint.update(every=100, keep=1)
  c.log_every = 50
  c.eval_batches = 1
  c.num_eval_samples = 0
  c.sampler.update(family="confidence", steps=16, threshold=0.9, temperature=0.0)
  c.distill = ml_collections.ConfigDict(dict(
      teacher=config_dict.placeholder(str), prompt_length=16, num_prompts=3200,
      temperature=0.0, **knobs))
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  return c
