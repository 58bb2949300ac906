"""The backend: what runs a model's forward, chosen once at load behind one small interface.

``Backend`` is everything the decoding primitives (and through them the engine and the controller)
ask of a model: ``prefill`` (a prompt's last logits [V]), ``step`` (one token: [V]), ``verify``
(k + 1 rows: [k + 1, V]), ``tree`` (a token tree's rows [n, V], or None where the backend has no
tree forward), ``rollback`` (drop a cache's last n positions) and ``fingerprint`` (what decides its
costs, for the cost profile). Three implementations:

  * ``TorchBackend`` ("torch"): HF's own forward on any device (CUDA, MPS, CPU), over whatever
    linears the model has (torch's, or the fast path's packed / block-coded ones); no tree forward.
  * ``LeanFp32Backend`` ("lean-fp32"): the lean forward (``rakv.kernels.lean``) with fp32
    arithmetic: exact block codes rebuilt to fp32, packed fp32 linears (or the int8 draft's
    dynamic int8 linears), a decode / verify step's layers in one C call where the model allows.
  * ``LeanQ8Backend`` ("lean-q8"): the lean forward under q8 numerics: every linear from its codes
    with 8-bit activation blocks and integer dot products, every forward each row alone.

``select_backend(lm)`` chooses at load (``models.set_fast`` calls it last, so every load and every
numerics switch chooses again) and reads the environment switches there, once (``read_switches``):
``RAKV_LEAN``, ``RAKV_C_LAYERS``, ``RAKV_BLOCKQ``, ``RAKV_TILES``, ``RAKV_ONE_ROW``. The decisions are
handed down (the lean forward's ``use_c_layers`` / ``use_attend``, a q8 block's ``lanes``), so no
kernel reads the environment per forward, and changing a switch after load changes nothing until
the model is loaded or switched again. The choice is stored as ``lm.backend`` and on the module as
``model._rakv_backend`` (what ``rakv.decoding`` dispatches on). A module no loader chose for (a bare
HF model in tests, or one given a lean forward by hand) gets one at its first forward: the lean
backend when a lean forward is attached, else the torch path.

Layering: this module sits above ``rakv.kernels.blockq`` and below ``rakv.models`` /
``rakv.decoding``: it imports neither (a ``LoadedModel`` is read by duck typing), nor
``kernels.fastpath`` (which times decode steps through ``rakv.decoding``; a fast-path linear is
known by its ``one_row_plain``) nor ``kernels.lean`` (the lean forward is an object it is given).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from .device import model_device
from .paths import env_on


# ----------------------------------------------------------------------------- the switches, read once
@dataclass(frozen=True)
class Switches:
    """The environment's forward switches as read at one load (``read_switches``)."""

    lean: bool = True            # RAKV_LEAN: the lean forward where the architecture allows (else HF's)
    c_layers: bool = True        # RAKV_C_LAYERS: a step's layers in one C call where the model allows
    blockq: bool = True          # RAKV_BLOCKQ: the block kernel (codes, its attention)
    tiles: bool = True           # RAKV_TILES: q8 codes in the tiled form (0: the lane form, for comparisons)
    one_row: str = "auto"        # RAKV_ONE_ROW: plain | packed forces the fp32 one-row kernel

    def as_dict(self) -> dict:
        return {"lean": self.lean, "c_layers": self.c_layers, "blockq": self.blockq, "tiles": self.tiles,
                "one_row": self.one_row}


def read_switches() -> Switches:
    """The forward switches from the environment, now (called once per load)."""
    import os

    one_row = os.environ.get("RAKV_ONE_ROW", "auto").strip().lower()
    return Switches(lean=env_on("RAKV_LEAN"), c_layers=env_on("RAKV_C_LAYERS"), blockq=env_on("RAKV_BLOCKQ"),
                    tiles=os.environ.get("RAKV_TILES", "1") != "0",
                    one_row=one_row if one_row in ("plain", "packed") else "auto")


# ----------------------------------------------------------------------------- helpers
@lru_cache(maxsize=None)
def _cache_arg(cls) -> str:
    """transformers 5.x names the cache argument ``cache``; older releases ``past_key_values``."""
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _ids(tokens, device=None) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.view(1, -1).to(device) if device is not None else tokens.view(1, -1)
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


@lru_cache(maxsize=1)
def _isa() -> tuple:
    from .device import isa_flags

    return tuple(isa_flags())


def crop(cache, n_remove: int) -> None:
    """Drop the last ``n_remove`` positions of ``cache`` (transformers 5.x: a negative crop)."""
    if n_remove > 0:
        cache.crop(-n_remove)


def crop_views(cache, n_remove: int) -> None:
    """``crop``, by the views the C layers left where they wrote ``cache`` last (``lean._Views``:
    made for all layers at once from its buffers)."""
    views = getattr(cache, "_rakv_views", None)
    if n_remove > 0 and not (views is not None and views.crop(cache, n_remove)):
        cache.crop(-n_remove)


