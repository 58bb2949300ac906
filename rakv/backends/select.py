"""Choosing a model's backend, once, at load (``select_backend``), and finding it again from the module
(``backend_of``): a registry beside the modules (weakly keyed: an entry goes with its model), never
an attribute pinned on them. The environment's switches are read once per load (``read_switches``)
and handed down; ``lean_of`` / ``set_lean`` find and attach a module's lean forward the same way
(``rakv.kernels.registry``)."""

from __future__ import annotations

import weakref

from ..kernels.registry import lean_of, set_lean
from .base import Backend
from .lean import LeanFp32Backend, LeanQ8Backend
from .switches import Switches, read_switches
from .torch import TorchBackend

__all__ = ["BACKENDS", "Backend", "Switches", "backend_of", "choose_one_row", "lean_of", "read_switches",
           "select_backend", "set_backend", "set_lean"]

BACKENDS = ("torch", "lean-fp32", "lean-q8")

_CHOSEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # model -> its Backend


def set_backend(model, backend: Backend | None) -> None:
    """Make ``backend`` what runs ``model`` (None: none chosen; the next ``backend_of`` chooses)."""
    if backend is None:
        _CHOSEN.pop(model, None)
        return
    backend.lean_seen = lean_of(model)
    _CHOSEN[model] = backend


def select_backend(lm, switches: Switches | None = None) -> Backend:
    """Choose ``lm``'s backend (a ``LoadedModel``, read by duck typing) once, now: the lean forward
    where one is attached (q8 or fp32 by its numerics), else the torch path. ``switches``: the
    environment as this load read it (None: read it now). Stored as ``lm.backend`` and in the
    registry (``backend_of(lm.model)``); returns it."""
    sw = switches if switches is not None else read_switches()
    model = lm.model
    lean = lean_of(model) if getattr(lm, "lean", "") else None
    numerics = getattr(lm, "numerics", "fp32") or "fp32"
    if lean is None:
        be: Backend = TorchBackend(model, numerics, sw, lm)
    else:
        be = (LeanQ8Backend if numerics == "q8" else LeanFp32Backend)(model, lean, numerics, sw, lm)
    lm.backend = be
    set_backend(model, be)
    return be


def _chosen_now(model) -> Backend:
    """The backend of a module no loader chose for (or whose lean forward changed since): the lean
    backend where a lean forward is attached, with the switches it was made with; else the torch path."""
    lean = lean_of(model)
    if lean is None:
        return TorchBackend(model)
    q8 = lean.rows_alone()
    return (LeanQ8Backend if q8 else LeanFp32Backend)(model, lean, "q8" if q8 else "fp32",
                                                      Switches(c_layers=lean.use_c_layers, blockq=lean.use_attend),
                                                      configure=False)


def backend_of(x) -> Backend:
    """The backend that runs ``x``: ``x`` itself when it is a ``Backend``; for a module, the one
    chosen for it (``select_backend``), or one chosen now for a module no loader chose for or whose
    lean forward was attached or dropped since (``_chosen_now``), kept in the registry."""
    if isinstance(x, Backend):
        return x
    be = _CHOSEN.get(x)
    if be is None or be.lean_seen is not lean_of(x):
        be = _chosen_now(x)
        set_backend(x, be)
    return be


def choose_one_row(model, key: str, cache=None, rounds: int = 3, forced: str = "auto") -> dict:
    """``fastpath.choose_one_row`` timing ``model``'s decode steps through its backend's forward."""
    from ..kernels import fastpath

    be = backend_of(model)
    return fastpath.choose_one_row(model, key, cache, rounds, forced,
                                   forward=lambda tokens, c: be.forward(tokens, c, 1))
