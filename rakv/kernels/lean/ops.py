"""The lean forward's pieces: a linear as it calls it (``_Op``; fused q|k|v and gate|up, their codes),
RMSNorm (``_Norm``), the rotary tables (``_Rope``)."""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn import functional as F

from .. import blockq
from .support import SEPARATE_QKV, kind


class _Fused(nn.Module):
    """Several linear layers over the same input as one: y = x [W_1; W_2; ...]^T (+ b).

    Built from the layers' own parameters (a concatenated copy, packed by the fast path when the
    layers are), rebuilt when any of them changes in place."""

    def __init__(self, mods: list[nn.Module]):
        super().__init__()
        self.mods = mods
        # a quantized linear (the int8 draft) has no weight tensor to concatenate: run them apart
        self.split = not all(isinstance(getattr(m, "weight", None), torch.Tensor) for m in mods)
        if self.split:
            self.fns = [m.forward for m in mods]
            return
        self.sizes = [int(m.weight.shape[0]) for m in mods]
        self.params = [p for m in mods for p in (m.weight, m.bias) if p is not None]
        self._build()

    def _versions(self):
        return tuple(p._version for p in self.params)

    def _build(self) -> None:
        from ..fastpath import FastLinear

        fast = all(isinstance(m, FastLinear) for m in self.mods)
        if fast:
            for m in self.mods:                # changed in place since packed: its codes no longer hold
                if m._weight_version() != m._version:
                    m.repack()
        # (a rebuild runs inside the forward's inference mode: the copy must be a normal tensor)
        with torch.inference_mode(False), torch.no_grad():
            b = None
            if any(m.bias is not None for m in self.mods):
                b = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(n)
                               for m, n in zip(self.mods, self.sizes)])
            blocks = [m.block for m in self.mods] if fast else [None]
            if all(c is not None for c in blocks):  # codes: no fp32 copy of the stacked weights
                # stacked when of one kind; else (a Q4_K_M file's Q4_K q, k and Q6_K v) each its own
                self._modules.pop("lin", None)
                fused = blockq.concat(blocks)
                if fused is not None:          # the parts' codes become views of the stack (one copy)
                    for m, part in zip(self.mods, blockq.parts_of(fused, [c.N for c in blocks])):
                        m.block = part
                self.lin, self.version = _Coded(self.mods, fused, b), self._versions()
                return
            w = torch.cat([m.weight.detach() for m in self.mods], 0)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
            lin.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=False)
            if fast:
                fl = FastLinear(lin)
                fl.one_row_plain = self.mods[0].one_row_plain
                lin = fl
        self.lin = lin
        self.version = self._versions()

    def current(self) -> nn.Module:
        """The fused linear as the source layers are now (rebuilt after an in-place change, with
        their one-row kernel: the fast path's per-machine choice)."""
        from ..fastpath import FastLinear

        if self._versions() != self.version:
            self._build()
        if isinstance(self.lin, FastLinear):
            self.lin.one_row_plain = self.mods[0].one_row_plain
        return self.lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split:
            return torch.cat([f(x) for f in self.fns], dim=-1)
        return self.current().forward(x)


PART_FIELDS = {"qkv": ("q_part", "k_part", "v_part"), "gate_up": ("gate_part", "up_part")}


def _coded_parts(op, N: int, K: int) -> list | None:
    """The parts' codes of a fused layer whose parts are coded but not stackable (other kinds):
    [q, k, v] or [gate, up] BlockWeights in output order, their outputs adding up to N; else None."""
    lin = getattr(op, "mod", None)
    lin = lin.current() if isinstance(lin, _Fused) and not lin.split else None
    if not isinstance(lin, _Coded) or lin.block is not None:
        return None
    blocks = [getattr(m, "block", None) for m in lin.mods]
    if (not all(isinstance(b, blockq.BlockWeight) for b in blocks) or sum(b.N for b in blocks) != N
            or any(b.K != K for b in blocks) or len({b.numerics for b in blocks}) != 1):
        return None
    return blocks


class _Coded:
    """Fused layers whose parts all run from block codes: up to ``BLOCK_ROWS`` rows the stacked
    codes (one kernel call); past that (a long prefill), or when the parts' codes are of different
    kinds (``block`` None), each part's own layer (its codes, or its packed kernel), the outputs
    side by side. No fp32 copy of the stacked weights is made (it would only serve long prefills)."""

    def __init__(self, mods: list[nn.Module], block, bias: torch.Tensor | None):
        self.mods, self.block, self.bias = mods, block, bias

    def wide(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.mods], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None and (x.shape[-2] <= BLOCK_ROWS or getattr(self.block, "all_rows", False)):
            return self.block(x, self.bias)
        return self.wide(x)


