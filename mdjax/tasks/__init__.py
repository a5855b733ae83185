"""Synthetic tasks with known joint laws, their exact denoisers and checks."""

from mdjax.tasks import two_color

__all__ = ["two_color"]
