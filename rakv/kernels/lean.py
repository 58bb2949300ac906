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

Shapes: x [1, n, H]; q [1, Hq, n, D]; k, v [1, Hkv, n, D] (the cache: [1, Hkv, past + n, D]).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from . import blockq

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GPT2_ARCHS = ("GPT2LMHeadModel",)
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "gelu_fast", "quick_gelu")


def env_enabled() -> bool:
    return os.environ.get("RAKV_LEAN", "1").strip().lower() not in ("0", "false", "off", "no")


def kind(model: nn.Module) -> str:
    """"llama" or "gpt2": which lean forward fits ``model``'s architecture ("" for none)."""
    name = type(model).__name__
    return "llama" if name in ARCHS else "gpt2" if name in GPT2_ARCHS else ""


def supported(model: nn.Module) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can)."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    if cfg is None or not kind(model):
        return f"{name} (lean forward: {', '.join(ARCHS + GPT2_ARCHS)})"
    p = next(model.parameters())
    if p.device.type != "cpu":
        return f"device {p.device.type}"
    if kind(model) == "gpt2":
        return _gpt2_unsupported(cfg)
    for rope in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type") or "default") != "default":
            return f"rope type {rope.get('rope_type') or rope.get('type')}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
            and name != "LlamaForCausalLM":
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp"
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
            block = blockq.concat([m.block for m in self.mods]) if fast else None
            if block is not None:              # stacked codes: no fp32 copy of the stacked weights
                self._modules.pop("lin", None)
                self.lin, self.version = _Coded(self.mods, block, b), self._versions()
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


class _Coded:
    """Fused layers whose parts all run from block codes: up to ``BLOCK_ROWS`` rows the stacked
    codes (one kernel call); past that (a long prefill) each part's own packed kernel, the outputs
    side by side. No fp32 copy of the stacked weights is made (it would only serve long prefills)."""

    def __init__(self, mods: list[nn.Module], block, bias: torch.Tensor | None):
        self.mods, self.block, self.bias = mods, block, bias

    def wide(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.mods], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= BLOCK_ROWS:
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
        if self.block is not None and x.shape[-2] <= BLOCK_ROWS:
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


def fuse_for_quantization(model: nn.Module) -> None:
    """Give every decoder layer fused q|k|v and gate|up ``nn.Linear`` submodules (copies of the
    weights), so that ``quantize_dynamic`` quantizes them too and the lean forward of the int8
    copy runs one int8 kernel where it would run three (per-channel scales are per output row,
    so the fused layers quantize exactly as the separate ones). HF's forward does not use them."""
    if kind(model) != "llama":        # GPT-2's c_attn is q|k|v already, and its MLP has no gate
        return
    for L in model.model.layers:
        a, m = L.self_attn, L.mlp
        for parent, name, mods in ((a, FUSED_QKV, [a.q_proj, a.k_proj, a.v_proj]),
                                   (m, FUSED_GATE_UP, [m.gate_proj, m.up_proj])):
            w = torch.cat([x.weight.detach() for x in mods], 0)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=any(x.bias is not None for x in mods),
                            dtype=w.dtype, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w)
                if lin.bias is not None:
                    lin.bias.copy_(torch.cat([x.bias.detach() if x.bias is not None else w.new_zeros(x.weight.shape[0])
                                              for x in mods]))
            setattr(parent, name, lin)


