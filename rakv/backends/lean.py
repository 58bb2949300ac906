"""The lean backends: the lean forward (``rakv.kernels.lean``) with the switches' decisions handed to it.

  * ``LeanFp32Backend`` ("lean-fp32"): fp32 arithmetic: exact block codes rebuilt to fp32, packed
    fp32 linears (or the int8 draft's dynamic int8 linears), a decode / verify step's layers in one
    C call where the model allows.
  * ``LeanQ8Backend`` ("lean-q8"): q8 numerics: every linear from its codes with 8-bit activation
    blocks and integer dot products, every forward each row alone.
"""

from __future__ import annotations

import torch

from ..util.device import model_device
from .base import Backend, _ids
from .switches import Switches


class LeanBackend(Backend):
    """The lean forward, configured once with the switches this backend was chosen with."""

    name = "lean"
    tree_ok = True

    def __init__(self, model, lean, numerics: str = "fp32", switches: Switches | None = None, lm=None,
                 configure: bool = True):
        super().__init__(model, numerics, switches, lm)
        self.lean = lean
        if configure:
            lean.configure(c_layers=self.switches.c_layers, attend=self.switches.blockq)

    @torch.inference_mode()
    def forward(self, tokens, cache, keep: int = 0, tree=None) -> torch.Tensor:
        if tree is not None:
            return self.lean.forward(_ids(tokens), cache, keep, tree)[0].float()
        return self.lean.forward(_ids(tokens), cache, keep)[0].float()

    @torch.inference_mode()
    def tree(self, tokens, parents, cache) -> torch.Tensor:
        return self.lean.forward(_ids(tokens), cache, 0, self.lean.tree_layout(parents))[0].float()

    def uses_kernel(self) -> bool:
        from ..kernels import blockq

        return (self.lean.use_attend and self.lean.dtype == torch.float32
                and model_device(self.model).type == "cpu" and blockq.library() is not None)

    def fingerprint(self) -> dict:
        fp = super().fingerprint()
        fp["lean"] = self.lean.family if hasattr(self.lean, "family") else "gpt2"
        fp["c_layers"] = bool(self.lean.c_layers_on())
        return fp


class LeanFp32Backend(LeanBackend):
    name = "lean-fp32"


class LeanQ8Backend(LeanBackend):
    name = "lean-q8"
