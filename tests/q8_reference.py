"""A plain torch reference of the q8 numerics' linear (kernels/blockq.c, "q8 numerics"): the same
quantized rows, the same exact int32 lane sums, the same float operations in the same order,
written without the kernel's layouts or SIMD, to hold the kernel to bit for bit."""

from __future__ import annotations

import torch

BLK = 32


def quantize_rows(x: torch.Tensor):
    """x [M, K] float32 -> (xq [M, nb, 32] int64, dx [M, nb] float32)."""
    M, K = x.shape
    xb = x.reshape(M, K // BLK, BLK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / torch.where(dx != 0, dx, torch.ones_like(dx)), torch.zeros_like(dx))
    xq = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int64)
    return xq, dx


def _tree16(a: torch.Tensor) -> torch.Tensor:
    s8 = a[..., :8] + a[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def _codes(bw):
    """(w [N, nb, 32] int64 in input order, D per group, M per group or None, group size)."""
    N, nb = bw.N, bw.K // BLK
    if bw.kind == "q4":
        q = torch.cat([bw.qs & 15, bw.qs >> 4], -1).to(torch.int64)
        return q, bw.d, bw.m, 32
    if bw.kind == "q8":
        return bw.qs.to(torch.int64).reshape(N, nb, BLK), bw.d, None, 32
    return bw.qs.to(torch.int64).reshape(N, nb, BLK), bw.d, bw.m, 16


def _pairs(t: torch.Tensor, q4: bool) -> torch.Tensor:
    """[..., nb, 32] -> [..., np, 16 lanes, 4]: two blocks a pair, the kernel's lane layout."""
    nb = t.shape[-2]
    if nb % 2:
        t = torch.cat([t, torch.zeros_like(t[..., :1, :])], -2)
    t = t.reshape(*t.shape[:-2], -1, 2, 2, 16)             # [..., np, block, half, 16]
    if q4:
        t = t.transpose(-3, -2)                            # [..., np, half, block, 16]
    return t.reshape(*t.shape[:-4], -1, 16, 4)


def linear(bw, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] of x [M, K] float32 under q8 numerics with the codes of ``bw`` (a BlockWeight)."""
    M = x.shape[0]
    N, nb = bw.N, bw.K // BLK
    q4 = bw.kind == "q4"
    xq, dx = quantize_rows(x.float())
    w, D, Moff, gs = _codes(bw)
    P = (_pairs(w, q4).unsqueeze(0) * _pairs(xq, q4).unsqueeze(1)).sum(-1)      # [M, N, np, 16] exact
    np_ = P.shape[2]
    lane = torch.arange(16)
    # the block (within its pair) and, for q8x, the group of 16 (within its pair) of each lane
    blk_of_lane = (lane // 4) % 2 if q4 else lane // 8
    dxp = torch.cat([dx, torch.zeros(M, 1)], 1) if nb % 2 else dx
    dx_lane = dxp.reshape(M, np_, 2)[:, :, blk_of_lane]                          # [M, np, 16]
    if gs == 16:
        Dp = torch.cat([D, torch.zeros(N, 2)], 1) if nb % 2 else D
        D_lane = Dp.reshape(N, np_, 4)[:, :, lane // 4]
    else:
        Dp = torch.cat([D, torch.zeros(N, 1)], 1) if nb % 2 else D
        D_lane = Dp.reshape(N, np_, 2)[:, :, blk_of_lane]                        # [N, np, 16]
    acc = torch.zeros(M, N, 16)
    for p in range(np_):
        s = D_lane[:, p].unsqueeze(0) * dx_lane[:, p].unsqueeze(1)              # [M, N, 16]
        acc = acc + P[:, :, p].to(torch.float32) * s
    y = _tree16(acc)
    off = torch.zeros(M, N, 16)
    if Moff is not None:
        sums = xq.sum(-1) if gs == 32 else xq.reshape(M, nb, 2, 16).sum(-1).reshape(M, 2 * nb)
        dxg = dx if gs == 32 else dx.repeat_interleave(2, 1)
        u = dxg * sums.to(torch.float32)                                         # [M, G]
        for g in range(u.shape[1]):
            off[:, :, g % 16] = off[:, :, g % 16] + Moff[:, g].unsqueeze(0) * u[:, g].unsqueeze(1)
    y = y + _tree16(off)
    if bias is not None:
        y = y + bias
    return y
