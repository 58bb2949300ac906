"""The backend interface: what runs one model's forward, chosen once at load (``rakv.backends.select``).

``Backend`` is everything the decoding primitives (and through them the engine and the controller)
ask of a model: ``prefill`` (a prompt's last logits [V]), ``step`` (one token: [V]), ``verify``
(k + 1 rows: [k + 1, V]), ``tree`` (a token tree's rows [n, V], or None where the backend has no
tree forward), ``rollback`` (drop a cache's last n positions) and ``fingerprint`` (what decides its
costs, for the cost profile). The backend owns its state: it holds its model (weakly: the registry
that finds a module's backend is keyed by the module) and, for the lean backends, the lean forward
and what it keeps of each cache (``rakv.kernels.lean.kv``); nothing is pinned on transformers'
modules or caches.
"""

from __future__ import annotations

import inspect
import weakref
from functools import lru_cache

import torch

from ..util.device import model_device
from ..kernels.lean.kv import crop
from .switches import Switches


@lru_cache(maxsize=None)
def _cache_arg(cls) -> str:
    """transformers 5.x names the cache argument ``cache``; older releases ``past_key_values``."""
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _ids(tokens, device=None) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.view(1, -1).to(device) if device is not None else tokens.view(1, -1)
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


@lru_cache(maxsize=1)
def _isa() -> tuple:
    from ..util.device import isa_flags

    return tuple(isa_flags())


class Backend:
    """What runs one model's forward (see the module docstring). Logits are float32, batch 1
    squeezed: ``forward`` [keep or n, V]. An implementation gives ``forward``, ``tree``,
    ``rollback`` and ``fingerprint``; ``prefill``, ``step`` and ``verify`` are fixed calls of
    ``forward`` (``rakv.decoding`` makes the same calls through its ``forward``, the one funnel)."""

    name = "backend"
    tree_ok = False                    # has a tree forward (``tree`` returns logits, not None)
    lean = None                        # the lean forward it runs (the lean backends)

    def __init__(self, model: torch.nn.Module, numerics: str = "fp32", switches: Switches | None = None,
                 lm=None):
        self._model = weakref.ref(model)
        self.numerics = numerics
        self.switches = switches if switches is not None else Switches()
        self._blockq = dict(getattr(lm, "blockq", None) or {})
        self._one_row = dict(getattr(lm, "one_row", None) or {})
        self.lean_seen = None          # the lean forward attached to the model when this was chosen (select)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this backend runs (None once it is gone)."""
        return self._model()

    def forward(self, tokens, cache, keep: int = 0, tree=None) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, ids, cache) -> torch.Tensor:
        """A prompt (or a prompt's suffix) after what ``cache`` holds: the last position's logits [V]."""
        return self.forward(ids, cache, 1)[-1]

    def step(self, token: int, cache) -> torch.Tensor:
        """One decode step: feed ``token``, the next token's logits [V]."""
        return self.forward([token], cache, 1)[-1]

    def verify(self, tokens, cache) -> torch.Tensor:
        """[pending, d_1..d_k] in one forward: logits [k + 1, V]."""
        return self.forward(tokens, cache, 0)

    def tree(self, tokens, parents, cache) -> torch.Tensor | None:
        """A token tree (row i is tokens[i] after row parents[i], -1: after the cache): [n, V], or
        None when this backend verifies chains only."""
        return None

    def rollback(self, cache, n_remove: int) -> None:
        """Drop the last ``n_remove`` positions of ``cache`` (by the lean forward's views where its C
        layers wrote it last: ``rakv.kernels.lean.crop``)."""
        crop(cache, n_remove)

    def fingerprint(self) -> dict:
        """What decides this backend's costs (a profile measured under another is not reused)."""
        m = self.model
        dev = model_device(m)
        fast = next((f for f in m.modules() if hasattr(f, "one_row_plain")), None)   # a fast-path linear
        fp = {"kind": self.name, "numerics": self.numerics, "device": str(dev),
              "threads": torch.get_num_threads(), "fast": fast is not None, "isa": list(_isa())}
        if dev.type == "cuda" and torch.cuda.is_available():
            fp["gpu"] = torch.cuda.get_device_name(dev)
        if fast is not None:                              # (all of a model's: ``fastpath.set_one_row``)
            fp["one_row"] = "plain" if fast.one_row_plain else "packed"
        if self._blockq.get("layers") or self.uses_kernel():
            from ..kernels import blockq

            fp["block_layers"] = int(self._blockq.get("layers") or 0)
            fp["kernel"] = blockq.build_id()
            if self.numerics == "q8":
                fp["tiles"] = "tiled" if self.switches.tiles else "lanes"
        return fp

    def uses_kernel(self) -> bool:
        return False

    def describe(self) -> dict:
        """For run headers and ``--json``: the name and the switches it was chosen with."""
        return {"backend": self.name, "switches": self.switches.as_dict()}

    def __deepcopy__(self, memo):
        return None                     # a deep copy of the model chooses its own

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.numerics}>"
