"""Write orders over fields: the notation parser and the FieldOrderSpec sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.tasks import scan_and_add as sa
from tests import stubs

P = sa.DEFAULT
FIELDS = sa.write_order_fields(P)
NAMES = list(FIELDS)  # V O A v o h t 1


def _per_field(spec):
  """Each step's counts as {field name: count}, zeros dropped."""
  return [{n: c for n, c in zip(NAMES, row) if c} for row in spec.counts]


def test_fields_cover_the_layout_once():
  flat = sorted(p for positions in FIELDS.values() for p in positions)
  assert flat == list(range(P.length))
  assert FIELDS["h"] + FIELDS["t"] + FIELDS["1"] == tuple(int(i) for i in P.answer_pos)


@pytest.mark.parametrize("notation, steps", [
    ("[VOA][v×9]o×10[ht1]", [{"V": 1, "O": 1, "A": 1}, {"v": 9}] + [{"o": 1}] * 10
     + [{"h": 1, "t": 1, "1": 1}]),
    ("[VOA]v×9[ht1]o×10", [{"V": 1, "O": 1, "A": 1}] + [{"v": 1}] * 9
     + [{"h": 1, "t": 1, "1": 1}] + [{"o": 1}] * 10),
    ("[VOA][v×9][o×10][ht1]", [{"V": 1, "O": 1, "A": 1}, {"v": 9}, {"o": 10},
                               {"h": 1, "t": 1, "1": 1}]),
    # Short counts, '*', spaces, one digit per step, and a field split over steps.
    (" [V O A] [v9] o*4 [o6 h] t 1 ", [{"V": 1, "O": 1, "A": 1}, {"v": 9}] + [{"o": 1}] * 4
     + [{"o": 6, "h": 1}, {"t": 1}, {"1": 1}]),
])
def test_notation_parses_to_per_step_field_counts(notation, steps):
  spec = sampling.parse_write_order(notation, FIELDS, temperature=0.5)
  assert _per_field(spec) == steps
  assert spec.steps == len(steps) and spec.notation == notation and spec.temperature == 0.5


@pytest.mark.parametrize("notation, message, column", [
    ("[VOA][v×9]o×10[ht1]x", "expected a field name, found 'x'", 19),
    ("[VOA][v×9]o×10[ht1", "never closed", 14),
    ("[VOA][v×9]o×11[ht1]", "field 'o' has 10 position", 10),
    ("[VOA][v×9]o×9[ht1]", r"unwritten: \{'o': 1\}", 18),
    ("[VOA][v×9][o×10[ht1]]", "do not nest", 15),
    ("[VOA][]v9o10ht1", "empty group", 5),
    ("[VOA]v×9o×10ht1]", "closing bracket", 15),
    ("[VOA]v×o×10ht1", "expected a count", 7),
    ("[VOA]v×0o×10ht1", "count 0", 5),
    ("[VOA]v×9o×10hh1", "field 'h' has 1 position", 13),
])
def test_bad_notation_points_at_the_offending_character(notation, message, column):
  with pytest.raises(ValueError, match=message) as error:
    sampling.parse_write_order(notation, FIELDS)
  text = str(error.value)
  assert f"at character {column}" in text
  lines = text.splitlines()
  assert lines[-2].strip() == notation.strip() and lines[-1].index("^") == column + 2


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.FieldOrderSpec(fields=((0, 1), (1, 2)), counts=((2, 2),)), "one field only"),
    (lambda: sampling.FieldOrderSpec(fields=((0, 1),), counts=((1,),)), "sum to the field's 2"),
    (lambda: sampling.FieldOrderSpec(fields=((0, 1),), counts=((0,), (2,))), r"counts\[0\]"),
    (lambda: sampling.FieldOrderSpec(fields=((0,),), counts=((1,),), score="entropy"),
     "score='entropy'"),
    (lambda: sampling.parse_write_order("ab", {"a": (0,), "[": (1,)}), "single characters"),
    (lambda: sampling.parse_write_order("  ", {"a": (0,)}), "non-empty"),
])
def test_bad_field_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_singleton_fields_equal_the_positional_order_token_for_token():
  vocab, length = 6, 8
  params = stubs.stub_params(vocab, length)
  groups = ((3,), (0, 5), (1, 2, 4), (6, 7))
  by_position = sampling.OrderedSpec(groups=groups, temperature=0.8)
  by_field = sampling.FieldOrderSpec(
      fields=tuple((i,) for i in range(length)),
      counts=tuple(tuple(int(i in g) for i in range(length)) for g in groups), temperature=0.8)
  tokens = jnp.full((32, length), vocab, jnp.int32)
  a = sampling.sample(stubs.stub_denoiser, params, jax.random.key(3), tokens, by_position)
  b = sampling.sample(stubs.stub_denoiser, params, jax.random.key(3), tokens, by_field)
  np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)
  np.testing.assert_array_equal(a.write_step_BxL, b.write_step_BxL)


def test_a_field_is_written_most_confident_first():
  # Position p's max probability grows with p (a sharper row of logits).
  vocab, length = 4, 6
  scale_L = jnp.arange(1, length + 1, dtype=jnp.float32)
  denoiser = lambda params, tokens_BxL, t_B: jnp.broadcast_to(
      scale_L[:, None] * jnp.arange(vocab, dtype=jnp.float32), tokens_BxL.shape + (vocab,))
  spec = sampling.parse_write_order("a×2[b×2]a×2", {"a": (0, 2, 4, 5), "b": (1, 3)})
  out = sampling.sample(denoiser, None, jax.random.key(0), jnp.full((2, length), vocab),
                        spec)
  # Steps: a (most confident: 5), a (4), b (1 and 3), a (2), a (0).
  np.testing.assert_array_equal(out.write_step_BxL[0], [4, 2, 3, 2, 1, 0])


@pytest.mark.slow
def test_one_position_per_step_orders_are_exact_on_the_oracle():
  """With the exact denoiser, every row of a one-position-per-step order is in the support."""
  n = 512
  for notation in ("[VOA]v×9o×10ht1", "[VOA]o×10ht1v×9", "VOA[v×9]o×10[ht1]"):
    out = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), sa.empty_canvas(n),
                          sampling.parse_write_order(notation, FIELDS))
    checks = sa.checks(out.tokens_BxL)
    assert checks["correct"].all() and checks["add_count_valid"].all(), notation
  # The commands in one independent step break the add count (P(count != 2) = 0.698).
  out = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), sa.empty_canvas(n),
                        sampling.parse_write_order("[VOA][v×9][o×10][ht1]", FIELDS))
  assert sa.checks(out.tokens_BxL)["add_count_valid"].mean() < 0.5


@pytest.mark.slow
def test_bound_task_with_synonyms():
  task = sa.bind(max_command_id=9)
  assert task.params.max_command_id == 9 and task.length == P.length
  x = task.sample_data(jax.random.key(0), 256)
  assert np.asarray(x)[:, P.command_pos].max() > 1  # synonyms are drawn
  assert task.sample_metrics(x)["correct"] == 1.0
  out = sampling.sample(task.exact_denoiser, None, jax.random.key(1), task.empty_canvas(256),
                        sampling.parse_write_order("[VOA][v×9]o×10[ht1]",
                                                   sa.write_order_fields(task.params)))
  assert task.sample_metrics(out.tokens_BxL)["correct"] == 1.0
  with pytest.raises(ValueError, match="unknown"):
    sa.bind(max_commands=9)
