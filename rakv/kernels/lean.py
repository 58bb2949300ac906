"""A lean decoder forward for Llama-family and GPT-2 models: the same weights and maths as the HF
model, without the framework around it.

A decode step of the demo model (30 layers, 135M parameters) spends about a third of its time
outside the linear layers: HF's per-module dispatch, decorators, mask construction and rotary
recomputation. This forward runs the same computation straight through, layer by layer, on the
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
What runs a model's forward is its backend (``rakv.backend``), chosen once at load: it reads the
switches (``RAKV_LEAN``, ``RAKV_C_LAYERS``, ``RAKV_BLOCKQ``) then and hands this forward its decisions
(``configure``); nothing here reads the environment per forward.

Shapes: x [1, n, H]; q [1, Hq, n, D]; k, v [1, Hkv, n, D] (the cache: [1, Hkv, past + n, D]).
"""

from __future__ import annotations

import operator
import threading
import weakref
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from ..paths import env_on
from . import blockq

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
            "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Phi3ForCausalLM": "phi3", "GPT2LMHeadModel": "gpt2"}
ARCHS = tuple(a for a, f in FAMILIES.items() if f != "gpt2")
GPT2_ARCHS = ("GPT2LMHeadModel",)
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "gelu_fast", "quick_gelu")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")      # rope types whose frequencies do not move with length
SEPARATE_QKV = ("llama", "qwen3", "gemma2", "gemma3")       # q, k, v and gate, up as separate linears (Phi-3 fuses them)


def env_enabled() -> bool:
    return env_on("RAKV_LEAN")


def fused_env_enabled() -> bool:
    """``RAKV_C_LAYERS=0`` keeps every layer of a step in Python (for comparison). Read at load
    (``rakv.backend.read_switches``, or a lean forward's construction), not per forward."""
    return env_on("RAKV_C_LAYERS")


def kind(model: nn.Module) -> str:
    """Which lean forward fits ``model``'s architecture: "llama" (Llama, Mistral, Qwen2), "qwen3",
    "gemma2", "gemma3", "phi3" or "gpt2" ("" for none)."""
    return FAMILIES.get(type(model).__name__, "")


def supported(model: nn.Module) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can)."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    fam = kind(model)
    if cfg is None or not fam:
        return f"{name} (lean forward: {', '.join(ARCHS + GPT2_ARCHS)})"
    p = next(model.parameters())
    if p.device.type != "cpu":
        return f"device {p.device.type}"
    if fam == "gpt2":
        return _gpt2_unsupported(cfg)
    base = getattr(model, "model", None)
    rot = getattr(base, "rotary_emb", None)
    if rot is None or not hasattr(base, "layers"):
        return f"{name} without the usual layout (model.layers, model.rotary_emb)"
    types = rot.rope_type if isinstance(getattr(rot, "rope_type", None), dict) else {"": getattr(rot, "rope_type", "?")}
    for t in types.values():
        if t not in STATIC_ROPE:
            return f"rope type {t}"
    try:
        for inv, _ in _rope_sources(model).values():
            if 2 * inv.numel() != _head_dim(cfg) and fam != "phi3":
                return "partial rotary embedding"
    except AttributeError as e:
        return f"rotary embedding layout ({e})"
    L = base.layers[0]
    if _act_fn(L.mlp) is None:
        return f"activation {getattr(cfg, 'hidden_activation', None) or getattr(cfg, 'hidden_act', '?')}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp"
    if fam == "gemma3" and getattr(cfg, "attn_logit_softcapping", None) and \
            getattr(cfg, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        return f"attention {cfg._attn_implementation} with soft-capping"
    return None


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _rope_sources(model: nn.Module) -> dict:
    """{layer type or "": (inv_freq, attention scaling)} from the model's own rotary module (HF's
    frequencies, whatever rope type made them: default, linear, llama3 or yarn)."""
    rot = model.model.rotary_emb
    if isinstance(getattr(rot, "rope_type", None), dict):          # Gemma 3: one table per layer type
        return {t: (getattr(rot, f"{t}_inv_freq"), float(getattr(rot, f"{t}_attention_scaling")))
                for t in rot.rope_type}
    return {"": (rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)))}


