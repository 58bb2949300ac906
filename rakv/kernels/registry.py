"""Which lean forward runs a model: kept here, keyed by the module (weakly: an entry goes with its
model), never as an attribute pinned on the module. ``lean.attach`` sets it, ``fastpath.disable``
drops it, a backend (``rakv.backends``) reads it when it is chosen."""

from __future__ import annotations

import weakref

_LEAN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lean_of(model):
    """The lean forward attached to ``model`` (``rakv.kernels.lean``), or None."""
    return _LEAN.get(model)


def set_lean(model, lean) -> None:
    """Attach ``lean`` to ``model`` (None: none). The forward holds its model weakly, so the entry
    does not keep the model alive."""
    if lean is None:
        _LEAN.pop(model, None)
    else:
        _LEAN[model] = lean
