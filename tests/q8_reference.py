"""A plain torch reference of the q8 numerics' linear (kernels/blockq.c, "q8 numerics"): the same
quantized rows, the same exact int32 lane sums, the same float operations in the same order,
written without the kernel's layouts or SIMD, to hold the kernel to bit for bit."""

from __future__ import annotations

import torch

BLK = 32


GROUP = 8          # blocks of 32 per activation group (256 inputs; the last group may be shorter)


def quantize_rows(x: torch.Tensor):
    """x [M, K] float32 -> (xq [M, nb, 32] int64, dx [M, ng] float32, group of each block [nb])."""
    M, K = x.shape
    nb = K // BLK
    xb = x.reshape(M, nb, BLK)
    grp = torch.arange(nb) // GROUP
    ng = int(grp[-1]) + 1
    amax = torch.stack([xb[:, g * GROUP:(g + 1) * GROUP].abs().amax((-1, -2)) for g in range(ng)], 1)
    dx = amax / 127.0
    inv = torch.where(dx != 0, 1.0 / torch.where(dx != 0, dx, torch.ones_like(dx)), torch.zeros_like(dx))
    xq = torch.round(xb * inv[:, grp].unsqueeze(-1)).clamp(-127, 127).to(torch.int64)
    return xq, dx, grp


