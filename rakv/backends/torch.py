"""The torch backend: HF's own forward on any device (CUDA, MPS, CPU), over whatever linears the
model has (torch's, or the fast path's packed / block-coded ones); no tree forward."""

from __future__ import annotations

import torch

from ..util.device import model_device
from .base import Backend, _cache_arg, _ids


class TorchBackend(Backend):
    """HF's forward (any device)."""

    name = "torch"

    @torch.inference_mode()
    def forward(self, tokens, cache, keep: int = 0, tree=None) -> torch.Tensor:
        if tree is not None:
            raise ValueError("a token tree needs the lean forward")
        m = self.model
        kw = {_cache_arg(type(m)): cache}
        out = m(input_ids=_ids(tokens, model_device(m)), use_cache=True, logits_to_keep=keep, **kw)
        return out.logits[0].float()
