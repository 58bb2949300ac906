"""Several requests' rows in one forward: one pass over the codes, attention per request.

A batch step carries, for each active request, its rows: 1 for a decode step, 1 + k for a verify,
a chunk of a prompt. ``forward_segments`` runs them through every layer in one C call
(``kernels/blockq.c`` rakv_decode_segments): each linear over all rows at once, so the weights
stream once for the whole batch, and each request's attention over its own KV buffers only.

Exact by construction: under the q8 numerics (``LeanLlama.rows_alone``) a linear computes each row
alone (its own 8-bit blocks, integer dot products, one fixed summation order) whatever rows share
the pass, and a row's attention reads only its own request's cache, in the order its decode step
reads it. A row's logits and KV are therefore the same bits as that request's forward alone, and
every request's tokens equal its solo run whatever arrives beside it. Where that does not hold
(fp32 numerics, the torch path, a model the C layers cannot run) ``segments_ok`` says no and the
caller runs each request's forward on its own.

Shapes: ids [n_s] per segment; x [1, n, H] for all n = sum n_s rows; logits [keep_s, V] per segment.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import blockq
from .lean.kv import c_buffers, c_written
from .lean.llama import weights_may_change


def _bind(lib) -> None:
    if getattr(lib, "_segments_bound", False):
        return
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rakv_decode_segments.argtypes = [vp, i64, vp, i64, i64, i64, i64, i64, i64, i64, vp, vp, vp, vp,
                                         vp, vp, vp, vp, ctypes.c_float, ctypes.c_float, ctypes.c_int32, vp]
    lib.rakv_decode_segments.restype = ctypes.c_int32
    lib._segments_bound = True


def segments_ok(lean, caches) -> bool:
    """Whether ``forward_segments`` can run these caches' rows together exactly: q8 numerics (rows
    alone), the C layers on, and every cache already holding a prompt the kernel's attention reads."""
    if lean is None or not lean.rows_alone() or not lean.c_layers_on() or lean.dtype != torch.float32:
        return False
    if getattr(lean, "family", "") != "llama" or list(getattr(lean, "ropes", {})) != [""]:
        return False                     # (GPT-2's learned positions: its rows run alone)
    if blockq.library() is None or not hasattr(blockq.library(), "rakv_decode_segments"):
        return False
    for c in caches:
        if not c.layers or not c.layers[0].is_initialized or c.layers[0].keys.numel() == 0:
            return False
        L = c.layers[0]
        if not blockq.attend_ok(L.keys, L.values, 1, lean.n_heads, lean.n_kv, lean.head_dim, any_rows=True,
                                enabled=lean.use_attend):
            return False
    return True


@torch.inference_mode()
def forward_segments(lean, segs: list[tuple[list[int], object, int]]) -> list[torch.Tensor]:
    """segs: (ids, cache, keep) per request (keep 0: logits of every row, else of the last ``keep``).
    Feeds each request's ids after what its cache holds, all in one C call; returns each request's
    logits [keep or n_s, V] (float32). Call only where ``segments_ok``."""
    lib = blockq.library()
    _bind(lib)
    descs = lean.c_layers_on()
    nL = len(descs)
    S = len(segs)
    ns = [len(ids) for ids, _, _ in segs]
    pasts = [int(c.get_seq_length()) for _, c, _ in segs]
    lean._sync(any(weights_may_change(p) for p in pasts))
    n = sum(ns)
    ids = torch.tensor([[t for s_ids, _, _ in segs for t in s_ids]], dtype=torch.long)     # [1, n]
    lookup = getattr(lean.embed, "lookup", None)
    x = (lookup(ids) if lookup is not None else F.embedding(ids, lean.embed.weight)).contiguous()   # [1, n, H]
    rope = lean.ropes[""]
    cs = [rope.at(p, m) for p, m in zip(pasts, ns)]                         # ([m, 1, D], [m, 1, D]) each
    cos = torch.cat([c for c, _ in cs]).contiguous()
    sin = torch.cat([s for _, s in cs]).contiguous()
    all_views = [c_buffers(cache, cache.layers[:nL], p + m, m) for (_, cache, _), p, m in zip(segs, pasts, ns)]
    I64 = ctypes.c_int64 * S
    r0s = [sum(ns[:s]) for s in range(S)]
    kptr = (ctypes.c_void_p * (nL * S))(*[all_views[s].K[l].data_ptr() for l in range(nL) for s in range(S)])
    vptr = (ctypes.c_void_p * (nL * S))(*[all_views[s].V[l].data_ptr() for l in range(nL) for s in range(S)])
    H = x.shape[-1]
    final_w = lean.final_norm.w if lean._final_c else None
    rc = lib.rakv_decode_segments(ctypes.addressof(descs), nL, x.data_ptr(), n, H, lean.n_heads, lean.n_kv,
                                  lean.head_dim, lean._I, S, I64(*r0s), I64(*ns), I64(*pasts),
                                  I64(*[v.cap for v in all_views]), kptr, vptr, cos.data_ptr(), sin.data_ptr(),
                                  lean._eps, lean.scale, torch.get_num_threads(),
                                  None if final_w is None else final_w.data_ptr())
    if rc:
        raise MemoryError("decode_segments: out of memory")
    for (_, cache, _), views, p, m in zip(segs, all_views, pasts, ns):
        c_written(cache, cache.layers[:nL], views, p + m)
    rows = [r for (_, _, keep), r0, m in zip(segs, r0s, ns) for r in range(r0 + (m - keep if keep else 0), r0 + m)]
    h = x[:, rows]                                                          # [1, kept, H]
    if not lean._final_c:
        h = lean.final_norm(h)
    if lean.head_ids is not None:
        logits = lean._limited_head(h)
    else:
        logits = lean.head(h)
    if lean.head_ids is None and lean.final_softcap:
        logits = torch.tanh(logits / lean.final_softcap) * lean.final_softcap
    logits = logits[0].float()                                              # [kept, V]
    out, at = [], 0
    for (_, _, keep), m in zip(segs, ns):
        k = keep or m
        out.append(logits[at: at + k])
        at += k
    return out
