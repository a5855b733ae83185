"""Synthetic tasks with known joint laws, their exact denoisers and checks.

Each task module offers LENGTH, VOCAB_SIZE, MASK_ID, `sample_data`,
`exact_denoiser` (the denoiser contract), `empty_canvas`, `decode` and
`sample_metrics`.
"""

from mdjax.tasks import scan_and_add, two_color

TASKS = {"two_color": two_color, "scan_and_add": scan_and_add}

__all__ = ["TASKS", "scan_and_add", "two_color"]
