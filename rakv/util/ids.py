"""Token-id sequences: the longest common prefix of two, shared by the chat template (how much of a
prompt a template prefix or an earlier turn covers) and seeded verification (how many drafts match
the target's tokens)."""

from __future__ import annotations


def lcp(a, b) -> int:
    """The length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
