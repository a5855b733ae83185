"""The samplers reproduce the recorded samples token for token (tests/sampling/golden.py).

Recorded before the family protocol replaced the type-dispatching driver; any change to
what a family draws, writes or counts shows here.
"""

import numpy as np
import pytest

from tests.sampling import golden

RECORDED = np.load(golden.PATH)


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_recorded_samples_reproduce(name):
  got = golden.counters(golden.run(name))
  recorded = {key.split("/")[-1]: RECORDED[key] for key in RECORDED.files
              if key.rsplit("/", 1)[0] == name}
  assert set(recorded) <= set(got), (sorted(recorded), sorted(got))
  for field, value in recorded.items():
    np.testing.assert_array_equal(got[field], value, err_msg=f"{name}: {field}")


def test_the_recorded_stub_cases_are_the_contract_examples():
  # The invariants test then reuses the programs compiled here (same spec, shapes, denoiser).
  from tests.sampling import test_contract
  assert sorted(map(repr, golden.CONTRACT_SPECS.values())) == sorted(
      repr(test_contract.as_run(spec)) for _, spec in test_contract.EXAMPLES)
  stub, _, tokens = golden._stub_case()
  np.testing.assert_array_equal(tokens, test_contract._canvas(4))
