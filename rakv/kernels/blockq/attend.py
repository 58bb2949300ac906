"""The block kernel's attention (``attend``, ``attend_tree``) and a step's decoder layers in one C call
(``decode_layers``)."""

from __future__ import annotations

import ctypes

import torch

from .consts import ATTEND_ROWS
from .lib import _Lib, library



class DecoderLayerDesc(ctypes.Structure):
    """``rakv_dlayer`` in kernels/blockq.c: one decoder layer for ``decode_layers``."""
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("cap", ctypes.c_int64), ("window", ctypes.c_int64),
                ("q_part", ctypes.c_void_p), ("k_part", ctypes.c_void_p), ("v_part", ctypes.c_void_p),
                ("gate_part", ctypes.c_void_p), ("up_part", ctypes.c_void_p)]


def layer_ref(bw: "BlockWeight") -> int:
    """The address of ``bw``'s ``rakv_layer`` description (made once, kept by ``bw``)."""
    if bw._fn is None:
        bw._bind()
    return ctypes.addressof(bw._desc)


def decode_layers(descs, n_layers: int, x: torch.Tensor, n: int, H: int, Hq: int, Hk: int, D: int, I: int,
                  past: int, cos: torch.Tensor, sin: torch.Tensor, eps: float, scale: float,
                  path: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                  final_w: torch.Tensor | None = None) -> None:
    """Run ``n_layers`` decoder layers (``descs``: a ctypes array of DecoderLayerDesc) on x [n, H]
    in place, the n rows at positions past .. past + n - 1 (cos, sin [n, D] contiguous: each row's
    own), their KV written into the layers' buffers at past + row (``kernels/blockq.c``
    rakv_decode_layers). ``path``, ``depth``: the rows are a token tree (see ``attend_tree``).
    ``final_w`` [H] (float32, contiguous): then the model's final RMSNorm too, with ``eps``."""
    if path is not None:
        path, depth = path.contiguous(), depth.contiguous()
    rc = _Lib.handle.rakv_decode_layers(ctypes.addressof(descs), n_layers, x.data_ptr(), n, H, Hq, Hk, D, I,
                                        past, cos.data_ptr(), sin.data_ptr(), eps, scale,
                                        torch.get_num_threads(), None if path is None else path.data_ptr(),
                                        0 if path is None else path.stride(0),
                                        None if depth is None else depth.data_ptr(),
                                        None if final_w is None else final_w.data_ptr())
    if rc:
        raise MemoryError("decode_layers: out of memory")


# ----------------------------------------------------------------------------- attention
def attend_ok(k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int, D: int, any_rows: bool = False,
              enabled: bool = True) -> bool:
    """Whether ``attend`` takes this step: a float32 cache of batch 1 with rows of D contiguous
    values (the lean forward's growing buffer, or a prefill's own KV), at most ATTEND_ROWS new rows
    (``any_rows``: any number, as q8 numerics run every forward). ``enabled``: the RAKV_BLOCKQ switch
    as the backend read it at load (the lean forward passes it)."""
    return ((any_rows or n <= ATTEND_ROWS) and D % 16 == 0 and Hq % Hk == 0 and k.dtype == torch.float32
            and k.device.type == "cpu" and k.shape[0] == 1 and v.shape[0] == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == D and v.stride(-2) == D
            and library() is not None and enabled)


def attend(q: torch.Tensor, q_row: int, k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int,
           D: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the n newest positions, their queries at ``q`` (row i, head h at element
    i * q_row + h * D; contiguous rows), over k, v [1, Hk, past + n, D]: out [1, n, Hq * D], each
    (row, head) computed alone in an order that does not depend on n (``kernels/blockq.c``).
    ``window`` > 0: a row sees only its last ``window`` positions (a sliding-window layer);
    ``softcap`` > 0: scores capped as tanh(s / softcap) softcap (Gemma 2)."""
    past = k.shape[-2] - n
    out = torch.empty(1, n, Hq * D)
    _Lib.handle.rakv_attend(q.data_ptr(), n, Hq, D, q_row, k.data_ptr(), k.stride(1), v.data_ptr(),
                            v.stride(1), Hk, past, scale, out.data_ptr(), torch.get_num_threads(),
                            int(window or 0), float(softcap or 0.0))
    return out


def _tree_fn():
    """``rakv_attend_tree`` with its arguments typed (once)."""
    fn = _Lib.handle.rakv_attend_tree
    if fn.restype is not None or not fn.argtypes:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i64, i64, ctypes.c_float, vp, ctypes.c_int,
                       i64, ctypes.c_float, vp, i64, vp]
        fn.restype = None
    return fn


def attend_tree(q: torch.Tensor, q_row: int, k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int,
                D: int, scale: float, path: torch.Tensor, depth: torch.Tensor, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
    """Tree attention of the n newest positions (a token tree after the cache): as ``attend``, but
    row i sees the cached positions 0..past-1, then its ancestors' rows root first, then itself
    (``path`` [n, P] int64: row i's ancestry rows path[i, 0..depth[i]], ending with i; ``depth`` [n]
    int64), in that order: the keys a decode step of the same token sees, with the same arithmetic,
    so a tree row equals that decode step bit for bit. ``window`` counts positions (row i's is
    past + depth[i]). out [1, n, Hq * D]."""
    past = k.shape[-2] - n
    out = torch.empty(1, n, Hq * D)
    path, depth = path.contiguous(), depth.contiguous()
    _tree_fn()(q.data_ptr(), n, Hq, D, q_row, k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1), Hk, past,
               scale, out.data_ptr(), torch.get_num_threads(), int(window or 0), float(softcap or 0.0),
               path.data_ptr(), path.stride(0), depth.data_ptr())
    return out