def _tree16(a: torch.Tensor) -> torch.Tensor:
    s8 = a[..., :8] + a[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def _codes(bw):
    """(w [N, nb, 32] int64 in input order, D per group, group size): Q8's codes + 128."""
    N, nb = bw.N, bw.K // BLK
    if bw.kind == "q4":
        return torch.cat([bw.qs & 15, bw.qs >> 4], -1).to(torch.int64), bw.d, 32
    if bw.kind == "q8":
        return bw.qs.to(torch.int64).reshape(N, nb, BLK) + 128, bw.d, 32
    return bw.qs.to(torch.int64).reshape(N, nb, BLK), bw.d, 16


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
    xq, dx, grp = quantize_rows(x.float())
    if bw.compact:
        return _tiled_kquant(bw, xq, dx, bias)
    if bw.kind in ("q4", "q8"):
        return _tiled_float_scales(bw, xq, dx, bias)
    w, D, gs = _codes(bw)
    P = (_pairs(w, q4).unsqueeze(0) * _pairs(xq, q4).unsqueeze(1)).sum(-1)      # [M, N, np, 16] exact
    np_ = P.shape[2]
    lane = torch.arange(16)
    blk_of_lane = (lane // 4) % 2 if q4 else lane // 8   # the block (of its pair) of each lane
    if gs == 16:
        Dp = torch.cat([D, torch.zeros(N, 2)], 1) if nb % 2 else D
        D_lane = Dp.reshape(N, np_, 4)[:, :, lane // 4]                          # [N, np, 16]
    else:
        Dp = torch.cat([D, torch.zeros(N, 1)], 1) if nb % 2 else D
        D_lane = Dp.reshape(N, np_, 2)[:, :, blk_of_lane]
    acc = torch.zeros(M, N, 16)
    for g in range(dx.shape[1]):
        t = torch.zeros(M, N, 16)
        for p in range(g * GROUP // 2, min((g + 1) * GROUP // 2, np_)):
            t = t + P[:, :, p].to(torch.float32) * D_lane[:, p].unsqueeze(0)
        acc = acc + t * dx[:, g].reshape(M, 1, 1)
    y = _tree16(acc)
    # the offsets: per block (Q4: M, u = dx sum; Q8: D, -128 dx sum) or per 16 inputs (Q8X: M, dx sum)
    if gs == 32:
        u = dx[:, grp] * xq.sum(-1).to(torch.float32)                               # [M, nb]
        Mo = bw.m if q4 else bw.d
        if not q4:
            u = -128.0 * u
    else:
        u = dx[:, grp].repeat_interleave(2, 1) * xq.reshape(M, nb, 2, 16).sum(-1).reshape(M, 2 * nb).to(torch.float32)
        Mo = bw.m
    off = torch.zeros(M, N, 16)
    for g in range(u.shape[1]):
        off[:, :, g % 16] = off[:, :, g % 16] + Mo[:, g].unsqueeze(0) * u[:, g].unsqueeze(1)
    y = y + _tree16(off)
    if bias is not None:
        y = y + bias
    return y


def _tiled_kquant(bw, xq: torch.Tensor, dx: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """K-quant codes with the file's integer scales (blockq.c, "tiled K-quant codes"): per row,
    output and super-block g the exact integers S_g (and O_g for Q4), then per g in order
    acc = acc + (S_g * dg_g) * dx_g (off likewise with O_g and mg_g); y = acc + off (+ bias)."""
    M, nb = xq.shape[0], xq.shape[1]
    N = bw.N
    if bw.kind == "q4":
        w = torch.cat([bw.qs & 15, bw.qs >> 4], -1).to(torch.int64)            # [N, nb, 32] in input order
        I = (w.unsqueeze(0) * xq.unsqueeze(1)).sum(-1)                          # [M, N, nb] exact
        S = I * bw.isc.to(torch.int64).unsqueeze(0)
        O = bw.imn.to(torch.int64).unsqueeze(0) * xq.sum(-1).unsqueeze(1)     # [M, N, nb]
        per = GROUP
    else:
        w = bw.qs.to(torch.int64).reshape(N, 2 * nb, 16)
        x16 = xq.reshape(M, 2 * nb, 16)
        I = (w.unsqueeze(0) * x16.unsqueeze(1)).sum(-1) - 32 * x16.sum(-1).unsqueeze(1)
        S = I * bw.isc.to(torch.int64).unsqueeze(0)
        O = None
        per = 2 * GROUP
    acc = torch.zeros(M, N)
    off = torch.zeros(M, N)
    for g in range(dx.shape[1]):
        Sg = S[:, :, g * per:(g + 1) * per].sum(-1)
        assert int(Sg.abs().max()) < 2 ** 31
        acc = acc + (Sg.to(torch.float32) * bw.dg[:, g].float().unsqueeze(0)) * dx[:, g].unsqueeze(1)
        if O is not None:
            Og = O[:, :, g * per:(g + 1) * per].sum(-1)
            off = off + (Og.to(torch.float32) * bw.mg[:, g].float().unsqueeze(0)) * dx[:, g].unsqueeze(1)
    y = acc + off if O is not None else acc
    if bias is not None:
        y = y + bias
    return y


def _tiled_float_scales(bw, xq: torch.Tensor, dx: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Q4 / Q8 codes with a float scale per block (blockq.c, tiled_fb): I_b exact (Q8: its codes + 128,
    less 128 x the block's sum of xq); per super-block t = t + I_b * d_b block after block, then
    acc = acc + t * dx; Q4's offsets off = off + m_b * (dx (sum of b's xq)) block after block."""
    M, nb = xq.shape[0], xq.shape[1]
    N = bw.N
    d, m = bw.scales()
    if bw.kind == "q4":
        w = torch.cat([bw.qs & 15, bw.qs >> 4], -1).to(torch.int64)
        I = (w.unsqueeze(0) * xq.unsqueeze(1)).sum(-1)
    else:
        w = bw.qs.to(torch.int64).reshape(N, nb, BLK) + 128
        I = (w.unsqueeze(0) * xq.unsqueeze(1)).sum(-1) - 128 * xq.sum(-1).unsqueeze(1)
    grp = torch.arange(nb) // GROUP
    acc = torch.zeros(M, N)
    off = torch.zeros(M, N)
    u = dx[:, grp] * xq.sum(-1).to(torch.float32)                               # [M, nb]
    for g in range(dx.shape[1]):
        t = torch.zeros(M, N)
        for b in range(g * GROUP, min((g + 1) * GROUP, nb)):
            t = t + I[:, :, b].to(torch.float32) * d[:, b].unsqueeze(0)
        acc = acc + t * dx[:, g].unsqueeze(1)
    if bw.kind == "q4":
        for b in range(nb):
            off = off + m[:, b].unsqueeze(0) * u[:, b].unsqueeze(1)
    y = acc + off if bw.kind == "q4" else acc
    if bias is not None:
        y = y + bias
    return y
