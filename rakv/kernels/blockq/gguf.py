"""Block codes read from a GGUF tensor's own blocks (``from_gguf``)."""

from __future__ import annotations

import torch

from .consts import BLK, QK_K
from .weight import BlockWeight


# ----------------------------------------------------------------------------- codes read from a GGUF
# A GGUF tensor's blocks are codes already: each format's weights are exactly fma(D, q, M) for a small
# unsigned code q and a scale D and offset M per 16 or 32 inputs, with D q exact in fp32 (D is a
# float16 times at most a 7-bit integer, q at most 6 bits), so the one rounding is the fma's, as in
# the GGUF dequantizer (gguf.quants, transformers' loader). Q4_0, Q4_1, Q4_K become q4 codes; Q5_0 and
# Q8_0 q8; Q5_1, Q2_K, Q3_K, Q5_K, Q6_K q8x (a scale and an offset per 16 inputs). What they rebuild
# is still checked against the loaded weights element by element (``BlockWeight.rebuilds``).
GGUF_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
              "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
              "Q6_K": (QK_K, 210)}


def _f16(b):
    import numpy as np

    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)      # [n, 2] bytes -> [n, 1]


def _bits(b, shifts, mask):
    """b [n, c] bytes -> [n, len(shifts), c]: (b >> s) & mask for each shift."""
    import numpy as np

    return (b[:, None, :] >> np.asarray(shifts, dtype=np.uint8)[None, :, None]) & np.uint8(mask)


def _k_scale_min(scales):
    """Q4_K / Q5_K: the 8 six-bit scales and minimums packed in 12 bytes (gguf.quants.Q4_K)."""
    import numpy as np

    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _gguf_parts(b, qtype: str):
    """Blocks b [n, type size] -> (q [n, block], D [n, groups], M [n, groups] or None, signed): w =
    fma(D, q, M) (w = D q when M is None, q then signed) with groups of 16 or 32 inputs."""
    import numpy as np

    n = b.shape[0]
    if qtype == "Q8_0":
        return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, True
    if qtype in ("Q4_0", "Q4_1"):
        off = 2 if qtype == "Q4_0" else 4
        q = _bits(b[:, off:off + 16], [0, 4], 15).reshape(n, 32)
        d = _f16(b[:, :2])
        return q, d, (-8 * d if qtype == "Q4_0" else _f16(b[:, 2:4])), False
    if qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        qh = ((np.ascontiguousarray(b[:, off:off + 4]).view(np.uint32)
               >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)
        q = _bits(b[:, off + 4:off + 20], [0, 4], 15).reshape(n, 32) | (qh << 4)
        d = _f16(b[:, :2])
        if qtype == "Q5_0":
            return (q.astype(np.int16) - 16).astype(np.int8), d, None, True
        return q, d, _f16(b[:, 2:4]), False
    if qtype == "Q2_K":
        sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
        q = _bits(qs.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, QK_K)
        return q, d * (sc & 0xF).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32)), False
    if qtype == "Q3_K":
        hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        lo = _bits(scales[:, :8], [0, 4], 0xF).reshape(n, 16)
        hi = _bits(scales[:, 8:12], [0, 2, 4, 6], 3).reshape(n, 16)
        D = d * ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
        ql = _bits(qs.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, QK_K)
        h = _bits(hmask, list(range(8)), 1).reshape(n, QK_K)
        return ql + (h << 2), D, -4 * D, False               # q - 4 (h = 0) or q (h = 1): ql + 4 h - 4
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        if qtype == "Q4_K":
            q = _bits(b[:, 16:144].reshape(n * 4, 32), [0, 4], 15).reshape(n, QK_K)
        else:
            ql = _bits(b[:, 48:176].reshape(n * 4, 32), [0, 4], 15).reshape(n, QK_K)
            q = ql | (_bits(b[:, 16:48], list(range(8)), 1).reshape(n, QK_K) << 4)
        return q, d * sc, -(dmin * mn), False
    if qtype == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        lo = _bits(ql.reshape(n * 2, 64), [0, 4], 15).reshape(n, 2, 2, 64).reshape(n, 8, 32)
        hi = _bits(qh.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
        D = d * sc.copy().view(np.int8).astype(np.float32)
        return (lo | (hi << 4)).reshape(n, QK_K), D, -32 * D, False
    return None


def from_gguf(data, qtype: str, N: int, K: int) -> BlockWeight | None:
    """The codes of a GGUF tensor (its raw blocks ``data``, ``qtype`` a GGML type name such as
    "Q4_K") as the weight W [N, K] the GGUF dequantizer gives, rows in the file's order; None for a
    type it does not read or a shape that is not whole blocks."""
    import numpy as np

    if qtype not in GGUF_BLOCK or K % BLK or N <= 0:
        return None
    bs, ts = GGUF_BLOCK[qtype]
    raw = np.ascontiguousarray(np.asarray(data).view(np.uint8).reshape(-1))
    if K % bs or raw.size != N * (K // bs) * ts:
        return None
    q, D, M, signed = _gguf_parts(raw.reshape(-1, ts), qtype)
    if not (np.isfinite(D).all() and (M is None or np.isfinite(M).all())):
        return None
    extra = _kquant_scales(raw.reshape(-1, ts), qtype, N, K)
    q = q.reshape(N, K // BLK, BLK)
    groups = D.size // (N * (K // BLK))               # scales per 32 inputs: 1 or 2
    D, M = D.reshape(N, -1), None if M is None else M.reshape(N, -1)
    t = torch.from_numpy
    if signed:
        return BlockWeight("q8", N, K, t(q.astype(np.int8)).contiguous(), t(D).contiguous(), None)
    if groups == 1 and int(q.max(initial=0)) <= 15:
        qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
        return BlockWeight("q4", N, K, t(qs).contiguous(), t(D).contiguous(), t(M).contiguous(),
                           **(extra if qtype == "Q4_K" else {}))
    if groups == 1:
        D, M = np.repeat(D, 2, axis=1), np.repeat(M, 2, axis=1)
    return BlockWeight("q8x", N, K, t(q.astype(np.uint8)).contiguous(), t(np.ascontiguousarray(D)),
                       t(np.ascontiguousarray(M)), **(extra if qtype == "Q6_K" else {}))


def _kquant_scales(b, qtype: str, N: int, K: int) -> dict:
    """Q4_K: the 6-bit scales and minimums per 32 and d, -dmin per 256; Q6_K: the int8 scales per 16
    and d per 256 (``BlockWeight.isc`` ...), as torch tensors by row; {} for any other type."""
    import numpy as np

    t = torch.from_numpy
    if qtype == "Q4_K":
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        return {"isc": t(sc.astype(np.uint8).reshape(N, K // BLK)).contiguous(),
                "imn": t(mn.astype(np.uint8).reshape(N, K // BLK)).contiguous(),
                "dg": t(d.reshape(N, K // QK_K)).contiguous(), "mg": t((-dmin).reshape(N, K // QK_K)).contiguous()}
    if qtype == "Q6_K":
        return {"isc": t(b[:, 192:208].copy().view(np.int8).reshape(N, K // 16)).contiguous(),
                "dg": t(_f16(b[:, 208:210]).reshape(N, K // QK_K)).contiguous()}
    return {}
