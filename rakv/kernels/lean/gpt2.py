"""The lean forward of GPT-2 (``LeanGPT2``)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from .. import blockq
from .kv import _append
from .llama import LeanLlama, weights_may_change
from .ops import _Op
from .treelayout import TreeLayout


class LeanGPT2(LeanLlama):
    """The lean forward of a GPT-2 model: learned positions, LayerNorm with bias, the fused c_attn
    (q|k|v) and c_fc / c_proj through the fast path's kernels, the model's own activation."""

    def _c_layers(self):
        return False                   # LayerNorm, biases, GELU: the Python layers

    def __init__(self, model: nn.Module, layers: list | None = None):
        cfg = model.config
        self._model = weakref.ref(model)
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
