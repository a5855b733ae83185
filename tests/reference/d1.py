"""Writes tests/fixtures/rl/d1.npz: d1's diffu-GRPO log-probabilities and loss on the tiny
LLaDA fixture, for mdjax.rl's parity tests.

  pip install -e '.[reference]'
  python -m tests.reference.d1 [--out tests/fixtures/rl]

Transcribed from dllm-reasoning/d1 (commit 837888f, diffu-grpo/diffu_grpo_trainer.py):
`forward_process`, `get_logits`, `_get_per_token_logps` (one mask seed per iteration, all
iterations in one pass), `compute_loss` (clipped ratio, k3 KL, the clip_ratio metric) and
`_generate_and_score_completions`' completion mask (1 up to and including the first EOS);
`self` and the accelerate / TRL plumbing made arguments, nothing else changed except:

  * the model is `tests.reference.pretrained.LladaHF` on tests/fixtures/pretrained/llada
    (LLaDA as a bidirectional transformers LlamaForCausalLM), whose logits have the [MASK]
    column at -inf, as mdjax's contract has it (d1 scores with LLaDA's raw logits; trained
    checkpoints give [MASK] no mass, a random one does). With cfg_scale > 0 the column,
    (-inf) - (-inf) after the combination, is set back to -inf.
  * `set_seed(seed)` (accelerate) is `torch.manual_seed(seed)`: with p_mask_prompt = 0, the
    only setting compared here, the draw decides nothing.

What it writes (float32 unless said): ids (int64, B x L), prompt_length, completion_mask
(int64, d1's from EOS_ID), logps and logps_cfg (B x C, cfg_scale 0 and 0.5), and the loss
cases: old, ref, advantages and per case (`iter1_beta0`: num_iterations 1, beta 0;
`iterN_beta`: num_iterations > 1, beta 0.04, epsilon 0.2) loss, kl, clip_ratio (the policy's
logps are `logps`).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import safetensors.numpy
import torch
import torch.nn.functional as F

from tests.reference.pretrained import CHARS, EOS_ID, MASK_ID, ROOT, LladaHF, save_npz

DEFAULT_OUT = ROOT / "tests" / "fixtures" / "rl"
BATCH, PROMPT_LENGTH, COMPLETION_LENGTH = 4, 6, 10
EPSILON, BETA = 0.2, 0.04


class Args:
  p_mask_prompt = 0.0
  mask_id = MASK_ID
  cfg_scale = 0.0


def forward_process(args, batch, prompt_index, mask_id, seed=None):
  torch.manual_seed(seed)
  b, l = batch.shape
  t_p = torch.ones(b, device=batch.device) * args.p_mask_prompt
  random_matrix = torch.rand((b, l), device=batch.device)
  is_mask_prompt = prompt_index & (random_matrix < t_p.unsqueeze(1))
  is_mask_completion = ~prompt_index
  is_mask = is_mask_prompt | is_mask_completion
  noisy_batch = torch.where(is_mask, mask_id, batch)
  p_mask = torch.where(prompt_index, t_p.unsqueeze(1), torch.ones_like(t_p).unsqueeze(1))
  return noisy_batch, p_mask


def get_logits(model, batch, prompt_index, cfg_scale, mask_id):
  if cfg_scale > 0.0:
    assert len(prompt_index) == batch.shape[1]
    prompt_index = prompt_index.unsqueeze(0).repeat(batch.shape[0], 1)
    un_batch = batch.clone()
    un_batch[prompt_index] = mask_id
    batch = torch.cat([batch, un_batch])
  logits = model(batch).logits
  if cfg_scale > 0.0:
    logits, un_logits = torch.chunk(logits, 2, dim=0)
    logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
    logits[..., mask_id] = -torch.inf  # deviation: see the module docstring
  return logits


def get_per_token_logps(args, model, input_ids, logits_to_keep, mask_seeds):
  num_iterations, batch_size, seq_len = input_ids.size()
  device = input_ids.device
  assert len(mask_seeds) == num_iterations
  prompt_length = seq_len - logits_to_keep
  prompt_index = torch.zeros(seq_len, dtype=torch.bool, device=device)
  prompt_index[:prompt_length] = True
  all_perturbed_seqs, all_expanded_inputs = [], []
  for iter_idx, mask_seed in enumerate(mask_seeds):
    expanded_input = input_ids[iter_idx]
    perturbed_seq, _ = forward_process(args, expanded_input, prompt_index, args.mask_id,
                                       seed=mask_seed)
    all_perturbed_seqs.append(perturbed_seq)
    all_expanded_inputs.append(expanded_input)
  perturbed_seq = torch.cat(all_perturbed_seqs, dim=0)
  expanded_input = torch.cat(all_expanded_inputs, dim=0)
  logits = get_logits(model, perturbed_seq, prompt_index, args.cfg_scale, args.mask_id)
  completion_logits = logits[:, -logits_to_keep:, :]
  completion_targets = expanded_input[:, -logits_to_keep:]
  flat_logits = completion_logits.reshape(-1, completion_logits.size(-1))
  flat_targets = completion_targets.reshape(-1)
  loss = F.cross_entropy(flat_logits, flat_targets, reduction="none")
  completion_log_probs = -loss.view(num_iterations * batch_size, logits_to_keep)
  return completion_log_probs.view(num_iterations, batch_size, logits_to_keep).to(torch.float32)


def compute_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages,
                 completion_mask, *, num_iterations, beta, epsilon):
  """compute_loss after its `_get_per_token_logps` call: (loss, metrics)."""
  metrics = {}
  if beta != 0.0:
    per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                    - (ref_per_token_logps - per_token_logps) - 1)
  old_per_token_logps = (old_per_token_logps if num_iterations > 1
                         else per_token_logps.detach())
  coef_1 = torch.exp(per_token_logps - old_per_token_logps)
  coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
  per_token_loss1 = coef_1 * advantages.unsqueeze(1)
  per_token_loss2 = coef_2 * advantages.unsqueeze(1)
  per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
  if beta != 0.0:
    per_token_loss = per_token_loss + beta * per_token_kl
  loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
  if beta != 0.0:
    metrics["kl"] = ((per_token_kl * completion_mask).sum() / completion_mask.sum()).item()
  is_clipped = (per_token_loss1 < per_token_loss2).float()
  metrics["clip_ratio"] = ((is_clipped * completion_mask).sum() / completion_mask.sum()).item()
  return loss, metrics


def completion_mask_of(completion_ids, eos_token_id):
  device = completion_ids.device
  is_eos = completion_ids == eos_token_id
  eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
  eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
  sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
  return (sequence_indices <= eos_idx.unsqueeze(1)).int()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  weights = safetensors.numpy.load_file(
      str(ROOT / "tests" / "fixtures" / "pretrained" / "llada" / "model.safetensors"))
  model = LladaHF(weights)

  rng = np.random.default_rng(0)
  length = PROMPT_LENGTH + COMPLETION_LENGTH
  ids = rng.integers(0, len(CHARS), (BATCH, length))
  ids[0, PROMPT_LENGTH + 3] = EOS_ID  # rows 0 and 2 end early, 1 and 3 run to the end
  ids[2, PROMPT_LENGTH + 7:] = EOS_ID
  ids_t = torch.from_numpy(ids)
  mask = completion_mask_of(ids_t[:, PROMPT_LENGTH:], EOS_ID)

  d1_args = Args()
  logps = get_per_token_logps(d1_args, model, ids_t[None], COMPLETION_LENGTH, [42])[0]
  d1_args.cfg_scale = 0.5
  logps_cfg = get_per_token_logps(d1_args, model, ids_t[None], COMPLETION_LENGTH, [42])[0]

  # Old and reference log-probabilities near the policy's: with epsilon 0.2 some ratios are
  # clipped, some not, and advantages of both signs.
  old = logps + torch.from_numpy(rng.normal(0, 0.3, logps.shape).astype(np.float32))
  ref = logps + torch.from_numpy(rng.normal(0, 0.3, logps.shape).astype(np.float32))
  advantages = torch.from_numpy(rng.normal(0, 1, BATCH).astype(np.float32))
  out = {"ids": ids, "prompt_length": np.int64(PROMPT_LENGTH), "completion_mask":
         mask.numpy().astype(np.int64), "logps": logps.numpy(), "logps_cfg": logps_cfg.numpy(),
         "old": old.numpy(), "ref": ref.numpy(), "advantages": advantages.numpy(),
         "epsilon": np.float32(EPSILON), "beta": np.float32(BETA)}
  for case, num_iterations, beta in (("iter1_beta0", 1, 0.0), ("iterN_beta", 4, BETA)):
    loss, metrics = compute_loss(logps, old, ref, advantages, mask,
                                 num_iterations=num_iterations, beta=beta, epsilon=EPSILON)
    out[f"{case}_loss"] = np.float32(loss.item())
    out[f"{case}_clip_ratio"] = np.float32(metrics["clip_ratio"])
    out[f"{case}_kl"] = np.float32(metrics.get("kl", np.nan))
  assert 0 < out["iterN_beta_clip_ratio"] < 1, out["iterN_beta_clip_ratio"]
  args.out.mkdir(parents=True, exist_ok=True)
  save_npz(args.out / "d1.npz", out)
  print(f"wrote {args.out / 'd1.npz'}:",
        {k: (v.shape if np.ndim(v) else float(v)) for k, v in out.items()})


if __name__ == "__main__":
  main()