class _Op:
    """One linear as the lean forward calls it, without the module machinery: the fast path's
    packed kernel (or, for one row where the fast path chose it, torch's own) called directly on
    the module's tensors; any other module (a quantized int8 linear) through its own forward.
    ``refresh`` re-reads the module (after an in-place weight change or a one-row kernel switch)."""

    __slots__ = ("mod", "fn", "packed", "bias", "w", "plain1", "block", "wide")

    def __init__(self, mod: nn.Module):
        self.mod = mod
        self.refresh()

    def refresh(self) -> None:
        from ..fastpath import FastLinear

        mod = self.mod
        lin = mod.current() if isinstance(mod, _Fused) and not mod.split else mod
        if isinstance(lin, _Coded):
            self.fn, self.packed, self.bias, self.block, self.wide = None, None, lin.bias, lin.block, lin.wide
            if lin.block is None:
                self.fn = lin.forward
        elif isinstance(lin, FastLinear):
            if lin._weight_version() != lin._version:
                lin.repack()
            self.fn, self.bias, self.block = None, lin._bias, lin.block
            # with codes, past their rows (a long prefill) the layer's own forward packs on first use
            self.packed, self.wide = (None, lin.forward) if lin.block is not None else (lin.packed(), None)
            w = lin.weight.detach()
            self.w, self.plain1 = (w.t() if lin.transposed else w), lin.one_row_plain      # Conv1D: W [in, out]
        else:
            self.fn = lin.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(x)
        if self.block is not None and (x.shape[-2] <= BLOCK_ROWS or getattr(self.block, "all_rows", False)):
            return self.block(x, self.bias)
        if self.packed is None:                  # stacked codes, past their rows: the parts' kernels
            return self.wide(x)
        if self.plain1 and x.shape[-2] == 1:
            return F.linear(x, self.w, self.bias)
        return _POINTWISE(x, self.packed, self.bias, "none", [], "")


def _pointwise():
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: no FastLinear either
        return None


_POINTWISE = _pointwise()
BLOCK_ROWS = blockq.MAX_ROWS   # read once: _Op.__call__ is the hot path
FUSED_QKV, FUSED_GATE_UP = "rakv_qkv", "rakv_gate_up"
_VERSION = operator.attrgetter("_version")     # a parameter's in-place change counter (``_sync``)


def fuse_for_quantization(model: nn.Module) -> None:
    """Give every decoder layer fused q|k|v and gate|up ``nn.Linear`` submodules (copies of the
    weights), so that ``quantize_dynamic`` quantizes them too and the lean forward of the int8
    copy runs one int8 kernel where it would run three (per-channel scales are per output row,
    so the fused layers quantize exactly as the separate ones). HF's forward does not use them."""
    if kind(model) not in SEPARATE_QKV:     # GPT-2's c_attn and Phi-3's qkv_proj are q|k|v already
        return
    for L in model.model.layers:
        a, m = L.self_attn, L.mlp
        for parent, name, mods in ((a, FUSED_QKV, [a.q_proj, a.k_proj, a.v_proj]),
                                   (m, FUSED_GATE_UP, [m.gate_proj, m.up_proj])):
            w = torch.cat([x.weight.detach() for x in mods], 0)
            with torch.device("meta"):                           # no random init of what is replaced at once
                lin = nn.Linear(w.shape[1], w.shape[0], bias=any(x.bias is not None for x in mods), dtype=w.dtype)
            lin.weight = nn.Parameter(w, requires_grad=False)
            if lin.bias is not None:
                lin.bias = nn.Parameter(torch.cat([x.bias.detach() if x.bias is not None
                                                   else w.new_zeros(x.weight.shape[0]) for x in mods]),
                                        requires_grad=False)
            setattr(parent, name, lin)


class _Norm:
    """One RMSNorm as the lean forward runs it: HF's ``w * x / rms(x)`` (Llama, Qwen, Phi-3) or
    Gemma's ``(1 + w) * x / rms(x)``, the effective weight made once (and again by ``refresh`` after
    an in-place change), in float32 torch's fused op."""

    __slots__ = ("mod", "one_plus", "eps", "w")

    def __init__(self, mod: nn.Module, one_plus: bool):
        self.mod, self.one_plus = mod, one_plus
        self.eps = float(getattr(mod, "variance_epsilon", None) or getattr(mod, "eps"))
        self.refresh()

    def refresh(self) -> None:
        w = self.mod.weight.detach()
        self.w = (1.0 + w.float()).to(w.dtype) if self.one_plus else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.w.dtype == torch.float32:
            return F.rms_norm(x, self.w.shape, self.w, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:                                     # Gemma: in float32, then the input's dtype
            return (h * (1.0 + self.mod.weight.float())).to(x.dtype)
        return self.mod.weight * h.to(x.dtype)


class _Rope:
    """cos / sin tables of one rotary embedding (HF's inverse frequencies and attention scaling),
    grown in doublings; sin carries rotate_half's sign (see ``LeanLlama._rotate``)."""

    __slots__ = ("inv_freq", "scaling", "dim", "cos", "sin", "dtype")

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
        self.inv_freq, self.scaling, self.dtype = inv_freq.detach().float().cpu(), scaling, dtype
        self.dim = 2 * self.inv_freq.numel()
        self.cos = self.sin = torch.empty(0, self.dim)

    def at(self, start: int, n: int):
        """cos, sin [n, 1, R] for positions start..start+n-1 (R: the rotary dims)."""
        end, d = start + n, self.dim
        if end > self.cos.shape[0]:
            size = max(256, 1 << (end - 1).bit_length())
            pos = torch.arange(size, dtype=torch.float)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin() * self.scaling
            sin[:, : d // 2] *= -1                  # rotate_half's sign (see _rotate)
            self.cos, self.sin = (emb.cos() * self.scaling).to(self.dtype), sin.to(self.dtype)
        return self.cos[start:end, None], self.sin[start:end, None]
