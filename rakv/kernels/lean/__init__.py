"""A lean decoder forward for Llama-family and GPT-2 models: the same weights and maths as the HF
model, without the framework around it.

A decode step spends a good part of its time outside the linear layers (HF's per-module dispatch,
decorators, mask construction and rotary recomputation: docs/fastpath.md). This forward runs the same computation straight through, layer by layer, on the
model's own modules' kernels (the fast path's ``FastLinear`` where it is on), with

  * q, k, v and gate, up fused into one linear each (one weight read, one kernel call),
  * cos / sin for every position computed once (grown on demand),
  * no mask for one new token (it sees the whole cache) and a bool mask for n > 1,
  * the KV in the same ``DynamicCache`` as before (crop, prefix-cache store and clone unchanged),
    but grown in place in a buffer instead of concatenated anew every step (``_append``).

HF stays the source of truth: the weights are the model's parameters (fused copies are made from
them and made again if a parameter changes in place), and ``supported`` refuses any config this
forward does not reproduce (rope scaling, sliding windows, biases it does not carry, other
activations), in which case the HF forward runs. Every policy goes through the same forward, so
outputs stay identical across policies. ``RAKV_LEAN=0`` (or ``--no-fast``) keeps the HF forward.
What runs a model's forward is its backend (``rakv.backends``), chosen once at load with the
switches read then (``RAKV_LEAN``, ``RAKV_C_LAYERS``, ``RAKV_BLOCKQ``: ``rakv.backends.switches``),
which hands this forward its decisions (``configure``); nothing here reads the environment. The
forward attached to a model is found by ``rakv.kernels.registry.lean_of`` (no attribute on it).

Shapes: x [1, n, H]; q [1, Hq, n, D]; k, v [1, Hkv, n, D] (the cache: [1, Hkv, past + n, D]).

The parts: ``support`` (which models, what of their config), ``ops`` (linears, norms, rotary),
``treelayout``, ``kv`` (the growing KV buffers and their pool), ``llama`` and ``gpt2`` (the
forwards). This package re-exports them.
"""

from __future__ import annotations

from torch import nn

from ..registry import lean_of, set_lean
from .gpt2 import LeanGPT2
from .kv import (KV_MIN_CAPACITY, KV_POOL_BYTES, KV_POOL_KEEP, KvPool, _append, _reserve, _reserve_layers, _Views,
                 buffers_hold, crop, kv_capacity, views_of)
from .llama import LeanLlama, _Layer, weights_may_change
from .ops import (BLOCK_ROWS, FUSED_GATE_UP, FUSED_QKV, PART_FIELDS, _Coded, _coded_parts, _Fused, _Norm, _Op,
                  _Rope, fuse_for_quantization)
from .support import (ARCHS, FAMILIES, GPT2_ACTS, GPT2_ARCHS, SEPARATE_QKV, STATIC_ROPE, _act_fn, _head_dim,
                      _rope_sources, _windows, kind, supported)
from .treelayout import TreeLayout


def build(model: nn.Module, layers: list | None = None) -> LeanLlama:
    """A new lean forward for ``model`` (``layers``: shared with another's, the layers:L draft)."""
    return (LeanGPT2 if kind(model) == "gpt2" else LeanLlama)(model, layers)


def attach(model: nn.Module, on: bool = True) -> str:
    """Give ``model`` its lean forward (``registry.set_lean``: found by ``lean_of``) when supported
    and ``on``; returns why not ("" when attached). A backend chosen before sees the change and is
    chosen again (``rakv.backends.backend_of``)."""
    set_lean(model, None)
    if not on:
        return "switched off"
    why = supported(model)
    if why is None:
        set_lean(model, build(model))
        return ""
    return why
