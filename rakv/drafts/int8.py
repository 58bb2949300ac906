"""``--draft int8``: a per-channel dynamic int8 copy of the target (weights int8, activations
quantized on the fly), made lazily where a run may never draft, and cached in the cache dir
(``models/int8/``) so the next run loads it instead of quantizing again."""

from __future__ import annotations

import hashlib
import time
import weakref
from pathlib import Path

import torch

from ..load.loaded import LoadedModel, ModelError, _dtype_of, weights_hash
from ..load.numerics import _switches_of, attach_lean
from ..load.slim import _set_weight, placeholder
from ..util.paths import log
from .model import ModelDraft

# the cache file an int8 module was loaded from (the lazy draft's log line says so); nothing is
# pinned on the module itself
_FROM_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def make(target: LoadedModel, config, arg: str = "") -> ModelDraft:
    """The registry's ``int8``: the int8 copy of ``target``, made now."""
    return ModelDraft(int8_copy(target))


def int8_copy(target: LoadedModel, lazy: bool = False) -> LoadedModel:
    """A per-channel dynamic int8 copy of the target (weights int8, activations quantized on the fly).

    ``lazy``: quantize only when the copy's model is first used (a run whose policy never drafts
    does not pay for it; its name, key, tokenizer and KV size are known without it)."""
    dev = next(target.model.parameters()).device
    if dev.type != "cpu":
        raise ModelError(f"--draft int8 runs on CPU only (dynamic int8 quantization), the target is on "
                         f"{dev.type}: use a draft model, 'ngram' or 'none'")
    kw = dict(name=f"{target.name}-int8", tokenizer=target.tokenizer,
              key=target.key.rsplit(":", 1)[0] + ":int8-dynamic",
              max_positions=target.max_positions, eos_ids=target.eos_ids)
    if lazy:
        return _LazyInt8(target, **kw)
    lm = LoadedModel(model=_quantized(target), **kw)
    attach_lean(lm, bool(target.lean), switches=_switches_of(target))
    return lm


INT8_CACHE_VERSION = 1


def int8_cache_path(target: LoadedModel) -> Path | None:
    """Where the int8 draft of ``target`` is cached: ``models/int8/<digest>.pt`` in the cache dir,
    the digest of the target's weights (its weights_hash and key), the torch version and the layout
    (fused for the lean forward). None where there is no cache dir to write."""
    try:
        from ..util.paths import cache_dir

        root = cache_dir()
    except OSError:
        return None
    h = hashlib.blake2b(digest_size=10)
    for part in (weights_hash(target.model), target.key, torch.__version__, f"lean={bool(target.lean)}",
                 f"v{INT8_CACHE_VERSION}"):
        h.update(part.encode() + b"|")
    return root / "models" / "int8" / f"{h.hexdigest()}.pt"


def _float_copy(target: LoadedModel) -> torch.nn.Module:
    """A float32 copy of the target in the int8 draft's layout (Conv1D as Linear; fused q|k|v and
    gate|up for the lean forward), not yet quantized."""
    import copy

    from ..kernels import fastpath

    unmade = {name: mod.block for name, mod in target.model.named_modules()      # a slim target's
              if isinstance(getattr(mod, "weight", None), torch.Tensor) and placeholder(mod.weight)
              and not hasattr(mod, "lookup")}
    with fastpath.plain_copies():
        m = copy.deepcopy(target.model, _coded_tables(target)).float()
    for name, b in unmade.items():                  # ... weights made in the copy from their codes
        _set_weight(m.get_submodule(name), b, True)
    _conv1d_to_linear(m)
    if target.lean:                       # the lean forward runs fused q|k|v and gate|up (int8 too)
        from ..kernels import lean

        lean.fuse_for_quantization(m)
    return m


def _coded_tables(target: LoadedModel) -> dict:
    """A deepcopy memo that shares a slim target's unmade token tables (``blockq.CodedEmbedding``,
    rows looked up from the codes): a copy would make a table of zeros."""
    return {id(m.weight): m.weight for m in target.model.modules()
            if hasattr(m, "lookup") and placeholder(m.weight)}


def _quantized(target: LoadedModel) -> torch.nn.Module:
    """The int8 draft's module: loaded from the cache (``int8_cache_path``) when a copy is there,
    else a float32 copy of the target quantized in place and cached (written atomically) for the
    next run."""
    path = int8_cache_path(target)
    if path is not None and path.exists():
        try:
            return _load_int8(target, path)
        except Exception as e:  # noqa: BLE001 - a bad cache file is made again, never a failed run
            log(f"the cached int8 draft {path} is unusable ({type(e).__name__}: {e}); quantizing again")
    q = _quantize(target)
    if path is not None:
        try:
            _save_int8(q, path)
        except (OSError, RuntimeError) as e:
            log(f"cannot cache the int8 draft at {path} ({e}); it is made again next run")
    return q


