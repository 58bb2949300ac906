"""``--draft none``: no draft; every round is plain decoding (k = 0)."""

from __future__ import annotations

from .base import DraftSource


class NoDraft(DraftSource):
    proposes = False


def make(target, config, arg: str = "") -> NoDraft:
    """The registry's ``none``."""
    return NoDraft()