def _act_fn(mlp: nn.Module):
    """The MLP's activation as a plain function (the same maths as its module), None if unknown."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name == "SiLUActivation":
        return F.silu
    if name == "GELUTanh" and getattr(act, "act", None) is not None:
        fn = act.act
        if getattr(fn, "func", None) is F.gelu and getattr(fn, "keywords", {}) == {"approximate": "tanh"}:
            return fn
    if name == "GELUActivation" and getattr(act, "act", None) is F.gelu:
        return F.gelu
    if isinstance(act, nn.GELU):
        return partial(F.gelu, approximate=act.approximate)
    return None


def _gpt2_unsupported(cfg) -> str | None:
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in GPT2_ACTS:
        return f"activation {act}"
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(cfg, flag, False):
            return flag
    return None


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
        from .fastpath import FastLinear

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
        from .fastpath import FastLinear

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
        from .fastpath import FastLinear

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


class TreeLayout:
    """A token tree as the forward reads it: row i's parent row (``parents[i] < i``; -1: it follows
    the cached tokens directly), its depth (its position is past + depth), and its ancestry path,
    the rows from its root down to itself (``path`` [n, max depth + 1] int64, zero-padded)."""

    __slots__ = ("parents", "depths", "depth", "path")

    def __init__(self, parents: list[int]):
        depths: list[int] = []
        paths: list[list[int]] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"tree row {i}: parent {p} must be -1 or an earlier row")
            depths.append(0 if p < 0 else depths[p] + 1)
            paths.append([i] if p < 0 else paths[p] + [i])
        self.parents, self.depths = list(parents), depths
        self.depth = torch.tensor(depths, dtype=torch.long)                 # [n]
        self.path = torch.zeros(len(parents), max(depths, default=0) + 1, dtype=torch.long)
        for i, pa in enumerate(paths):
            self.path[i, : len(pa)] = torch.tensor(pa)

    def mask(self, past: int, window: int | None = None) -> torch.Tensor:
        """[n, past + n] bool: row i sees the cached keys and its ancestry's rows, only those within
        its last ``window`` positions on a sliding-window layer (row r's position is past + depth)."""
        n = len(self.parents)
        m = torch.zeros(n, past + n, dtype=torch.bool)
        for i, d in enumerate(self.depths):
            lo = past + d - window + 1 if window else 0                      # the first visible position
            m[i, max(0, lo):past] = True
            for r in self.path[i, : d + 1].tolist():
                m[i, past + r] = past + self.depths[r] >= lo
        return m


class _Layer:
    """One decoder layer as the lean forward runs it: its norms, linears (``_Op``s), q / k norms
    (Qwen3, Gemma 3), the norms after attention and after the MLP (Gemma), the attention window
    (None: full) and which rotary table it reads."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down", "q_norm", "k_norm", "post_attn", "post_ff",
                 "window", "rope")

    def __iter__(self):            # (the linears, for _watch)
        return iter((self.qkv, self.o, self.gate_up, self.down))


def weights_may_change(past: int) -> bool:
    """Look for weights changed in place at a forward from an empty cache only: a forward after
    cached positions extends a cache those weights made (a change since cannot be served by it),
    and reading ~270 change counters there, cold after the previous forward, cost ~0.1 ms of a
    4 ms step (docs/fastpath.md)."""
    return past == 0


class LeanLlama:
    """The lean forward of one decoder model of the Llama lineage (see the module docstring):
    Llama, Mistral and Qwen2 as they are; Qwen3 with q / k norms; Gemma 2 and 3 with their scaled
    embedding, (1 + w) norms around attention and MLP, GeGLU, sliding-window layers, q / k norms
    (3), attention (2) and final logit soft-capping and query_pre_attn_scalar; Phi-3 with its fused
    qkv_proj / gate_up_proj and partial rotary. Everything read from the HF modules themselves."""

    def __init__(self, model: nn.Module, layers: list | None = None):
        cfg = model.config
        self.model = model
        self.family = kind(model)
        base = model.model
        self.embed = base.embed_tokens
        self.lm_head = model.lm_head
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = _head_dim(cfg)
        self.gemma = self.family in ("gemma2", "gemma3")
        attn0 = base.layers[0].self_attn
        self.scale = float(getattr(attn0, "scaling", None) or self.head_dim ** -0.5)
        self.softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if self.family == "gemma2" else 0.0
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        scale = getattr(self.embed, "embed_scale", None)
        self.embed_scale = scale if isinstance(scale, torch.Tensor) else None
        self.act = _act_fn(base.layers[0].mlp)
        dtype = self.embed.weight.dtype
        self.ropes = {t: _Rope(inv, sc, dtype) for t, (inv, sc) in _rope_sources(model).items()}
        self.windows = _windows(model)
        self.layers = layers if layers is not None else [self._layer(i, L) for i, L in enumerate(base.layers)]
        self.head = _Op(self.lm_head)
        self.head_ids: torch.Tensor | None = None   # a draft's vocabulary (``limit_head``); None: every id
        self._head_rows = None
        self.final_norm = _Norm(base.norm, self.gemma)
        self._descs = None
        self._final_c = False               # the final norm runs in the C call (set with the descriptions)
        self._bound = None                  # the cache views the layer descriptions point into
        self._watch(model)

    def _watch(self, model: nn.Module) -> None:
        """The linears' ``_Op``s and what _sync watches: every weight and bias they read, and the
        one-row kernel choice (called last by a constructor, once layers and head are set)."""
        self.ops = [op for L in self.layers for op in L if isinstance(op, _Op)] + [self.head]
        self.norms = [n for L in self.layers if isinstance(L, _Layer)
                      for n in (L.ln1, L.ln2, L.q_norm, L.k_norm, L.post_attn, L.post_ff) if n is not None]
        if isinstance(getattr(self, "final_norm", None), _Norm):
            self.norms.append(self.final_norm)
        self.params = [p for p in model.parameters() if p.dim() >= 1]
        self.probe = next((m for m in model.modules() if hasattr(m, "one_row_plain")), None)
        self.state = self._state()
        self.dtype = self.embed.weight.dtype
        if not hasattr(self, "use_c_layers"):       # the switches as at construction, until configured
            self.configure(c_layers=fused_env_enabled(), attend=blockq.env_enabled())

    def configure(self, c_layers: bool = True, attend: bool = True) -> None:
        """The decisions the backend made at load (``rakv.backend.select_backend``): ``c_layers``,
        a step's layers in one C call where the model allows (``RAKV_C_LAYERS``); ``attend``, the
        block kernel's attention for steps (``RAKV_BLOCKQ``). Fixed until the next load / switch."""
        self.use_c_layers = bool(c_layers)
        self.use_attend = bool(attend)

    def _layer(self, i: int, L: nn.Module) -> _Layer:
        a, m = L.self_attn, L.mlp
        out = _Layer()
        if self.family == "phi3":
            qkv, gate_up = a.qkv_proj, m.gate_up_proj
        else:
            qkv = getattr(a, FUSED_QKV, None) or _Fused([a.q_proj, a.k_proj, a.v_proj])
            gate_up = getattr(m, FUSED_GATE_UP, None) or _Fused([m.gate_proj, m.up_proj])
        out.qkv, out.o, out.gate_up, out.down = _Op(qkv), _Op(a.o_proj), _Op(gate_up), _Op(m.down_proj)
        g = self.gemma
        out.ln1 = _Norm(L.input_layernorm, g)
        if g:      # Gemma: norm the attention's output, then before and after the MLP
            out.post_attn = _Norm(L.post_attention_layernorm, g)
            out.ln2, out.post_ff = _Norm(L.pre_feedforward_layernorm, g), _Norm(L.post_feedforward_layernorm, g)
        else:
            out.post_attn, out.ln2, out.post_ff = None, _Norm(L.post_attention_layernorm, g), None
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        out.q_norm = _Norm(qn, g) if qn is not None else None
        out.k_norm = _Norm(kn, g) if kn is not None else None
        out.window = self.windows[i]
        out.rope = getattr(a, "layer_type", "") if len(self.ropes) > 1 else ""
        return out

    def coded_blocks(self) -> list:
        """[(name, BlockWeight)] every block of codes this forward calls: each op's (stacked) codes,
        or the parts' where a fused layer runs them apart; names by position (stable for a model)."""
        out = []
        for i, op in enumerate(self.ops):
            if getattr(op, "block", None) is not None:
                out.append((f"op{i}", op.block))
                continue
            lin = op.mod.current() if isinstance(op.mod, _Fused) and not op.mod.split else None
            if isinstance(lin, _Coded):
                out += [(f"op{i}.{j}", m.block) for j, m in enumerate(lin.mods) if getattr(m, "block", None) is not None]
        return out

    def _state(self, weights: bool = True) -> tuple:
        return (sum(map(_VERSION, self.params)) if weights else self.state[0],
                getattr(self.probe, "one_row_plain", None))

    def _sync(self, weights: bool = True) -> None:
        """Re-read the linears (and the norms' effective weights) when a weight changed in place or
        the one-row kernel was switched. ``weights``: look at the weights' change counters (see
        ``weights_may_change``); the kernel switch is looked at every time."""
        state = self._state(weights)
        if state != self.state:
            for op in self.ops:
                op.refresh()
            for nm in getattr(self, "norms", ()):
                nm.refresh()
            self.state = state
            self._descs = self._bound = None

    def truncated(self, model: nn.Module) -> "LeanLlama":
        """The lean forward of ``model``, a layer-truncated copy sharing this model's first layers
        (the layers:L draft): its fused layers are this one's, not new copies."""
        return LeanLlama(model, self.layers[: len(model.model.layers)])

    @staticmethod
    def tree_layout(parents: list[int]) -> TreeLayout:
        """The ``TreeLayout`` of rows with these parents (what ``forward``'s ``tree`` takes)."""
        return TreeLayout(parents)

    def __deepcopy__(self, memo):
        # a deep copy of the model (the int8 draft's) gets no lean forward: attach() builds its own
        return None

    # ---- pieces
    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's x cos + rotate_half(x) sin, with rotate_half(x) = roll(x, D/2) times the sign that
        ``_Rope`` folded into sin (-sin for the first half). Only the first R dims rotate when the
        table is narrower than the head (Phi-3's partial rotary): the rest pass as they are."""
        R = cos.shape[-1]
        if R == x.shape[-1]:
            return torch.addcmul(x * cos, x.roll(R // 2, -1), sin)
        xr = x[..., :R]
        return torch.cat((torch.addcmul(xr * cos, xr.roll(R // 2, -1), sin), x[..., R:]), dim=-1)

    @staticmethod
    def _mask(past: int, n: int, window: int | None = None) -> torch.Tensor | None:
        """[n, past + n] bool: query i sees keys 0..past+i, or only its last ``window`` of them
        (None for one token that sees all the keys)."""
        if n == 1 and (not window or past < window):
            return None
        m = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        return m.triu(past - window + 1) if window else m

    def rows_alone(self) -> bool:
        """q8 numerics: each linear computes a row alone at every row count, so every forward (a
        prefill, a long verify) runs the steps' own arithmetic too (``forward``): a position's KV
        and logits then never depend on the rows beside it, and a prefix hit's suffix equals the
        same positions of a whole prefill, bit for bit."""
        return bool(getattr(getattr(self.lm_head, "block", None), "all_rows", False))

    def own_attention(self, cache, n: int) -> bool:
        """Whether this forward's attention runs ``blockq.attend`` (a decode or verify step on a
        cache it can read: one whose first layer is the lean forward's buffer or a contiguous
        prefill, as every layer's is) instead of torch's SDPA: each row then comes out the same
        whether it is computed alone or among the k + 1 rows of a verify."""
        alone = self.rows_alone()
        if (n > blockq.ATTEND_ROWS and not alone) or self.dtype != torch.float32:   # (CPU only)
            return False
        if not cache.layers or not cache.layers[0].is_initialized or cache.layers[0].keys.numel() == 0:
            return False                                             # a first forward: SDPA (a prefill)
        L = cache.layers[0]
        return blockq.attend_ok(L.keys, L.values, n, self.n_heads, self.n_kv, self.head_dim, any_rows=alone,
                                enabled=self.use_attend)

    def _start_empty(self, cache) -> bool:
        """A first forward under ``rows_alone``: every layer given an empty KV of its shape, so the
        prefill runs in the C layers, each row as its decode step would (False where they cannot)."""
        if not self.rows_alone() or self.dtype != torch.float32 or not self.c_layers_on():
            return False
        if cache.layers and any(L.is_initialized and L.keys.numel() for L in cache.layers):
            return False
        empty = torch.empty(1, self.n_kv, 0, self.head_dim)
        for i in range(len(self.layers)):
            cache.update(empty, empty, i)
        return True

    def _attention(self, q, k, v, past: int, n: int, window: int | None, masks: dict) -> torch.Tensor:
        """Torch's attention of q [1, Hq, n, D] over k, v [1, Hk, past + n, D] (a prefill, a long
        verify): SDPA with the causal (windowed) mask, or with soft-capping HF's eager maths."""
        Hq, Hk, D = self.n_heads, self.n_kv, self.head_dim
        if window not in masks:
            masks[window] = self._mask(past, n, window)
        mask = masks[window]
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=Hq != Hk).transpose(1, 2).reshape(1, n, Hq * D)
        if Hq != Hk:
            k, v = k.repeat_interleave(Hq // Hk, dim=1), v.repeat_interleave(Hq // Hk, dim=1)
        s = torch.matmul(q, k.transpose(2, 3)) * self.scale
        s = torch.tanh(s / self.softcap) * self.softcap
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v).transpose(1, 2).reshape(1, n, Hq * D)

    # ---- every layer in C (decode and verify steps)
    def _c_layers(self):
        """The layers' descriptions for ``blockq.decode_layers`` (made once, again after ``_sync``
        saw a change), or False where a layer is not plain Llama maths on block codes (q / k norms,
        Gemma's norms, soft-capping, partial rotary, another activation, a layer without codes)."""
        if self._descs is not None:
            return self._descs
        self._descs = False
        H, D = self.embed.weight.shape[1], self.head_dim
        Hq, Hk = self.n_heads, self.n_kv
        if not (self.family == "llama" and not self.gemma and not self.softcap
                and len(self.ropes) == 1 and self.ropes[""].dim == D and self.act is F.silu
                and self.embed_scale is None and self.dtype == torch.float32
                and all(isinstance(L, _Layer) for L in self.layers) and blockq.library() is not None
                and isinstance(getattr(self.layers[0].down, "block", None), blockq.BlockWeight)):
            return False
        L0 = self.layers[0]
        eps, I = L0.ln1.eps, L0.down.block.K
        shapes = {"qkv": ((Hq + 2 * Hk) * D, H), "o": (H, Hq * D), "gate_up": (2 * I, H), "down": (H, I)}
        descs = (blockq.DecoderLayerDesc * len(self.layers))()
        keep = []
        for d, L in zip(descs, self.layers):
            if L.q_norm is not None or L.post_attn is not None or L.post_ff is not None:
                return False
            for name, (N, K) in shapes.items():
                op = getattr(L, name)
                parts = _coded_parts(op, N, K)
                if parts:                   # q, k, v (gate, up) on codes of different kinds: apart
                    for pname, blk in zip(PART_FIELDS[name], parts):
                        setattr(d, pname, blockq.layer_ref(blk))
                    setattr(d, name, None)
                elif (op.fn is not None or not isinstance(getattr(op, "block", None), blockq.BlockWeight)
                        or (op.block.N, op.block.K) != (N, K)):
                    return False
                bias = op.bias
                if bias is not None:
                    bias = bias.detach().float().contiguous()
                    keep.append(bias)
                if not parts:
                    setattr(d, name, blockq.layer_ref(op.block))
                setattr(d, f"{name}_bias", bias.data_ptr() if bias is not None else None)
            for name, nm in (("ln1", L.ln1), ("ln2", L.ln2)):
                if nm.eps != eps or nm.w.dtype != torch.float32 or not nm.w.is_contiguous():
                    return False
                setattr(d, name, nm.w.data_ptr())
            d.window = int(L.window or 0)
        self._descs, self._descs_keep, self._eps, self._I = descs, keep, eps, I
        fn = self.final_norm                # the final RMSNorm in the same call where it is the same maths
        self._final_c = (isinstance(fn, _Norm) and not fn.one_plus and fn.eps == eps
                         and fn.w.dtype == torch.float32 and fn.w.is_contiguous())
        return descs

    def c_layers_on(self):
        """The layers' descriptions when this forward runs a step's layers in C (the switch as the
        backend read it at load, and the model, both allow it), else False."""
        return self.use_c_layers and self._c_layers()

    def _c_forward(self, descs, x: torch.Tensor, cache, past: int, n: int, rope,
                   tree: TreeLayout | None = None) -> torch.Tensor:
        """x [1, n, H] through every layer in ``blockq.decode_layers``, the KV written into each
        layer's growing buffer (``_reserve``) and the layers' views moved past the new rows; then
        through the final norm too where ``_final_c`` (the caller then skips it)."""
        layers = cache.layers[: len(descs)]
        views = getattr(cache, "_rakv_views", None)
        if not buffers_hold(views, layers, past + n):
            views = _reserve_layers(layers, n, views, cache)
        if self._bound is not views:         # new buffers, or the last call wrote another cache's
            for i, d in enumerate(descs):
                d.k, d.v, d.cap = views.K[i].data_ptr(), views.V[i].data_ptr(), views.cap
            self._bound = views
        cos, sin = (t.contiguous() for t in rope)                   # [n, 1, D]: each row's position
        x = x.contiguous()
        blockq.decode_layers(descs, len(descs), x, n, x.shape[-1], self.n_heads, self.n_kv, self.head_dim,
                             self._I, past, cos, sin, self._eps, self.scale,
                             None if tree is None else tree.path, None if tree is None else tree.depth,
                             self.final_norm.w if self._final_c else None)
        ks = views.K[:, :, :, : past + n].unbind(0)                 # every layer's view in two ops
        vs = views.V[:, :, :, : past + n].unbind(0)
        for L, k, v in zip(layers, ks, vs):
            L.keys, L.values = k, v
        views.ks, views.vs = ks, vs
        cache._rakv_views = views
        return x

    # ---- the forward
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, keep: int = 0, tree: TreeLayout | None = None) -> torch.Tensor:
        """ids [1, n] after what ``cache`` holds; returns logits [1, keep or n, V]. ``tree``: the n
        rows form a token tree (each row at position past + depth, seeing the cache and its ancestry)."""
        n = ids.shape[1]
        past = cache.get_seq_length()
        self._sync(weights_may_change(past))
        lookup = getattr(self.embed, "lookup", None)                 # a coded table (blockq.CodedEmbedding)
        x = lookup(ids) if lookup is not None else F.embedding(ids, self.embed.weight)   # [1, n, H]
        if self.embed_scale is not None:                             # Gemma: times sqrt(hidden), as HF
            x = x * self.embed_scale.to(x.dtype)
        ropes = {t: r.at(past, n) for t, r in self.ropes.items()}   # [n, 1, R] (broadcast over heads)
        masks: dict = {}
        if tree is not None:                                         # rows at past + depth
            ropes = {t: (c[tree.depth], s[tree.depth]) for t, (c, s) in ropes.items()}
        Hq, Hk, D = self.n_heads, self.n_kv, self.head_dim
        sq, sk = Hq * D, Hk * D
        own_attention = self.own_attention(cache, n) or (past == 0 and tree is None and self._start_empty(cache))
        if tree is not None and not own_attention:                   # torch's attention: the tree's masks
            masks = {w: tree.mask(past, w) for w in {L.window for L in self.layers}}
        act = self.act
        descs = self.c_layers_on() if own_attention else None
        if descs:                                                    # every layer in one C call
            x = self._c_forward(descs, x, cache, past, n, ropes[""], tree)
        normed = bool(descs) and self._final_c                       # (the final norm ran in it)
        for i, L in enumerate(self.layers if not descs else ()):
            h = L.qkv(L.ln1(x))                                      # [1, n, (Hq + 2 Hk) D]
            cos, sin = ropes[L.rope]
            if L.q_norm is None:
                qk = h[..., :sq + sk].view(1, n, Hq + Hk, D)
            else:                                                    # per-head norms before the rotation
                qk = torch.cat((L.q_norm(h[..., :sq].view(1, n, Hq, D)),
                                L.k_norm(h[..., sq:sq + sk].view(1, n, Hk, D))), dim=2)
            qk = self._rotate(qk, cos, sin)                          # q and k at once
            q = qk[:, :, :Hq].transpose(1, 2)                        # [1, Hq, n, D]
            k = qk[:, :, Hq:].transpose(1, 2)
            v = h[..., sq + sk:].view(1, n, Hk, D).transpose(1, 2)
            k, v = _append(cache, i, k, v)                           # [1, Hk, past + n, D]
            if own_attention and tree is not None:                   # [1, n, Hq D], each row as its decode step
                a = blockq.attend_tree(qk, (Hq + Hk) * D, k, v, n, Hq, Hk, D, self.scale, tree.path, tree.depth,
                                       L.window or 0, self.softcap)
            elif own_attention:                                      # [1, n, Hq D], rows independent
                a = blockq.attend(qk, (Hq + Hk) * D, k, v, n, Hq, Hk, D, self.scale, L.window or 0, self.softcap)
            else:
                a = self._attention(q, k, v, past, n, L.window, masks)
            a = L.o(a)
            if L.post_attn is not None:
                a = L.post_attn(a)
            x = x + a
            g, u = L.gate_up(L.ln2(x)).chunk(2, dim=-1)
            m = L.down(act(g) * u)
            if L.post_ff is not None:
                m = L.post_ff(m)
            x = x + m
        if keep:
            x = x[:, -keep:]
        h = x if normed else self.final_norm(x)
        if self.head_ids is not None:
            return self._limited_head(h)
        logits = self.head(h)                                        # [1, keep or n, V]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # ---- a draft's vocabulary
    def limit_head(self, ids: torch.Tensor | None) -> None:
        """Logits for these ids only, every other id's -inf (None: every id): a draft model that
        drafts from part of its vocabulary reads only those rows of its head."""
        self.head_ids = None if ids is None else ids.to(torch.long).contiguous()
        self._head_rows = None

    def _limited_head(self, h: torch.Tensor) -> torch.Tensor:
        """[..., V] logits of h [..., H]: the head's rows of ``head_ids`` (the same arithmetic as
        the whole head's rows: its codes' own rows, or its weight's), -inf elsewhere."""
        ids = self.head_ids
        if self._head_rows is None:
            op = self.head
            bias = None if op.bias is None else op.bias[ids].contiguous()
            if op.block is not None:
                rows = op.block.rows(ids)
                self._head_rows = lambda x: rows(x, bias)
            else:
                w = self.lm_head.weight.detach()[ids].contiguous()
                self._head_rows = lambda x: F.linear(x, w, bias)
        small = self._head_rows(h)
        if self.final_softcap:
            small = torch.tanh(small / self.final_softcap) * self.final_softcap
        out = small.new_full((*small.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        out[..., ids] = small
        return out


def _windows(model: nn.Module) -> list:
    """Each layer's attention window as HF's mask has it (None: full causal): Mistral and Phi-3
    slide every layer when the config has a window; Qwen2, Qwen3 and Gemma the layers whose type
    is sliding_attention; Llama none."""
    cfg, layers = model.config, model.model.layers
    w = getattr(cfg, "sliding_window", None)
    name = type(model).__name__
    if name in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return [int(w) if w else None] * len(layers)
    if name == "LlamaForCausalLM" or not w:
        return [None] * len(layers)
    types = getattr(cfg, "layer_types", None) or []
    return [int(w) if i < len(types) and types[i] == "sliding_attention" else None for i in range(len(layers))]


KV_MIN_CAPACITY = 256
KV_POOL_KEEP = 2          # free KV buffers kept for later caches (KvPool)
KV_POOL_BYTES = 1 << 30   # and their bytes at most


def kv_capacity(length: int) -> int:
    """A new KV buffer's positions for ``length`` held: at least twice that, a power of two
    (capacity doubling: a growing sequence copies its KV O(log n) times)."""
    return max(KV_MIN_CAPACITY, 1 << (2 * length - 1).bit_length())


class _Views:
    """The C forward's KV buffers of one cache: one allocation for all its layers, K and V
    [layers, 1, Hk, cap, D], and the views of them it last put in the layers (``ks``, ``vs``)."""

    __slots__ = ("K", "V", "cap", "ks", "vs")

    def __init__(self, K: torch.Tensor, V: torch.Tensor):
        self.K, self.V, self.cap = K, V, int(K.shape[-2])
        self.ks = self.vs = ()

    def crop(self, cache, n_remove: int) -> bool:
        """Drop the last ``n_remove`` positions of ``cache`` when every layer still holds the views
        these buffers' last C forward left: new views of the same buffers for all layers in two
        slices. That is what ``DynamicCache.crop`` makes (each layer's K and V sliced to the shorter
        length), without its 60 slices (~0.2 ms cold after a forward) and without the next step
        looking at every layer again (``buffers_hold`` fails after a crop: ~0.1 ms). False, and
        nothing done, in any other state (``decoding.rollback`` then crops)."""
        from transformers.cache_utils import DynamicLayer

        layers, ks, vs = cache.layers, self.ks, self.vs
        if n_remove <= 0 or len(ks) != len(layers) or not all(
                type(L) is DynamicLayer and L.keys is ks[i] and L.values is vs[i] for i, L in enumerate(layers)):
            return False
        n = int(ks[0].shape[-2]) - n_remove
        if n < 0:
            return False
        self.ks, self.vs = self.K[:, :, :, :n].unbind(0), self.V[:, :, :, :n].unbind(0)
        for L, k, v in zip(layers, self.ks, self.vs):
            L.keys, L.values = k, v
        return True


def buffers_hold(views: "_Views | None", layers, length: int) -> bool:
    """Can the C forward write up to ``length`` positions into the buffers it used last time,
    without looking at each layer again: every layer still holds the very views it left (nothing
    cropped or replaced them) and the buffers have room (each look costs ~2 us a layer, cold after
    a forward)."""
    if views is None or length > views.cap or len(views.ks) != len(layers):
        return False
    ks, vs = views.ks, views.vs
    return all(L.keys is ks[i] and L.values is vs[i] for i, L in enumerate(layers))


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (itself and its views; None: torch cannot say)."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1   # (less the wrapper asked)
    except (AttributeError, RuntimeError):
        return None


class KvPool:
    """The C forward's KV buffers of caches that are gone, kept for the next caches: a buffer's
    first touch costs page faults (on a VM, 1-140 ms for a request's 12-24 MB, against ~1 ms to
    fill warm pages: docs/fastpath.md, "The KV pool"), so a request reuses the last one's pages.

    A buffer is free when the cache it served is gone and no other tensor shares its storage (a
    view of it kept by anyone keeps it from reuse); at most ``keep`` free ones are kept."""

    def __init__(self, keep: int = KV_POOL_KEEP):
        self.keep = keep
        self.entries: list[tuple[_Views, weakref.ref]] = []
        self.lock = threading.Lock()          # (engines may run in several threads)

    @staticmethod
    def free(views: "_Views", owner: weakref.ref) -> bool:
        if owner() is not None:
            return False
        views.ks = views.vs = ()      # the gone cache's views: now only a holder elsewhere keeps one
        return _storage_refs(views.K) == 1 and _storage_refs(views.V) == 1

    def take(self, shape: tuple, dtype, device, cache) -> "_Views | None":
        """The smallest free buffer of ``shape`` but for at least its capacity, now ``cache``'s."""
        with self.lock:
            return self._take(shape, dtype, device, cache)

    def _take(self, shape, dtype, device, cache):
        best = None
        for i, (vw, owner) in enumerate(self.entries):
            K = vw.K
            if (K.dtype == dtype and K.device == device and K.shape[:3] == shape[:3]
                    and K.shape[4] == shape[4] and vw.cap >= shape[3] and self.free(vw, owner)
                    and (best is None or vw.cap < self.entries[best][0].cap)):
                best = i
        if best is None:
            return None
        vw = self.entries[best][0]
        self.entries[best] = (vw, weakref.ref(cache))
        return vw

    def add(self, views: "_Views", cache) -> None:
        """A new buffer serving ``cache``; free buffers beyond ``keep`` are let go (oldest first)."""
        with self.lock:
            self.entries.append((views, weakref.ref(cache)))
            self._trim()

    def _trim(self) -> None:
        """Keep the newest free buffers, at most ``keep`` of them and KV_POOL_BYTES in all."""
        kept, total, drop = 0, 0, set()
        for i in reversed(range(len(self.entries))):
            vw, owner = self.entries[i]
            if self.free(vw, owner):
                nbytes = 2 * vw.K.numel() * vw.K.element_size()
                if kept < self.keep and total + nbytes <= KV_POOL_BYTES:
                    kept, total = kept + 1, total + nbytes
                else:
                    drop.add(i)
        if drop:
            self.entries = [e for i, e in enumerate(self.entries) if i not in drop]


KV_POOL = KvPool()


def _reserve_layers(layers, n: int, old: "_Views | None", cache=None) -> "_Views":
    """Buffers for the C forward with room for n more positions after what the layers hold: the
    old ones when every layer's KV still starts them (a crop keeps them) and they have room, else
    a free pooled buffer or one new allocation for all layers (capacity doubling) holding each
    layer's positions. Each layer's ``_rakv_buf`` is its part (``_append``, the Python layers,
    writes into the same). One allocation lets a step make every layer's new views in two ops
    instead of two a layer."""
    n0 = int(layers[0].keys.shape[-2])
    if old is not None and n0 + n <= old.cap and len(old.K) == len(layers) and all(
            L.keys.shape[-2] == n0 and L.keys.data_ptr() == old.K[i].data_ptr()
            and L.values.data_ptr() == old.V[i].data_ptr() for i, L in enumerate(layers)):
        return old
    cap = kv_capacity(n0 + n)
    k0 = layers[0].keys
    shape = (len(layers), *k0.shape[:-2], cap, k0.shape[-1])
    views = KV_POOL.take(shape, k0.dtype, k0.device, cache) if cache is not None else None
    if views is None:
        views = _Views(k0.new_empty(shape), layers[0].values.new_empty(shape))
        if cache is not None:
            KV_POOL.add(views, cache)
    K, V = views.K, views.V
    for i, L in enumerate(layers):
        m = L.keys.shape[-2]
        K[i, ..., :m, :] = L.keys
        V[i, ..., :m, :] = L.values
        L._rakv_buf = (K[i], V[i])
    return views


def _append(cache, i: int, k: torch.Tensor, v: torch.Tensor):
    """``cache.update(k, v, i)`` without copying the whole layer every step: from the second forward
    on, a layer's KV lives in a buffer with room to grow (capacity doubling), the layer's ``keys`` /
    ``values`` are views of its first positions, and new positions are written in place. A crop
    (a view) keeps the buffer; anything else put in the layer (a fresh tensor) starts a new one.
    The first forward's KV is HF's own (a contiguous tensor of exactly the prompt), so the prefix
    cache stores it without a copy; a buffer view it would copy (``decoding.kv_of``)."""
    if i >= len(cache.layers) or not cache.layers[i].is_initialized or cache.layers[i].keys.numel() == 0:
        return cache.update(k, v, i)
    L = cache.layers[i]
    n0, n = L.keys.shape[-2], k.shape[-2]
    bk, bv = _reserve(L, n)
    bk[..., n0:n0 + n, :] = k
    bv[..., n0:n0 + n, :] = v
    L.keys, L.values = bk[..., :n0 + n, :], bv[..., :n0 + n, :]
    return L.keys, L.values


def _reserve(L, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's growing KV buffers (k, v [1, Hk, capacity, D], contiguous) with room for n more
    positions after what ``L`` holds; a new pair (holding L's positions) when L's KV is not a view
    of them or they are full."""
    n0 = L.keys.shape[-2]
    buf = getattr(L, "_rakv_buf", None)
    if buf is None or L.keys.data_ptr() != buf[0].data_ptr() or n0 + n > buf[0].shape[-2]:
        cap = kv_capacity(n0 + n)
        shape = (*L.keys.shape[:-2], cap, L.keys.shape[-1])
        bk, bv = L.keys.new_empty(shape), L.values.new_empty(shape)
        bk[..., :n0, :] = L.keys
        bv[..., :n0, :] = L.values
        L._rakv_buf = buf = (bk, bv)
    return buf


class LeanGPT2(LeanLlama):
    """The lean forward of a GPT-2 model: learned positions, LayerNorm with bias, the fused c_attn
    (q|k|v) and c_fc / c_proj through the fast path's kernels, the model's own activation."""

    def _c_layers(self):
        return False                   # LayerNorm, biases, GELU: the Python layers

    def __init__(self, model: nn.Module, layers: list | None = None):
        cfg = model.config
        self.model = model
        base = model.transformer
        self.embed, self.wpe = base.wte, base.wpe
        self.lm_head = model.lm_head
        self.n_heads = self.n_kv = int(cfg.n_head)
        self.head_dim = int(cfg.n_embd) // self.n_heads
        self.scale = self.head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        self.layers = layers if layers is not None else [self._layer(B) for B in base.h]
        self.head = _Op(self.lm_head)
        self.final_norm = (base.ln_f.weight, base.ln_f.bias, base.ln_f.eps)
        self._watch(model)

    @staticmethod
    def _layer(B: nn.Module) -> tuple:
        """(ln_1, c_attn, attn c_proj, ln_2, c_fc, activation, mlp c_proj) of one block."""
        ln1, ln2 = B.ln_1, B.ln_2
        return ((ln1.weight, ln1.bias, ln1.eps), _Op(B.attn.c_attn), _Op(B.attn.c_proj),
                (ln2.weight, ln2.bias, ln2.eps), _Op(B.mlp.c_fc), B.mlp.act, _Op(B.mlp.c_proj))

    def truncated(self, model: nn.Module) -> "LeanGPT2":
        return LeanGPT2(model, self.layers[: len(model.transformer.h)])

    @staticmethod
    def _ln(x: torch.Tensor, norm: tuple) -> torch.Tensor:
        w, b, eps = norm
        return F.layer_norm(x, w.shape, w, b, eps)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, keep: int = 0, tree: TreeLayout | None = None) -> torch.Tensor:
        """ids [1, n] after what ``cache`` holds; returns logits [1, keep or n, V]. ``tree``: the n
        rows form a token tree (each row at position past + depth, seeing the cache and its ancestry)."""
        n = ids.shape[1]
        past = cache.get_seq_length()
        self._sync(weights_may_change(past))
        pos = torch.arange(past, past + n) if tree is None else past + tree.depth
        x = F.embedding(ids, self.embed.weight) + F.embedding(pos, self.wpe.weight)    # [1, n, H]
        mask = self._mask(past, n) if tree is None else tree.mask(past)      # (own attention: unused)
        Hh, D = self.n_heads, self.head_dim
        E = Hh * D
        own_attention = self.own_attention(cache, n)
        for i, (ln1, c_attn, proj, ln2, fc, act, proj2) in enumerate(self.layers):
            h = c_attn(self._ln(x, ln1))                             # [1, n, 3E]
            q, k, v = (t.view(1, n, Hh, D).transpose(1, 2) for t in h.split(E, dim=-1))   # [1, H, n, D]
            k, v = _append(cache, i, k, v)                           # [1, H, past + n, D]
            if own_attention and tree is not None:                   # [1, n, E], each row as its decode step
                a = blockq.attend_tree(h, 3 * E, k, v, n, Hh, Hh, D, self.scale, tree.path, tree.depth)
            elif own_attention:                                      # [1, n, E], rows independent
                a = blockq.attend(h, 3 * E, k, v, n, Hh, Hh, D, self.scale)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                   scale=self.scale).transpose(1, 2).reshape(1, n, E)
            x = x + proj(a)
            x = x + proj2(act(fc(self._ln(x, ln2))))
        if keep:
            x = x[:, -keep:]
        return self.head(self._ln(x, self.final_norm))               # [1, keep or n, V]


def lean_of(model: nn.Module, layers: list | None = None) -> LeanLlama:
    return (LeanGPT2 if kind(model) == "gpt2" else LeanLlama)(model, layers)


def attach(model: nn.Module, on: bool = True) -> str:
    """Give ``model`` its lean forward (``model._rakv_lean``) when supported and ``on``; returns
    why not ("" when attached)."""
    model._rakv_lean = None
    model._rakv_backend = None          # chosen again (rakv.backend) for the forward attached now
    if not on:
        return "switched off"
    why = supported(model)
    if why is None:
        model._rakv_lean = lean_of(model)
        return ""
    return why
