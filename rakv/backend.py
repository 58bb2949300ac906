"""TEMPORARY UNTIL MERGE: the old ``rakv.backend`` names, for the callers outside the backends' room
only (rakv/models.py, rakv/costs/profile.py, rakv/costs/calibration.py). Everything lives in
``rakv.backends``; this module goes when those callers import from there and find a module's lean
forward by ``rakv.backends.lean_of(model)`` instead of reading ``model._rakv_lean``.

Until then ``select_backend`` keeps those callers' ``_rakv_lean`` reads and writes working: it adopts
a lean forward ``models.attach_lean`` set as ``model._rakv_lean`` (layers:L) and writes the chosen
model's lean forward back there. Nothing else in the tree pins or reads it.
"""

from __future__ import annotations

import weakref

from .backends import (BACKENDS, Backend, LeanBackend, LeanFp32Backend, LeanQ8Backend, Switches,  # noqa: F401
                       TorchBackend, backend_of, lean_of, read_switches, set_backend, set_lean)
from .backends import select as _select

_PINNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # model -> the lean forward pinned last


def select_backend(lm, switches: Switches | None = None) -> Backend:
    """``rakv.backends.select_backend``, with ``model._rakv_lean`` kept for the callers above."""
    model = lm.model
    pinned = model.__dict__.get("_rakv_lean")
    if pinned is not None and pinned is not _PINNED.get(model):      # set by models.attach_lean
        set_lean(model, pinned)
    be = _select.select_backend(lm, switches)
    lean = lean_of(model)
    model._rakv_lean = lean
    if lean is None:
        _PINNED.pop(model, None)
    else:
        _PINNED[model] = lean
    return be
