"""Counting acceptance: how a verified round turns into Bernoulli trials and judged predictions.

Below the gate, the cost model, the controller and the records, which all count the same way.
"""

from __future__ import annotations


def judged(xs: list, drafted: int, accepted: int) -> list[tuple]:
    """(x, accepted?) for the drafted tokens a verify judged: the accepted ones and the first
    rejected one (tokens after it were never judged on their own prefix)."""
    return [(x, i < accepted) for i, x in enumerate(xs[: min(drafted, accepted + 1)])]


def trials(accepted: int, drafted: int) -> int:
    """Bernoulli trials in a round: the accepted drafts, plus the rejected one if any."""
    return accepted + (1 if accepted < drafted else 0)
