"""Backends: what runs a model's forward, chosen once at load behind one interface (``base.Backend``:
prefill, step, verify, tree, rollback, fingerprint). ``torch`` (HF's forward, any device), ``lean``
(the lean forward, fp32 or q8 numerics); ``select`` chooses (``select_backend``) and finds
(``backend_of``); ``switches`` reads the environment's forward switches, once per load.

Layering: above ``rakv.kernels`` (whose objects it is given or finds in ``rakv.kernels.registry``),
below the loader and ``rakv.decoding``: it imports neither (a ``LoadedModel`` is read by duck typing).
"""

from __future__ import annotations

from .base import Backend
from .lean import LeanBackend, LeanFp32Backend, LeanQ8Backend
from .select import BACKENDS, backend_of, choose_one_row, select_backend, set_backend
from ..kernels.registry import lean_of, set_lean
from .switches import Switches, read_switches
from .torch import TorchBackend

__all__ = ["BACKENDS", "Backend", "LeanBackend", "LeanFp32Backend", "LeanQ8Backend", "Switches", "TorchBackend",
           "backend_of", "choose_one_row", "lean_of", "read_switches", "select_backend", "set_backend", "set_lean"]
