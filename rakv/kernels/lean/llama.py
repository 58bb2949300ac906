"""The lean forward of the Llama lineage (``LeanLlama``)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from .. import blockq
from .kv import _append, c_buffers, c_written
from .ops import (_VERSION, FUSED_GATE_UP, FUSED_QKV, PART_FIELDS, _Coded, _coded_parts, _Fused, _Norm, _Op,
                  _Rope)
from .support import _act_fn, _head_dim, _rope_sources, _windows, kind
from .treelayout import TreeLayout


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
    and reading every parameter's change counter there, cold after the previous forward, is a
    measurable part of a step (docs/fastpath.md)."""
    return past == 0


class LeanLlama:
    """The lean forward of one decoder model of the Llama lineage (see the module docstring):
    Llama, Mistral and Qwen2 as they are; Qwen3 with q / k norms; Gemma 2 and 3 with their scaled
    embedding, (1 + w) norms around attention and MLP, GeGLU, sliding-window layers, q / k norms
    (3), attention (2) and final logit soft-capping and query_pre_attn_scalar; Phi-3 with its fused
    qkv_proj / gate_up_proj and partial rotary. Everything read from the HF modules themselves."""

    def __init__(self, model: nn.Module, layers: list | None = None):
        cfg = model.config
        self._model = weakref.ref(model)    # (weakly: the registry that finds this forward is keyed by the model)
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

    @property
    def model(self) -> nn.Module | None:
        """The model this forward runs (None once it is gone)."""
        return self._model()

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
        if not hasattr(self, "use_c_layers"):       # the switches' defaults, until the backend configures it
            self.configure()

    def configure(self, c_layers: bool = True, attend: bool = True) -> None:
        """The decisions the backend made at load (``rakv.backends.select_backend``): ``c_layers``,
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
        views = c_buffers(cache, layers, past + n, n)
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
        c_written(cache, layers, views, past + n)
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