class LeanLlama:
    """The lean forward of one Llama-family model (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: list | None = None):
        cfg = model.config
        self.model = model
        base = model.model
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = self.head_dim ** -0.5
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        d = self.head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self._cos = self._sin = torch.empty(0, d)
        self.layers = layers if layers is not None else [self._layer(L) for L in base.layers]
        self.head = _Op(self.lm_head)
        self.final_norm = (self.norm.weight, self.norm.variance_epsilon)
        self._watch(model)

    def _watch(self, model: nn.Module) -> None:
        """The linears' ``_Op``s and what _sync watches: every weight and bias they read, and the
        one-row kernel choice (called last by a constructor, once layers and head are set)."""
        self.ops = [op for L in self.layers for op in L if isinstance(op, _Op)] + [self.head]
        self.params = [p for p in model.parameters() if p.dim() >= 1]
        self.probe = next((m for m in model.modules() if hasattr(m, "one_row_plain")), None)
        self.state = self._state()
        self.dtype = self.embed.weight.dtype

    @staticmethod
    def _layer(L: nn.Module) -> tuple:
        """(norm, q|k|v, o, norm, gate|up, down) of one decoder layer, the linears as ``_Op``s."""
        a, m = L.self_attn, L.mlp
        qkv = getattr(a, FUSED_QKV, None) or _Fused([a.q_proj, a.k_proj, a.v_proj])
        gate_up = getattr(m, FUSED_GATE_UP, None) or _Fused([m.gate_proj, m.up_proj])
        n1, n2 = L.input_layernorm, L.post_attention_layernorm
        return ((n1.weight, n1.variance_epsilon), _Op(qkv), _Op(a.o_proj),
                (n2.weight, n2.variance_epsilon), _Op(gate_up), _Op(m.down_proj))

    def _state(self) -> tuple:
        return (sum(p._version for p in self.params), getattr(self.probe, "one_row_plain", None))

    def _sync(self) -> None:
        """Re-read the linears when a weight changed in place or the one-row kernel was switched."""
        state = self._state()
        if state != self.state:
            for op in self.ops:
                op.refresh()
            self.state = state

    def truncated(self, model: nn.Module) -> "LeanLlama":
        """The lean forward of ``model``, a layer-truncated copy sharing this model's first layers
        (the layers:L draft): its fused layers are this one's, not new copies."""
        return LeanLlama(model, self.layers[: len(model.model.layers)])

    def __deepcopy__(self, memo):
        # a deep copy of the model (the int8 draft's) gets no lean forward: attach() builds its own
        return None

    # ---- pieces
    def _rope(self, start: int, n: int):
        """cos, sin [n, 1, D] for positions start..start+n-1 (the table grows in doublings)."""
        end, d = start + n, self.head_dim
        if end > self._cos.shape[0]:
            size = max(256, 1 << (end - 1).bit_length())
            pos = torch.arange(size, dtype=torch.float)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : d // 2] *= -1                  # rotate_half's sign (see _rotate)
            self._cos, self._sin = emb.cos().to(self.dtype), sin.to(self.dtype)
        return self._cos[start:end, None], self._sin[start:end, None]

    @staticmethod
    def _rms(x: torch.Tensor, norm: tuple) -> torch.Tensor:
        """HF's RMSNorm (norm = its weight and eps): x / rms(x) in float32, times the weight
        (float32: torch's fused op)."""
        w, eps = norm
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's x cos + rotate_half(x) sin, with rotate_half(x) = roll(x, D/2) times the sign that
        ``_rope`` folded into sin (-sin for the first half)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)

    @staticmethod
    def _mask(past: int, n: int) -> torch.Tensor | None:
        """[n, past + n] bool: query i sees keys 0..past+i (None for one token: it sees all)."""
        if n == 1:
            return None
        return torch.ones(n, past + n, dtype=torch.bool).tril(past)

    def own_attention(self, cache, n: int) -> bool:
        """Whether this forward's attention runs ``blockq.attend`` (a decode or verify step on a
        cache it can read: one whose first layer is the lean forward's buffer or a contiguous
        prefill, as every layer's is) instead of torch's SDPA: each row then comes out the same
        whether it is computed alone or among the k + 1 rows of a verify."""
        if n > blockq.ATTEND_ROWS or self.dtype != torch.float32:     # (the lean forward is CPU-only)
            return False
        if not cache.layers or not cache.layers[0].is_initialized or cache.layers[0].keys.numel() == 0:
            return False                                             # a first forward: SDPA (a prefill)
        L = cache.layers[0]
        return blockq.attend_ok(L.keys, L.values, n, self.n_heads, self.n_kv, self.head_dim)

    # ---- the forward
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, keep: int = 0) -> torch.Tensor:
        """ids [1, n] after what ``cache`` holds; returns logits [1, keep or n, V]."""
        self._sync()
        n = ids.shape[1]
        past = cache.get_seq_length()
        x = F.embedding(ids, self.embed.weight)                      # [1, n, H]
        cos, sin = self._rope(past, n)                               # [n, 1, D] (broadcast over heads)
        mask = self._mask(past, n)
        Hq, Hk, D = self.n_heads, self.n_kv, self.head_dim
        sq, sk = Hq * D, Hk * D
        own_attention = self.own_attention(cache, n)
        for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(self.layers):
            h = qkv(self._rms(x, ln1))                               # [1, n, (Hq + 2 Hk) D]
            qk = self._rotate(h[..., :sq + sk].view(1, n, Hq + Hk, D), cos, sin)   # q and k at once
            q = qk[:, :, :Hq].transpose(1, 2)                        # [1, Hq, n, D]
            k = qk[:, :, Hq:].transpose(1, 2)
            v = h[..., sq + sk:].view(1, n, Hk, D).transpose(1, 2)
            k, v = _append(cache, i, k, v)                           # [1, Hk, past + n, D]
            if own_attention:                                        # [1, n, Hq D], rows independent
                a = blockq.attend(qk, (Hq + Hk) * D, k, v, n, Hq, Hk, D, self.scale)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=Hq != Hk).transpose(1, 2).reshape(1, n, sq)
            x = x + o(a)
            g, u = gate_up(self._rms(x, ln2)).chunk(2, dim=-1)
            x = x + down(F.silu(g) * u)
        if keep:
            x = x[:, -keep:]
        return self.head(self._rms(x, self.final_norm))              # [1, keep or n, V]


