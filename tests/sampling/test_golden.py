"""The samplers reproduce the recorded samples token for token (tests/sampling/golden.py).

Recorded before the family protocol replaced the type-dispatching driver; any change to
what a family draws, writes or counts shows here.
"""

import numpy as np
import pytest

from tests.sampling import golden

# One worker runs both files: the golden stub cases are the contract examples.
pytestmark = pytest.mark.xdist_group("stub_samplers")

RECORDED = np.load(golden.PATH)


@pytest.mark.parametrize("name", sorted(golden.CASES))
@pytest.mark.slow
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
  examples = {repr(test_contract.as_run(spec)) for name, spec in test_contract.EXAMPLES
              if name not in golden.NEWER_FAMILIES}
  assert set(map(repr, golden.CONTRACT_SPECS.values())) == examples
  np.testing.assert_array_equal(golden._stub_case()[2], test_contract._canvas(4))
