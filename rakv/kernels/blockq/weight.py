"""A linear layer's weight as block codes (``BlockWeight``): finding exact codes for fp32 weights
(``encode``), quantizing (``quantize_q8_0``, ``quantize_q4_1``), stacking and splitting them."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .consts import BLK, KIND_CODES, MIN_PARAMS, NUMERICS, QK_K
from .lib import _Lib, library
from .tiles import tiled, tiles


class _LayerDesc(ctypes.Structure):
    """``rakv_layer`` in kernels/blockq.c."""
    _fields_ = [("kind", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("numerics", ctypes.c_int64), ("isc", ctypes.c_void_p), ("imn", ctypes.c_void_p),
                ("dg", ctypes.c_void_p), ("mg", ctypes.c_void_p),
                ("tq", ctypes.c_void_p), ("tsc", ctypes.c_void_p), ("tmn", ctypes.c_void_p),
                ("tdg", ctypes.c_void_p), ("tmg", ctypes.c_void_p)]


# ----------------------------------------------------------------------------- finding the codes
def _fp16_near(x: torch.Tensor, step: int) -> torch.Tensor:
    """The float16 value ``step`` ulps from float16(x) in magnitude (as float32)."""
    h = x.to(torch.float16)
    if step:
        bits = h.view(torch.int16).to(torch.int32) + step
        h = bits.clamp(-32768, 32767).to(torch.int16).view(torch.float16)
    return h.to(torch.float32)


# Why an fp32 check is exact: every candidate scale d is a float16 value (11 significant bits), so
# d * q (q of 4 or 8 bits) is exact in fp32, and torch's separate mul and add round d q + m once,
# as the kernel's fma does. A block is kept only when that rebuild equals the weight bit for bit.
def _q4_try(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """Codes for blocks w [B, 32] under scale d and minimum m [B, 1]: (q [B, 32], ok [B])."""
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m) / safe).clamp_(0, 15)
    q = torch.where(d > 0, q, torch.zeros_like(q))
    ok = ((d * q + m) == w).all(1) & torch.isfinite(d).squeeze(1)
    return q, ok


def _q8_try(w: torch.Tensor, d: torch.Tensor):
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe).clamp_(-128, 127)
    q = torch.where(d > 0, q, torch.zeros_like(q))
    ok = ((d * q) == w).all(1) & torch.isfinite(d).squeeze(1)
    return q, ok


CANDIDATES = {"q4": [(top, step) for top in (15, 14, 13) for step in (0, -1, 1)],
              "q8": [(top, step) for top in (127, 128, 126) for step in (0, -1, 1)]}


def _solve(w: torch.Tensor, kind: str, chunk: int = 1 << 16):
    """Codes (q, d, m) for every block of w [B, 32] fp32, or None when a block has none. GGUF's
    quantizers put q = 0 at a Q4_1 block's minimum and |q| = 127 at a Q8_0 block's largest weight,
    so the scale is (max - min) / 15 or max |w| / 127 as a float16, give or take an ulp."""
    qs, ds, ms = [], [], []
    for s in range(0, w.shape[0], chunk):
        wb = w[s: s + chunk]
        n = wb.shape[0]
        done = torch.zeros(n, dtype=torch.bool)
        q = torch.zeros(n, BLK)
        d = torch.zeros(n, 1)
        lo, hi = wb.min(1, keepdim=True).values, wb.max(1, keepdim=True).values
        amax = wb.abs().max(1, keepdim=True).values
        for j, (top, step) in enumerate(CANDIDATES[kind]):
            todo = ~done
            idx = todo.nonzero().squeeze(1)
            if kind == "q4":
                dc = _fp16_near((hi[idx] - lo[idx]) / top, step)
                qc, ok = _q4_try(wb[idx], dc, lo[idx])
            else:
                dc = _fp16_near(amax[idx] / top, step)
                qc, ok = _q8_try(wb[idx], dc)
            got = idx[ok]
            if s == 0 and j == 0 and got.numel() < n // 2:
                return None               # not this code: a coded weight fits its first guess almost everywhere
            q[got], d[got] = qc[ok], dc[ok]
            done[got] = True
            if bool(done.all()):
                break
        if not bool(done.all()):
            return None
        qs.append(q)
        ds.append(d)
        ms.append(lo)
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


@dataclass
class BlockWeight:
    """One linear layer's weight W [N, K] as block codes (see the module docstring)."""

    kind: str                      # "q4" | "q8" | "q8x"
    N: int
    K: int
    qs: torch.Tensor               # q4: uint8 [N, K/32, 16] (input j low nibble, j + 16 high); q8: int8 [N, K/32, 32];
                                   # q8x: uint8 [N, K/32, 32]
    d: torch.Tensor | None         # float32 [N, K/32] (q8x: [N, K/16], a scale per 16 inputs); None in K-quant
                                   # codes read back from a file (``scales`` makes d and m from isc .. mg)
    m: torch.Tensor | None         # float32, as d (q4 and q8x; None for q8)
    numerics: str = "fp32"         # "fp32": the fp32 linear of the rebuilt weights; "q8": integer dot
                                   # products with 8-bit activation blocks (blockq.c, "q8 numerics")
    # K-quant scales as the file holds them (from_gguf of Q4_K / Q6_K; None otherwise): q8 numerics then
    # read these instead of d and m (D = dg sc, M = mg mn for q4; D = dg sc, M = -32 D for q8x), so a
    # decode step streams 4.75 (Q4_K) or 8.6 (Q6_K) bits a weight instead of 6 or 12, the same values
    isc: torch.Tensor | None = None    # q4: uint8 [N, K/32]; q8x: int8 [N, K/16]
    imn: torch.Tensor | None = None    # q4: uint8 [N, K/32] (the minimums' 6-bit multipliers)
    dg: torch.Tensor | None = None     # float32 [N, K/256]: the super-block scale d
    mg: torch.Tensor | None = None     # q4: float32 [N, K/256], -dmin
    lanes: bool = False                # q8 numerics in the lane form, not the tiled one (``tiles``): fixed
                                       # when the q8 codes are made (``with_numerics``), from RAKV_TILES at load

    @property
    def nbytes(self) -> int:
        if self.d is None:
            return sum(t.numel() * t.element_size() for t in (self.qs, *self._extra().values()) if t is not None)
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def scales(self) -> tuple:
        """(d, m) as the fp32 arithmetic reads them; K-quant codes kept without them (``save_codes``
        drops them: q8 arithmetic reads the file's own scales) get them made once from isc .. mg:
        the same floats from_gguf made (a float16 times a small integer; m = -dmin mn, or -32 d)."""
        if self.d is None:
            nb = self.K // BLK
            if self.kind == "q4":
                dg = self.dg.repeat_interleave(QK_K // BLK, 1)[:, :nb]
                mg = self.mg.repeat_interleave(QK_K // BLK, 1)[:, :nb]
                self.d, self.m = (dg * self.isc.float()).contiguous(), (mg * self.imn.float()).contiguous()
            else:                                            # q8x: Q6_K's int8 scales per 16 inputs
                dg = self.dg.repeat_interleave(QK_K // 16, 1)[:, :2 * nb]
                self.d = (dg * self.isc.float()).contiguous()
                self.m = (-32.0 * self.d).contiguous()
            self._fn = None                                  # described again with them
        return self.d, self.m

    @property
    def compact(self) -> bool:
        return self.isc is not None

    @property
    def streamed_bytes(self) -> int:
        """What one pass over this layer reads in its numerics (q8 with K-quant scales: codes and scales)."""
        if self.numerics == "q8" and self.compact:
            return sum(t.numel() * t.element_size() for t in (self.qs, self.isc, self.imn, self.dg, self.mg)
                       if t is not None)
        return self.nbytes

    def _extra(self) -> dict:
        return {"isc": self.isc, "imn": self.imn, "dg": self.dg, "mg": self.mg}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 -> [..., N]: the fp32 linear of the rebuilt weights (+ bias)."""
        fn = self._fn or self._bind()
        if not x.is_contiguous():
            x = x.contiguous()
        y = x.new_empty((*x.shape[:-1], self.N))
        fn(self._ref, x.data_ptr(), x.numel() // self.K, y.data_ptr(),
           None if bias is None else bias.data_ptr(), torch.get_num_threads())
        return y

    _fn = None
    _ref = None
    _tiled = None          # q8 numerics on K-quant codes: the tiled form (``tiled``), made at the first call

    def __deepcopy__(self, memo):
        return self          # read-only codes, shared (a copy would keep a description of these tensors)

    def _bind(self):
        """The kernel's entry and this layer's description for it (made once: a call then passes
        six plain arguments)."""
        if self.d is None and not (self.numerics == "q8" and self.compact):
            self.scales()                                    # fp32 arithmetic reads d and m
        d = self.d.data_ptr() if self.d is not None else None      # (q8 on K-quant scales: never read)
        if self.numerics == "q8" and tiles(self) and self._tiled is None:
            self._tiled = tiled(self)
        tl = self._tiled if self.numerics == "q8" and tiles(self) else {}
        self._desc = _LayerDesc(KIND_CODES[self.kind], self.N, self.K, self.qs.data_ptr(),
                                d, self.m.data_ptr() if self.m is not None else d,
                                NUMERICS.index(self.numerics),
                                *(t.data_ptr() if t is not None else None for t in (self.isc, self.imn, self.dg, self.mg)),
                                *(tl[k].data_ptr() if k in tl else None for k in ("tq", "tsc", "tmn", "tdg", "tmg")))
        self._ref = ctypes.byref(self._desc)
        self._fn = library().rakv_linear
        return self._fn

    def rebuilds(self, w: torch.Tensor) -> bool:
        """Whether these codes rebuild ``w`` [N, K] (float32, CPU, any strides) exactly, element by
        element as ``encode`` checks: one streaming pass in the kernel (a dequantized copy without it)."""
        if (self.N, self.K) != tuple(w.shape) or w.dtype != torch.float32 or w.device.type != "cpu":
            return False
        if library() is None:
            return torch.equal(self.dequantize(), w)
        self._fn or self._bind()
        return _Lib.handle.rakv_check(self._ref, w.data_ptr(), w.stride(0), w.stride(1),
                                      torch.get_num_threads()) == 0

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 rebuilt from the codes (what the kernel multiplies by)."""
        self.scales()
        d = self.d.unsqueeze(-1)
        if self.kind == "q4":
            q = torch.cat([self.qs & 15, self.qs >> 4], -1).float()
            w = d * q + self.m.unsqueeze(-1)          # d q is exact: one rounding, as the fma's
        elif self.kind == "q8x":                      # (GGUF's codes: d q exact too)
            w = d * self.qs.reshape(self.N, -1, BLK // 2).float() + self.m.unsqueeze(-1)
        else:
            w = d * self.qs.float()
        return w.reshape(self.N, self.K)

    def rows(self, index) -> "BlockWeight":
        """The codes of the rows ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return BlockWeight(self.kind, int(idx.numel()), self.K, self.qs[idx].contiguous(),
                           None if self.d is None else self.d[idx].contiguous(),
                           None if self.m is None else self.m[idx].contiguous(), self.numerics,
                           **{k: None if t is None else t[idx].contiguous() for k, t in self._extra().items()},
                           lanes=self.lanes)

    def with_numerics(self, numerics: str, lanes: bool = False) -> "BlockWeight":
        """The same codes under another arithmetic (``NUMERICS``), sharing the tensors. ``lanes``
        (q8): the lane form instead of the tiled one (``RAKV_TILES=0`` as the load read it, passed down)."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, not {numerics!r}")
        lanes = bool(lanes) if numerics == "q8" else False
        if numerics == self.numerics and lanes == self.lanes:
            return self
        return BlockWeight(self.kind, self.N, self.K, self.qs, self.d, self.m, numerics, **self._extra(), lanes=lanes)

    @property
    def all_rows(self) -> bool:
        """Whether every row count runs from the codes: under q8 numerics a long prefill must compute
        what the same rows compute one by one (fp32 codes hand long prefills to oneDNN)."""
        return self.numerics == "q8"


@torch.no_grad()
def encode(weight: torch.Tensor) -> BlockWeight | None:
    """Block codes that rebuild ``weight`` [N, K] (float32, CPU) bit for bit, Q4 tried before Q8;
    None when it has none (or is not a float32 CPU matrix with K a multiple of 32)."""
    w = weight.detach()
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % BLK \
            or w.numel() < MIN_PARAMS or not bool(torch.isfinite(w).all()):
        return None
    N, K = (int(s) for s in w.shape)
    blocks = w.reshape(-1, BLK)
    for kind in ("q4", "q8"):
        got = _solve(blocks, kind)
        if got is None:
            continue
        q, d, m = got
        if kind == "q4":
            q = q.to(torch.uint8).view(N, K // BLK, BLK)
            qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()
        else:
            qs = q.to(torch.int8).view(N, K // BLK, BLK).contiguous()
        return BlockWeight(kind, N, K, qs, d.to(torch.float32).view(N, K // BLK).contiguous(),
                           m.to(torch.float32).view(N, K // BLK).contiguous() if kind == "q4" else None)
    return None


def concat(blocks: list) -> BlockWeight | None:
    """The codes of layers stacked along their outputs (a fused q|k|v), when all have codes of one kind."""
    if not blocks or any(b is None for b in blocks) or len({(b.kind, b.K) for b in blocks}) != 1:
        return None
    if len({(b.numerics, b.lanes) for b in blocks}) != 1:
        return None
    b0 = blocks[0]
    extra = {}
    if all(b.compact for b in blocks) and len({b.imn is None for b in blocks}) == 1:
        extra = {k: torch.cat([b._extra()[k] for b in blocks]) for k, v in b0._extra().items() if v is not None}
    if not extra or any(b.d is not None for b in blocks):
        for b in blocks:
            b.scales()
    d = None if any(b.d is None for b in blocks) else torch.cat([b.d for b in blocks])
    m = torch.cat([b.m for b in blocks]) if d is not None and b0.m is not None else None
    return BlockWeight(b0.kind, sum(b.N for b in blocks), b0.K, torch.cat([b.qs for b in blocks]), d, m,
                       b0.numerics, **extra, lanes=b0.lanes)


def parts_of(fused: BlockWeight, sizes: list) -> list:
    """The codes of stacked layers (``concat``'s result) part by part, as views of its tensors (rows
    n0..n1 of each): the parts then keep no copy of their own."""
    out, n0 = [], 0
    for n in sizes:
        sl = {k: None if t is None else t[n0:n0 + n] for k, t in fused._extra().items()}
        out.append(BlockWeight(fused.kind, n, fused.K, fused.qs[n0:n0 + n], None if fused.d is None else fused.d[n0:n0 + n],
                               None if fused.m is None else fused.m[n0:n0 + n], fused.numerics, **sl,
                               lanes=fused.lanes))
        n0 += n
    return out


@torch.no_grad()
def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 codes of ``weight`` [N, K] (K a multiple of 32) as llama.cpp quantizes a tensor to Q8_0:
    per block of 32, d = float16(max |w| / 127), q = round(w / d). Under q8 numerics these codes ARE
    the layer (a weight that has no codes of its own: an fp32 checkpoint, a tied head)."""
    w = weight.detach().float().reshape(weight.shape[0], -1, BLK)
    N, nb = w.shape[0], w.shape[1]
    d = (w.abs().amax(-1) / 127.0).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe.unsqueeze(-1)).clamp_(-127, 127)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return BlockWeight("q8", N, nb * BLK, q.to(torch.int8).contiguous(), d.contiguous(), None)


@torch.no_grad()
def quantize_q4_1(weight: torch.Tensor) -> BlockWeight:
    """Q4_1 codes of ``weight`` [N, K] (K a multiple of 32) as llama.cpp quantizes to Q4_1: per block
    of 32, m = float16(min w), d = float16((max w - m) / 15), q = round((w - m) / d) in 0 .. 15.
    A draft's codes made narrower (``models.narrow_draft``): a step streams 6 bits a weight instead
    of 9 for Q8_0 or Q5_0 codes; the draft changes, every policy stays exact (the target verifies)."""
    w = weight.detach().float().reshape(weight.shape[0], -1, BLK)
    N, nb = w.shape[0], w.shape[1]
    lo, hi = w.amin(-1), w.amax(-1)
    m = lo.to(torch.float16).float()
    d = ((hi - m) / 15.0).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q)).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()              # input j low nibble, j + 16 high
    return BlockWeight("q4", N, nb * BLK, qs, d.contiguous(), m.contiguous())


def narrower_q4(b: BlockWeight, rows: int = 8192) -> BlockWeight:
    """``b`` as Q4_1 codes of its own weights (rows at a time: no whole fp32 copy), under b's
    numerics; ``b`` itself where its codes are 4-bit already."""
    if b.kind == "q4":
        return b
    parts = [quantize_q4_1(b.rows(torch.arange(r0, min(r0 + rows, b.N))).dequantize()) for r0 in range(0, b.N, rows)]
    out = BlockWeight("q4", b.N, b.K, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                      torch.cat([p.m for p in parts]))
    return out.with_numerics(b.numerics, lanes=b.lanes)
