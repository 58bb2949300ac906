"""A token tree as the lean forward reads it (``TreeLayout``)."""

from __future__ import annotations

import torch


class TreeLayout:
    """A token tree as the forward reads it: row i's parent row (``parents[i] < i``; -1: it follows
    the cached tokens directly), its depth (its position is past + depth), and its ancestry path,
    the rows from its root down to itself (``path`` [n, max depth + 1] int64, zero-padded)."""

    __slots__ = ("parents", "depths", "depth", "path")

    def __init__(self, parents: list[int]):
        depths: list[int] = []
        paths: list[list[int]] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"tree row {i}: parent {p} must be -1 or an earlier row")
            depths.append(0 if p < 0 else depths[p] + 1)
            paths.append([i] if p < 0 else paths[p] + [i])
        self.parents, self.depths = list(parents), depths
        self.depth = torch.tensor(depths, dtype=torch.long)                 # [n]
        self.path = torch.zeros(len(parents), max(depths, default=0) + 1, dtype=torch.long)
        for i, pa in enumerate(paths):
            self.path[i, : len(pa)] = torch.tensor(pa)

    def mask(self, past: int, window: int | None = None) -> torch.Tensor:
        """[n, past + n] bool: row i sees the cached keys and its ancestry's rows, only those within
        its last ``window`` positions on a sliding-window layer (row r's position is past + depth)."""
        n = len(self.parents)
        m = torch.zeros(n, past + n, dtype=torch.bool)
        for i, d in enumerate(self.depths):
            lo = past + d - window + 1 if window else 0                      # the first visible position
            m[i, max(0, lo):past] = True
            for r in self.path[i, : d + 1].tolist():
                m[i, past + r] = past + self.depths[r] >= lo
        return m
