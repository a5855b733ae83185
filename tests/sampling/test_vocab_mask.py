"""A denoiser whose vocabulary holds the mask (published checkpoints keep their own ids).

Its logits cover all V ids, the mask id lies inside them, and a careful model returns the
mask's logit as -inf. Every family samples it with `mask_id=` that id: no mask is drawn
(even from a model that forgets the -inf: the sampler rules the mask out itself), -inf
logits make no NaN anywhere, and a row is the same whatever rows share its batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from mdjax import sampling
from mdjax.sampling import scores, stepping, transforms
from mdjax.sampling.base import Context

# One worker: the tests share the programs compiled for the stub.
pytestmark = pytest.mark.xdist_group("vocab_mask")

V, MASK = 12, 7  # the mask id lies inside the vocabulary
RULED_OUT = (3, 10)  # ids the stub always gives -inf
BATCH, LENGTH, PROMPT = 3, 8, 4
GENERATED = tuple(range(PROMPT, LENGTH))


def _example(family):
  """The family's first example that scores by neg_entropy (the score that reads every
  probability, zeros included), else its first."""
  examples = family.examples(GENERATED)
  return next((s for s in examples if getattr(s, "score", None) == "neg_entropy"), examples[0])


# One example per family (a program each: the suite's time is compile time). The mask is
# ruled out in one place for every family (`BoundDenoiser`), and every knob's transform is
# checked below at each primitive.
EXAMPLES = [(name, _example(family)) for name, family in sorted(sampling.families().items())]


def _params(mask_logit: float):
  """The stub's tables; `mask_logit` is the mask's logit everywhere (a traced parameter, so
  a model that forgets the -inf runs the same program)."""
  rng = np.random.default_rng(0)
  return {"pos": jnp.asarray(rng.normal(size=(LENGTH, V)), jnp.float32),
          "mix": jnp.asarray(0.5 * rng.normal(size=(V, V)), jnp.float32),
          "mask_logit": jnp.float32(mask_logit)}


def stub(params, tokens_BxL, t_B):
  """Per-position logits plus the canvas's token embeddings; RULED_OUT at -inf, the mask at
  `params["mask_logit"]`."""
  del t_B
  logits_BxLxV = params["pos"][None] + params["mix"][tokens_BxL].sum(1, keepdims=True)
  logits_BxLxV = logits_BxLxV.at[..., np.array(RULED_OUT)].set(-jnp.inf)
  return logits_BxLxV.at[..., MASK].set(params["mask_logit"])


def _canvas() -> np.ndarray:
  # Prompts use ids on both sides of the mask id (8, 9, 11 are tokens).
  tokens = np.full((BATCH, LENGTH), MASK, np.int32)
  tokens[:, :PROMPT] = [[0, 8, 11, 1], [9, 2, 5, 11], [4, 6, 9, 8]]
  return tokens


def _floats_finite(result) -> bool:
  leaves = jax.tree.leaves(result)
  return all(np.isfinite(np.asarray(x)).all() for x in leaves
             if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating))


@pytest.mark.parametrize("name, spec", EXAMPLES, ids=[name for name, _ in EXAMPLES])
@pytest.mark.slow
def test_every_family_never_draws_the_mask_inside_the_vocabulary(name, spec):
  canvas, keys = _canvas(), jax.random.split(jax.random.key(3), BATCH)
  careful = sampling.sample(stub, _params(-np.inf), keys, canvas, spec, mask_id=MASK)
  final = np.asarray(careful.tokens_BxL)
  np.testing.assert_array_equal(final[:, :PROMPT], canvas[:, :PROMPT])
  generated = final[:, PROMPT:]
  assert np.all((generated >= 0) & (generated < V)), generated
  assert not np.isin(generated, (MASK,) + RULED_OUT).any(), generated
  np.testing.assert_array_equal(careful.unfilled_B, 0)
  np.testing.assert_array_equal(careful.invalid_B, 0)
  np.testing.assert_array_equal(careful.nonfinite_B, 0)  # no value written from NaN
  assert _floats_finite(careful)
  # A row is the same in a batch of copies of itself (the same program: no compile).
  for b in range(BATCH):
    alone = sampling.sample(stub, _params(-np.inf), keys[np.array([b] * BATCH)], canvas[[b] * BATCH],
                            spec, mask_id=MASK)
    np.testing.assert_array_equal(alone.tokens_BxL[0], final[b])
  # A model whose mask logit is the largest of all: the sampler still never draws it.
  forgetful = sampling.sample(stub, _params(4.0), keys, canvas, spec, mask_id=MASK)
  assert not np.isin(np.asarray(forgetful.tokens_BxL)[:, PROMPT:], (MASK,) + RULED_OUT).any()
  np.testing.assert_array_equal(forgetful.nonfinite_B, 0)


def test_ids_are_checked_against_the_vocabulary_and_the_mask_id():
  spec = sampling.ConfidenceSpec(steps=2)  # every call raises before compiling
  run = lambda tokens, **kw: sampling.sample(stub, _params(-np.inf), jax.random.key(0), tokens,
                                             spec, **{"mask_id": MASK, **kw})
  with pytest.raises(ValueError, match=r"tokens_BxL holds 12; token ids must lie in \[0, 11\]"):
    run(np.where(_canvas() == 11, 12, _canvas()))
  with pytest.raises(ValueError, match="mask_id=13 is invalid.*V=12"):
    run(_canvas(), mask_id=13)
  with pytest.raises(ValueError, match="mask_id=-2 is invalid"):
    run(_canvas(), mask_id=-2)
  with pytest.raises(ValueError, match="eos_id=7 is the mask id"):
    sampling.sample(stub, _params(-np.inf), jax.random.key(0), _canvas(),
                    sampling.ConfidenceSpec(steps=2, eos_id=MASK), mask_id=MASK)
  # Inside the caller's jit the ids are counted instead (ids above the mask id are tokens).
  bad = np.where(_canvas() == 11, 12, _canvas())
  ctx = Context(mask_id=MASK, editable_BxL=jnp.asarray(bad == MASK), keys_B=None, vocab_size=V)
  np.testing.assert_array_equal(stepping.invalid_input(jnp.asarray(bad), ctx),
                                (bad == 12).sum(-1))


def _ruled_out_logits():
  logits = jax.random.normal(jax.random.key(0), (2, 5, V)) * 3
  return logits.at[..., np.array([MASK, *RULED_OUT])].set(-jnp.inf)


KNOBS = {"top_k": dict(temperature=0.7, top_k=3),
         "top_p_eos_never": dict(top_p=0.6, eos_id=5, eos_never=True),
         "min_p_eos_penalty": dict(min_p=0.2, eos_id=RULED_OUT[0], eos_penalty=2.0),
         "argmax": dict(temperature=0.0, eos_id=4)}


@pytest.mark.slow
def test_transforms_and_scores_make_no_nan_from_minus_infinity():
  """No operation of the value transforms or the scores makes a NaN (checked at every
  primitive by checkify, one program for every knob set), and nothing ruled out is drawn."""
  keys = jax.random.split(jax.random.key(1), 2)

  def everything(logits):
    out = {}
    for knobs_name, knobs in KNOBS.items():
      spec = sampling.ConfidenceSpec(steps=2, **knobs)
      values = transforms.draw_values(keys, logits, **spec.transform)
      probs, conf = transforms.value_probs(logits, values)
      out[knobs_name] = {"values": values, "conf": conf,
                         "transformed": transforms.transformed_probs(logits, spec)}
      for name in scores.SCORES:
        out[knobs_name][name] = scores.confidence_score(name, probs, values, keys)
    return out

  checked = jax.jit(checkify.checkify(everything, errors=checkify.float_checks))
  error, out = checked(_ruled_out_logits())
  error.throw()
  for knobs_name, outputs in out.items():
    assert not np.isin(np.asarray(outputs["values"]), (MASK,) + RULED_OUT).any(), knobs_name
    for name, x in outputs.items():
      assert not np.isnan(np.asarray(x)).any(), (knobs_name, name)