def _save_int8(q: torch.nn.Module, path: Path) -> None:
    """The quantized state dict, atomically (a temp file in the same dir, then os.replace)."""
    from ..util.paths import replace_atomic

    replace_atomic(path, lambda tmp: torch.save(q.state_dict(), tmp))


def _load_int8(target: LoadedModel, path: Path) -> torch.nn.Module:
    """The int8 draft from its cached state dict, without a float copy of the weights: the target
    copied with every linear's weight and bias on the meta device (no memory, no time), each linear
    then an empty dynamic int8 Linear (what quantize_dynamic makes), and the saved tensors loaded
    strictly and assigned (``weights_only``: tensors, no code)."""
    import copy
    import warnings

    import torch.ao.nn.quantized.dynamic as nnqd

    from ..kernels import fastpath

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = torch.load(path, map_location="cpu", weights_only=True)
        with fastpath.plain_copies():
            memo: dict = _coded_tables(target)
            for mod in target.model.modules():
                if type(mod).__name__ in ("Linear", "FastLinear", "Conv1D"):
                    for p in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
                        if isinstance(p, torch.Tensor) and id(p) not in memo:
                            memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            m = copy.deepcopy(target.model, memo)
        for mod in list(m.modules()):
            for name, child in list(mod.named_children()):
                if type(child).__name__ == "Conv1D":          # GPT-2: W [in, out], as _conv1d_to_linear
                    w = child.weight
                    with torch.device("meta"):
                        setattr(mod, name, torch.nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None))
        m.float()
        if target.lean:
            from ..kernels import lean

            lean.fuse_for_quantization(m)
        for mod in list(m.modules()):
            for name, child in list(mod.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(mod, name, nnqd.Linear(child.in_features, child.out_features,
                                                   bias_=child.bias is not None, dtype=torch.qint8))
        m.load_state_dict(sd, strict=True, assign=True)
    if any(p.is_meta for p in m.parameters()) or any(b.is_meta for b in m.buffers()):
        raise ValueError("the cached state dict left weights unset")
    m.eval()
    _FROM_CACHE[m] = path.name            # (the lazy draft's log line says where it came from)
    return m


def _quantize(target: LoadedModel) -> torch.nn.Module:
    """A float32 copy of the target, quantized in place (per-channel dynamic int8 Linears)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    m = _float_copy(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # in place: m is already our own copy (quantize_dynamic would deep-copy it once more)
        q = quantize_dynamic(m, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    q.eval()
    return q


class _LazyInt8(LoadedModel):
    """The int8 draft of ``int8_copy(lazy=True)``: its module is made on first use of ``model``
    (or ``lean``); everything else is the target's and known at once."""

    def __init__(self, target: LoadedModel, **kw):
        self._target = target
        self._model = None
        self._lean = ""
        super().__init__(model=None, **kw)

    @property
    def model(self):
        if self._model is None and self._target is not None:
            target, self._target = self._target, None
            t0 = time.perf_counter()
            self._model = _quantized(target)
            attach_lean(self, bool(target.lean), switches=_switches_of(target))
            cached = _FROM_CACHE.get(self._model, "")
            log(f"int8 draft {'loaded from the cache' if cached else 'made'} in {time.perf_counter() - t0:.1f} s"
                + (f" ({cached})" if cached else " (cached for the next run)"))
        return self._model

    @model.setter
    def model(self, m) -> None:
        if m is not None:
            self._model, self._target = m, None

    @property
    def lean(self) -> str:
        if self._target is not None:
            self.model  # noqa: B018 - made on first use
        return self._lean

    @lean.setter
    def lean(self, v: str) -> None:
        self._lean = v

    def kv_bytes_per_token(self) -> int:
        if self._target is not None:          # the copy's shapes are the target's, in float32
            t = self._target
            return t.kv_bytes_per_token() * 4 // (torch.finfo(_dtype_of(t.model)).bits // 8)
        return super().kv_bytes_per_token()


def _conv1d_to_linear(model: torch.nn.Module) -> None:
    """GPT-2 style ``Conv1D`` (y = x W + b, W [in, out]) -> ``nn.Linear`` so it can be quantized."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                w = child.weight.data
                lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None)
                lin.weight.data = w.t().contiguous()
                if child.bias is not None:
                    lin.bias.data = child.bias.data.clone()
                setattr(mod, child_name, lin)