# ----------------------------------------------------------------------------- the interface
class Backend:
    """What runs one model's forward (see the module docstring). Logits are float32, batch 1
    squeezed: ``forward`` [keep or n, V]. An implementation gives ``forward``, ``tree``,
    ``rollback`` and ``fingerprint``; ``prefill``, ``step`` and ``verify`` are fixed calls of
    ``forward`` (``rakv.decoding`` makes the same calls through its ``forward``, the one funnel)."""

    name = "backend"
    tree_ok = False                    # has a tree forward (``tree`` returns logits, not None)

    def __init__(self, model: torch.nn.Module, numerics: str = "fp32", switches: Switches | None = None,
                 lm=None):
        self.model = model
        self.numerics = numerics
        self.switches = switches if switches is not None else Switches()
        self._blockq = dict(getattr(lm, "blockq", None) or {})
        self._one_row = dict(getattr(lm, "one_row", None) or {})

    def forward(self, tokens, cache, keep: int = 0, tree=None) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, ids, cache) -> torch.Tensor:
        """A prompt (or a prompt's suffix) after what ``cache`` holds: the last position's logits [V]."""
        return self.forward(ids, cache, 1)[-1]

    def step(self, token: int, cache) -> torch.Tensor:
        """One decode step: feed ``token``, the next token's logits [V]."""
        return self.forward([token], cache, 1)[-1]

    def verify(self, tokens, cache) -> torch.Tensor:
        """[pending, d_1..d_k] in one forward: logits [k + 1, V]."""
        return self.forward(tokens, cache, 0)

    def tree(self, tokens, parents, cache) -> torch.Tensor | None:
        """A token tree (row i is tokens[i] after row parents[i], -1: after the cache): [n, V], or
        None when this backend verifies chains only."""
        return None

    def rollback(self, cache, n_remove: int) -> None:
        crop(cache, n_remove)

    def fingerprint(self) -> dict:
        """What decides this backend's costs (a profile measured under another is not reused)."""
        m = self.model
        dev = model_device(m)
        fast = next((f for f in m.modules() if hasattr(f, "one_row_plain")), None)   # a fast-path linear
        fp = {"kind": self.name, "numerics": self.numerics, "device": str(dev),
              "threads": torch.get_num_threads(), "fast": fast is not None, "isa": list(_isa())}
        if dev.type == "cuda" and torch.cuda.is_available():
            fp["gpu"] = torch.cuda.get_device_name(dev)
        if fast is not None:                              # (all of a model's: ``fastpath.set_one_row``)
            fp["one_row"] = "plain" if fast.one_row_plain else "packed"
        if self._blockq.get("layers") or self.uses_kernel():
            from .kernels import blockq

            fp["block_layers"] = int(self._blockq.get("layers") or 0)
            fp["kernel"] = blockq.build_id()
            if self.numerics == "q8":
                fp["tiles"] = "tiled" if self.switches.tiles else "lanes"
        return fp

    def uses_kernel(self) -> bool:
        return False

    def describe(self) -> dict:
        """For run headers and ``--json``: the name and the switches it was chosen with."""
        return {"backend": self.name, "switches": self.switches.as_dict()}

    def __deepcopy__(self, memo):
        return None                     # a deep copy of the model chooses its own

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.numerics}>"


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


class LeanBackend(Backend):
    """The lean forward (``rakv.kernels.lean``), with the switches' decisions handed to it."""

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

    def rollback(self, cache, n_remove: int) -> None:
        crop_views(cache, n_remove)

    def uses_kernel(self) -> bool:
        from .kernels import blockq

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


BACKENDS = ("torch", "lean-fp32", "lean-q8")


# ----------------------------------------------------------------------------- choosing
def select_backend(lm, switches: Switches | None = None) -> Backend:
    """Choose ``lm``'s backend (a ``LoadedModel``, read by duck typing) once, now: the lean forward
    where one is attached (q8 or fp32 by its numerics), else the torch path. ``switches``: the
    environment as this load read it (None: read it now). Stored as ``lm.backend`` and
    ``lm.model._rakv_backend``; returns it."""
    sw = switches if switches is not None else read_switches()
    model = lm.model
    lean = getattr(model, "_rakv_lean", None) if getattr(lm, "lean", "") else None
    numerics = getattr(lm, "numerics", "fp32") or "fp32"
    if lean is None:
        be: Backend = TorchBackend(model, numerics, sw, lm)
    else:
        be = (LeanQ8Backend if numerics == "q8" else LeanFp32Backend)(model, lean, numerics, sw, lm)
    lm.backend = be
    model._rakv_backend = be
    return be


def backend_of(model) -> Backend:
    """The backend chosen for ``model`` (a module); one chosen now for a module no loader chose for
    (the lean backend where a lean forward is attached, with the switches it was made with; else
    the torch path), kept on the module."""
    be = getattr(model, "_rakv_backend", None)
    if be is None:
        lean = getattr(model, "_rakv_lean", None)
        if lean is None:
            be = TorchBackend(model)
        else:
            q8 = lean.rows_alone()
            be = (LeanQ8Backend if q8 else LeanFp32Backend)(model, lean, "q8" if q8 else "fp32",
                                                            Switches(c_layers=lean.use_c_layers,
                                                                     blockq=lean.use_attend),
                                                            configure=False)
        model._rakv_backend = be
    return be
