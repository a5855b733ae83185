"""Bad input to the Python API: a ValueError that names the argument, before any compile.

Each case is (what is called, the argument's name the message must contain).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, sampling
from mdjax.tasks import two_color
from tests import stubs
from tests.sampling.common import LENGTH, VOCAB, prompted_canvas

PARAMS = stubs.stub_params(VOCAB, LENGTH)
TOKENS = prompted_canvas(batch=2)


def _sample(spec=None, tokens=TOKENS, key=jax.random.key(0), fixed=None, apply_fn=None,
            **kwargs):
  spec = spec or sampling.ConfidenceSpec(steps=4)
  return sampling.sample(apply_fn or stubs.stub_denoiser, PARAMS, key, tokens, spec, fixed,
                         **kwargs)


def _with_mask_class(params, tokens_BxL, t_B):
  # V + 1 logits: the mask class included (the embedding has V + 1 rows).
  logits = stubs.stub_denoiser(params, tokens_BxL, t_B)
  return jnp.concatenate([logits, jnp.zeros_like(logits[..., :1])], -1)


def _with_aux(params, tokens_BxL, t_B):
  return stubs.stub_denoiser(params, tokens_BxL, t_B), {"aux": 0}


def _nelbo(**kwargs):
  x_BxL = jnp.zeros((2, 2), jnp.int32)
  knobs = dict(schedule=diffusion.LinearSchedule(), mask_id=two_color.MASK_ID) | kwargs
  return diffusion.nelbo_loss(two_color.exact_denoiser, None, jax.random.key(0), x_BxL, **knobs)


CASES = {
    # Shared knobs.
    "temperature_negative": (lambda: sampling.AncestralSpec(steps=2, temperature=-1.0), "temperature"),
    "temperature_nan": (lambda: sampling.AncestralSpec(steps=2, temperature=float("nan")), "temperature"),
    "temperature_traced": (lambda: jax.jit(lambda t: sampling.AncestralSpec(steps=2, temperature=t).steps)(0.5), "temperature"),
    "temperature_string": (lambda: sampling.AncestralSpec(steps=2, temperature="hot"), "temperature"),
    "top_k_bool": (lambda: sampling.ConfidenceSpec(steps=2, top_k=True), "top_k"),
    "top_k_zero": (lambda: sampling.ConfidenceSpec(steps=2, top_k=0), "top_k"),
    "top_k_float": (lambda: sampling.ConfidenceSpec(steps=2, top_k=2.5), "top_k"),
    "top_p_zero": (lambda: sampling.ConfidenceSpec(steps=2, top_p=0.0), "top_p"),
    "min_p_above_one": (lambda: sampling.ConfidenceSpec(steps=2, min_p=2.0), "min_p"),
    "skip_idle_steps": (lambda: sampling.ConfidenceSpec(steps=2, skip_idle_steps="auto"), "skip_idle_steps"),
    "steps_zero": (lambda: sampling.AncestralSpec(steps=0), "steps"),
    "steps_float": (lambda: sampling.AncestralSpec(steps=2.0), "steps"),
    "block_length_zero": (lambda: sampling.ConfidenceSpec(steps=2, block_length=0), "block_length"),
    # Schedules: a name works, anything else is refused by name.
    "schedule_unknown_name": (lambda: sampling.AncestralSpec(steps=2, schedule="exp"), "schedule"),
    "schedule_number": (lambda: sampling.AncestralSpec(steps=2, schedule=1.0), "schedule"),
    "count_schedule_unknown": (lambda: sampling.ConfidenceSpec(steps=2, count_schedule="sqrt"), "count_schedule"),
    # Family knobs.
    "threshold_negative": (lambda: sampling.ConfidenceSpec(steps=2, threshold=-1.0), "threshold"),
    "threshold_above_one": (lambda: sampling.ConfidenceSpec(steps=2, threshold=2.0), "threshold"),
    "threshold_nan": (lambda: sampling.ConfidenceSpec(steps=2, threshold=float("nan")), "threshold"),
    "threshold_entropy_positive": (lambda: sampling.ConfidenceSpec(steps=2, threshold=0.5, score="neg_entropy"), "threshold"),
    "score_unknown": (lambda: sampling.ConfidenceSpec(steps=2, score="entropy"), "score"),
    "groups_flat": (lambda: sampling.OrderedSpec(groups=list(range(LENGTH))), "groups"),
    "groups_repeated": (lambda: sampling.OrderedSpec(groups=((4, 5), (5,))), "groups"),
    "groups_missing": (lambda: _sample(sampling.OrderedSpec(groups=((4, 5),))), "groups"),
    "grid_unknown": (lambda: sampling.AncestralSpec(steps=2, grid="log"), "grid"),
    "sigma_unknown": (lambda: sampling.RemaskSpec(steps=2, sigma="max"), "sigma"),
    # The call.
    "key_int": (lambda: _sample(key=0), "key"),
    "key_none": (lambda: _sample(key=None), "key"),
    "key_rows": (lambda: _sample(key=jax.random.split(jax.random.key(0), 3)), "key"),
    "tokens_1d": (lambda: _sample(tokens=TOKENS[0]), "tokens_BxL"),
    "tokens_float": (lambda: _sample(tokens=TOKENS.astype(jnp.float32)), "tokens_BxL"),
    "tokens_no_rows": (lambda: _sample(tokens=TOKENS[:0]), "tokens_BxL"),
    "tokens_out_of_range": (lambda: _sample(tokens=TOKENS.at[0, 0].set(VOCAB + 3)), "tokens_BxL"),
    "fixed_shape": (lambda: _sample(fixed=np.ones((2, 3), bool)), "fixed_BxL"),
    "fixed_on_mask": (lambda: _sample(fixed=np.ones(TOKENS.shape, bool)), "fixed_BxL"),
    "spec_not_a_spec": (lambda: sampling.sample(stubs.stub_denoiser, PARAMS, jax.random.key(0), TOKENS, "confidence"), "spec"),
    "block_length_not_dividing": (lambda: _sample(sampling.ConfidenceSpec(steps=4, block_length=3)), "block_length"),
    "denoiser_with_mask_class": (lambda: _sample(apply_fn=_with_mask_class), "mask_id"),
    "mask_id_above_vocabulary": (lambda: _sample(apply_fn=_with_mask_class, mask_id=VOCAB + 2), "mask_id=8"),
    "mask_id_negative": (lambda: _sample(mask_id=-1), "mask_id=-1"),
    "denoiser_logits_wrong_length": (lambda: _sample(apply_fn=lambda p, x, t: stubs.stub_denoiser(p, x, t)[:, 1:]), "apply_fn"),
    "denoiser_returns_tuple": (lambda: _sample(apply_fn=_with_aux), "apply_fn"),
    # The loss.
    "nelbo_schedule_name_unknown": (lambda: _nelbo(schedule="lin"), "schedule"),
    "nelbo_mask_id_wrong": (lambda: _nelbo(mask_id=two_color.MASK_ID + 1), "mask_id"),
    "nelbo_mask_id_float": (lambda: _nelbo(mask_id=2.0), "mask_id"),
    "nelbo_num_steps_negative": (lambda: _nelbo(num_steps=-1), "num_steps"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_the_argument(name):
  call, argument = CASES[name]
  with pytest.raises(ValueError, match=argument):
    call()


def test_schedule_names_are_accepted_where_schedules_are():
  assert sampling.AncestralSpec(steps=2, schedule="cosine").schedule == diffusion.CosineSchedule()
  assert (sampling.ConfidenceSpec(steps=2, count_schedule="cosine").count_schedule
          == diffusion.CosineSchedule())
  loss, _ = _nelbo(schedule="linear")
  assert np.isfinite(float(loss))
  spec = sampling.ConfidenceSpec(steps=2, temperature=jnp.array(0.5))  # a concrete scalar
  assert spec.temperature == 0.5 and isinstance(spec.temperature, float)


def test_inside_jit_invalid_values_and_unfilled_positions_are_reported():
  # Values cannot be read before the run inside the caller's jit: the result counts them.
  spec = sampling.OrderedSpec(groups=((4, 5, 6, 7), (8, 9)))  # misses positions 10 and 11
  run = jax.jit(lambda tokens: _sample(spec, tokens=tokens))
  bad = TOKENS.at[0, 0].set(99)
  result = run(bad)
  np.testing.assert_array_equal(result.invalid_B, [1, 0])
  np.testing.assert_array_equal(result.unfilled_B, [2, 2])
  full = sampling.OrderedSpec(groups=((4, 5, 6, 7), (8, 9, 10, 11)))
  clean = jax.jit(lambda tokens: _sample(full, tokens=tokens))(TOKENS)
  assert int(clean.invalid_B.sum()) == 0 and int(clean.unfilled_B.sum()) == 0


def test_blocks_inside_jit_with_a_concrete_layout_equal_the_eager_run():
  spec = sampling.ConfidenceSpec(steps=4, block_length=4)
  fixed = np.asarray(TOKENS) != VOCAB
  eager = _sample(spec, fixed=fixed)
  jitted = jax.jit(lambda tokens: _sample(spec, tokens=tokens, fixed=fixed))(TOKENS)
  np.testing.assert_array_equal(eager.tokens_BxL, jitted.tokens_BxL)
  with pytest.raises(ValueError, match="block_length=4 needs the generation length"):
    jax.jit(lambda tokens: _sample(spec, tokens=tokens))(TOKENS)


@pytest.mark.parametrize("spec", [sampling.AncestralSpec(steps=4), sampling.ConfidenceSpec(steps=4)],
                         ids=["ancestral", "confidence"])
@pytest.mark.slow
def test_nonfinite_logits_are_counted(spec):
  def broken(params, tokens_BxL, t_B):
    logits = stubs.stub_denoiser(params, tokens_BxL, t_B)
    return logits.at[:, LENGTH - 1, 0].set(jnp.nan)  # the last position's logits are NaN

  result = _sample(spec, apply_fn=broken)
  np.testing.assert_array_equal(result.nonfinite_B, [1, 1])
  assert int(_sample(spec).nonfinite_B.sum()) == 0


def test_a_traced_layout_with_concrete_tokens_is_not_guessed():
  # The host must not stand in `tokens != mask` for a fixed_BxL it cannot read.
  spec = sampling.ConfidenceSpec(steps=4, block_length=4)
  with pytest.raises(ValueError, match="block_length=4 needs the generation length"):
    jax.jit(lambda fixed: _sample(spec, fixed=fixed))(np.asarray(TOKENS) != VOCAB)