KV_MIN_CAPACITY = 256


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
    buf = getattr(L, "_rakv_buf", None)
    if buf is None or L.keys.data_ptr() != buf[0].data_ptr() or n0 + n > buf[0].shape[-2]:
        cap = max(KV_MIN_CAPACITY, 1 << (2 * (n0 + n) - 1).bit_length())
        shape = (*L.keys.shape[:-2], cap, L.keys.shape[-1])
        bk, bv = L.keys.new_empty(shape), L.values.new_empty(shape)
        bk[..., :n0, :] = L.keys
        bv[..., :n0, :] = L.values
        L._rakv_buf = buf = (bk, bv)
    bk, bv = buf
    bk[..., n0:n0 + n, :] = k
    bv[..., n0:n0 + n, :] = v
    L.keys, L.values = bk[..., :n0 + n, :], bv[..., :n0 + n, :]
    return L.keys, L.values


class LeanGPT2(LeanLlama):
    """The lean forward of a GPT-2 model: learned positions, LayerNorm with bias, the fused c_attn
    (q|k|v) and c_fc / c_proj through the fast path's kernels, the model's own activation."""

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
    def forward(self, ids: torch.Tensor, cache, keep: int = 0) -> torch.Tensor:
        """ids [1, n] after what ``cache`` holds; returns logits [1, keep or n, V]."""
        self._sync()
        n = ids.shape[1]
        past = cache.get_seq_length()
        pos = torch.arange(past, past + n)
        x = F.embedding(ids, self.embed.weight) + F.embedding(pos, self.wpe.weight)    # [1, n, H]
        mask = self._mask(past, n)
        Hh, D = self.n_heads, self.head_dim
        E = Hh * D
        own_attention = self.own_attention(cache, n)
        for i, (ln1, c_attn, proj, ln2, fc, act, proj2) in enumerate(self.layers):
            h = c_attn(self._ln(x, ln1))                             # [1, n, 3E]
            q, k, v = (t.view(1, n, Hh, D).transpose(1, 2) for t in h.split(E, dim=-1))   # [1, H, n, D]
            k, v = _append(cache, i, k, v)                           # [1, H, past + n, D]
            if own_attention:                                        # [1, n, E], rows independent
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
    if not on:
        return "switched off"
    why = supported(model)
    if why is None:
        model._rakv_lean = lean_of(model)
        return ""
    return why
