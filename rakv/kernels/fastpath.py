"""The fast forward path: every ``nn.Linear`` of a loaded HF model runs on a pre-packed oneDNN weight.

On CPU, torch's ``F.linear`` goes to MKL's sgemm, which streams a weight at full speed for one row
but falls to a fraction of that for 2-9 rows (a different kernel), so a verify of k+1 tokens costs
about two steps. oneDNN's packed inner product (what inductor's weight freezing uses:
``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``) is nearly flat in rows, as a
memory-bound layer should be. For exactly one row (a decode or draft step) which kernel is faster
depends on the machine (docs/fastpath.md), so ``choose_one_row`` times both on the model's own
decode steps once per machine, model and thread count, keeps the faster, and remembers it
(``RAKV_ONE_ROW=plain|packed``, read at load and passed in as ``forced``, forces one). The model
itself is unchanged (HF stays the source of truth for the architecture and the weights: each ``FastLinear`` keeps its ``weight`` / ``bias`` parameters, so
``state_dict``, tied embeddings and hashing behave as before); only the matmul kernel differs.

Every policy (AR, speculative, the draft, calibration) runs through the same modules, so all share
numerics: the exactness contract (spec == ar == target-only greedy) is unaffected.

Automatic fallback (the model is left plain) where oneDNN is unavailable, on a non-CPU device, or
for a dtype other than float32 / bfloat16. ``RAKV_FAST=0`` (or ``RakvConfig.fast=False``, CLI
``--no-fast``) keeps the plain path for comparison: the caller decides (nothing here reads the
environment: ``rakv.config.env_fast`` reads RAKV_FAST).
"""

from __future__ import annotations

import copy
import inspect
import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from . import blockq
from .blockq import MAX_ROWS
from .registry import lean_of, set_lean

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_BLOCK_ROWS = MAX_ROWS            # rows up to which a linear with block codes runs from them


def _ops_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except Exception:  # noqa: BLE001 - a torch build without the ops
        return False


def unavailable_reason(model: nn.Module) -> str | None:
    """Why the fast path cannot apply to ``model`` (None: it can)."""
    if not _ops_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    if p is None:
        return "the model has no floating-point weights"
    if p.device.type != "cpu":
        return f"device {p.device.type} (the packed oneDNN path is CPU-only; torch's kernels are used)"
    if p.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(p.dtype).replace('torch.', '')} (packed path: float32 / bfloat16)"
    if p.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16 without CPU support for oneDNN bf16 (avx512bw/vl/dq or avx_ne_convert)"
    return None


_PLAIN_COPIES = False


@contextmanager
def plain_copies():
    """Inside: ``copy.deepcopy`` of a fast model gives plain modules (for the int8 draft's copy)."""
    global _PLAIN_COPIES
    old, _PLAIN_COPIES = _PLAIN_COPIES, True
    try:
        yield
    finally:
        _PLAIN_COPIES = old


def _conv1d_cls():
    try:
        from transformers.pytorch_utils import Conv1D
        return Conv1D
    except ImportError:  # pragma: no cover
        return None


class FastLinear(nn.Module):
    """A linear layer (``nn.Linear``, or GPT-2's ``Conv1D``: y = x W + b with W [in, out]) whose
    forward uses a oneDNN-packed copy of its weight (inference only).

    It keeps the original module's ``weight`` / ``bias`` parameters under the same names (so
    ``state_dict``, tied embeddings and hashing are unchanged); ``plain()`` gives the original kind
    of module back. The packed copy is made on first use and again after any in-place change of
    the weight or bias (their version counters are checked); it is not part of ``state_dict``.
    """

    def __init__(self, mod: nn.Module):
        super().__init__()
        self.transposed = not isinstance(mod, nn.Linear)      # Conv1D stores W as [in, out]
        if self.transposed:
            self.in_features, self.out_features = mod.nx, mod.nf
        else:
            self.in_features, self.out_features = mod.in_features, mod.out_features
        self.weight = mod.weight
        self.bias = mod.bias
        self.repack()

    def repack(self) -> None:
        """Take the weight as it is now; its packed copy is made on first use (``packed``)."""
        self._packed = None
        self._bias = None if self.bias is None else self.bias.detach()
        self._version = self._weight_version()
        self.block = None                 # codes belong to the weight as it was (blockq.attach sets them)

    def packed(self) -> torch.Tensor:
        """The oneDNN-packed copy of the weight, made on first use: a layer running from block codes
        needs it only past ``MAX_ROWS`` rows (a long prefill), so a load does not pay for it."""
        if self._packed is None:
            with torch.no_grad():
                w = self.weight.detach()
                w = w.t().contiguous() if self.transposed else w.contiguous()
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return self._packed

    def _weight_version(self) -> tuple[int, int]:
        return (self.weight._version, -1 if self.bias is None else self.bias._version)

    # One row (a decode step, a draft step): torch's own kernel (MKL's gemv) unless choose_one_row
    # measured the packed one faster on this machine; 2+ rows (a verify, a prefill): packed.
    one_row_plain = True
    # The weight's exact block codes (rakv.kernels.blockq; set by blockq.attach, None when it has none): up to
    # blockq.MAX_ROWS rows run from them, the same fp32 weights at a fraction of the bytes.
    block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None and x.dtype == torch.float32 and not x.requires_grad \
                and x.device.type == "cpu" and (x.numel() <= _BLOCK_ROWS * self.in_features or getattr(self.block, "all_rows", False)):
            if self._weight_version() == self._version:
                return self.block(x, self._bias)
            self.repack()                              # changed in place: the codes no longer hold
        if (x.dtype != self.weight.dtype or x.requires_grad or x.device.type != "cpu"
                or (self.one_row_plain and x.numel() == self.in_features)):
            w = self.weight.t() if self.transposed else self.weight
            return nn.functional.linear(x, w, self.bias)
        if self._weight_version() != self._version:   # the weight was changed in place: pack again
            self.repack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed(), self._bias, "none", [], "")

    def plain(self) -> nn.Module:
        """The plain module (same parameters) this one replaced."""
        if self.transposed:
            Conv1D = _conv1d_cls()
            mod = Conv1D.__new__(Conv1D)
            nn.Module.__init__(mod)
            mod.nf, mod.nx = self.out_features, self.in_features
        else:
            mod = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(mod)
            mod.in_features, mod.out_features = self.in_features, self.out_features
        mod.weight = self.weight
        mod.bias = self.bias
        mod.training = self.training
        return mod

    def __deepcopy__(self, memo):
        # oneDNN tensors cannot be deep-copied: copy the parameters, pack the copy afresh (or, inside
        # ``plain_copies()``, give a plain module)
        if _PLAIN_COPIES:
            new = copy.deepcopy(self.plain(), memo)      # the parameters go through memo (ties kept)
            memo[id(self)] = new
            return new
        new = FastLinear.__new__(FastLinear)
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.transposed = self.transposed
        new.in_features, new.out_features = self.in_features, self.out_features
        new.weight = copy.deepcopy(self.weight, memo)
        new.bias = copy.deepcopy(self.bias, memo)
        new.training = self.training
        new.one_row_plain = self.one_row_plain
        new.repack()
        new.block = self.block            # the same values: the same codes (read-only, shared)
        return new

    def extra_repr(self) -> str:
        kind = "conv1d" if self.transposed else "linear"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {kind}, packed=onednn")


def _linears(model: nn.Module):
    for parent in model.modules():
        for name, child in parent.named_children():
            yield parent, name, child


def enable(model: nn.Module) -> dict:
    """Swap every ``nn.Linear`` and GPT-2 ``Conv1D`` (LM head included) for a ``FastLinear``, in place.

    Returns ``{"fast": bool, "linears": n, "reason": str}``; a model it cannot apply to is left plain.
    Idempotent.
    """
    why = unavailable_reason(model)
    if why is not None:
        disable(model)
        return {"fast": False, "linears": 0, "reason": why}
    Conv1D = _conv1d_cls()
    n = 0
    found = list(_linears(model))
    plain = [c for _, _, c in found if type(c) is nn.Linear or (Conv1D is not None and type(c) is Conv1D)]
    # one packing now, of the smallest layer (the LM head, often first, can be ~1 GB): a CPU oneDNN
    # cannot pack for fails here; the others are packed on first use
    probe = min(plain, key=lambda c: c.weight.numel()) if plain and not any(
        isinstance(c, FastLinear) for _, _, c in found) else None
    try:
        for parent, name, child in found:
            if isinstance(child, FastLinear):
                n += 1
            elif type(child) is nn.Linear or (Conv1D is not None and type(child) is Conv1D):
                fl = FastLinear(child)
                if child is probe:
                    fl.packed()
                setattr(parent, name, fl)
                n += 1
    except RuntimeError as e:          # a kernel the CPU lacks: stay plain, say why
        disable(model)
        return {"fast": False, "linears": 0, "reason": f"oneDNN packing failed: {str(e).splitlines()[0]}"}
    return {"fast": n > 0, "linears": n, "reason": "" if n else "no nn.Linear layers"}


def disable(model: nn.Module) -> int:
    """Back to plain ``nn.Linear`` modules (the same parameters), in place; returns how many."""
    n = 0
    for parent, name, child in list(_linears(model)):
        if isinstance(child, FastLinear):
            setattr(parent, name, child.plain())
            n += 1
    set_lean(model, None)            # the lean forward (rakv.kernels.lean) belongs to the fast path
    return n


def set_fast(model: nn.Module, on: bool) -> dict:
    if on:
        return enable(model)
    disable(model)
    return {"fast": False, "linears": 0, "reason": "switched off"}


def is_enabled(model: nn.Module) -> bool:
    return any(isinstance(m, FastLinear) for m in model.modules())


# ----------------------------------------------------------------------------- the streaming floor
def linear_layers(model: nn.Module) -> list[nn.Module]:
    """Every linear-like layer the forward runs (fast, plain ``nn.Linear``, ``Conv1D``, dynamic int8)."""
    Conv1D = _conv1d_cls()
    out = []
    for m in model.modules():
        if isinstance(m, (FastLinear, nn.Linear)) or (Conv1D is not None and type(m) is Conv1D):
            out.append(m)
        elif type(m).__name__ == "Linear" and hasattr(m, "in_features") and hasattr(m, "_packed_params"):
            out.append(m)                      # torch.ao dynamic-quantized Linear
    return out


def _in_features(m: nn.Module) -> int:
    return int(getattr(m, "in_features", None) or getattr(m, "nx"))


@torch.inference_mode()
def linear_floor_ms(model: nn.Module, rows: int = 1, reps: int = 5) -> float:
    """Median time (ms) of one pass over all of ``model``'s linear layers, each on ``rows`` rows.

    The layers run one after another as in a forward, so their weights stream from memory: for one
    row this is the weight-streaming floor of a decode step (a step cannot be cheaper than reading
    its weights once). The attention, norms and framework overhead are what a step pays above it.
    """
    from ..util.device import clock, model_device

    coded = _coded_ops(model)
    if coded:                             # the block kernel's calls as the lean forward makes them
        dev, dtype = torch.device("cpu"), torch.float32
        layers = coded
    else:
        mods = linear_layers(model)
        if not mods:
            return 0.0
        dev = model_device(model)
        p = next((q for q in model.parameters() if q.is_floating_point()), None)
        dtype = p.dtype if p is not None and not any(type(m).__name__ == "Linear" and hasattr(m, "_packed_params")
                                                     for m in mods) else torch.float32
        layers = [(m, _in_features(m)) for m in mods]
    xs = {n: torch.randn(1, rows, n, device=dev, dtype=dtype) for n in {k for _, k in layers}}
    for fn, k in layers:                  # warm-up (first-call kernel selection), excluded
        fn(xs[k])
    times = []
    for _ in range(reps):
        t0 = clock()
        for fn, k in layers:
            fn(xs[k])
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def _coded_ops(model: nn.Module) -> list:
    """(call, inputs) of every linear the lean forward runs from block codes (q|k|v and gate|up
    fused, the head), when all of them are: the floor is then the kernel's own pass, not 200-odd
    module calls (whose Python overhead made it exceed a step that runs its layers in C)."""
    from .blockq import BlockWeight

    ops = getattr(lean_of(model), "ops", None) or []
    out = []
    for op in ops:
        b = getattr(op, "block", None)
        if getattr(op, "fn", None) is not None or not isinstance(b, BlockWeight):
            return []
        out.append(((lambda x, b=b, bias=op.bias: b(x, bias)), b.K))
    return out


ONE_ROW_MIN_PARAMS = 10_000_000   # smaller models (the tests' tiny ones) keep the default: nothing to gain
ONE_ROW_MARGIN = 0.97             # the packed kernel must be 3% faster to replace the default
ONE_ROW_SHARE_MIN = 0.8           # main-thread CPU share below this while timing: busy, not remembered


def _own_forward(model: nn.Module):
    """``forward(tokens, cache)`` -> the last row's logits, as the kernels can run ``model`` without a
    backend: its lean forward where one is attached, else HF's own (a backend passes its own)."""
    lean = lean_of(model)
    if lean is not None:
        return lambda tokens, cache: lean.forward(torch.tensor([list(tokens)], dtype=torch.long), cache, 1)
    arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    dev = next(model.parameters()).device
    return lambda tokens, cache: model(input_ids=torch.tensor([list(tokens)], dtype=torch.long, device=dev),
                                       use_cache=True, logits_to_keep=1, **{arg: cache}).logits


@torch.inference_mode()
def _decode_steps(model: nn.Module, forward=None, ctx: int = 64, steps: int = 4):
    """Timing (rakv.util.meter) of real decode steps, one token after a ``ctx``-token prefill: what the
    one-row kernel is chosen for (whole steps, not a bare pass over the linear layers, which can rank
    the kernels the other way: docs/fastpath.md). ``forward(tokens, cache)``: the model's backend's
    forward (``rakv.backends``); None: ``_own_forward``."""
    from transformers import DynamicCache

    from ..util.meter import time_reps

    forward = forward or _own_forward(model)
    vocab = int(getattr(model.config, "vocab_size", 1000))
    ids = iter([(i * 7919) % vocab for i in range(1, ctx + steps + 2)])
    cache = DynamicCache()
    forward([next(ids) for _ in range(ctx)], cache)
    forward([next(ids)], cache)                             # cold: excluded
    return time_reps(lambda: forward([next(ids)], cache), steps)


def one_row_kernel(model: nn.Module) -> str:
    """The kernel a one-row call of ``model`` uses: "packed", "plain", or "" (not on the fast path)."""
    layers = [m for m in linear_layers(model) if isinstance(m, FastLinear)]
    if not layers:
        return ""
    return "plain" if layers[0].one_row_plain else "packed"


def set_one_row(model: nn.Module, kernel: str) -> None:
    for m in linear_layers(model):
        if isinstance(m, FastLinear):
            m.one_row_plain = kernel != "packed"


def choose_one_row(model: nn.Module, key: str, cache: "Path | None" = None, rounds: int = 3,
                   forced: str = "auto", forward=None) -> dict:
    """Set the one-row kernel of a fast-path model to the faster one on this machine.

    Forced by ``RAKV_ONE_ROW`` (plain | packed; ``forced``: its value as the load read it); else
    remembered in ``cache/kernels.json`` per model, thread count, torch build and CPU; else
    measured: real decode steps with each kernel (``forward``: the backend's, see ``_decode_steps``),
    interleaved ``rounds`` times (seconds), medians compared."""
    from ..util.meter import Timing
    from ..util.device import hardware_info

    if not is_enabled(model):
        return {"kernel": "", "how": "not on the fast path"}
    if forced in ("plain", "packed"):
        set_one_row(model, forced)
        return {"kernel": forced, "how": "RAKV_ONE_ROW"}
    if sum(m.weight.numel() for m in linear_layers(model)) < ONE_ROW_MIN_PARAMS:
        set_one_row(model, "plain")
        return {"kernel": "plain", "how": "small model (default)"}
    ident = "|".join([key, str(torch.get_num_threads()), torch.__version__, hardware_info()["cpu"],
                      torch.backends.cpu.get_cpu_capability()])
    path = cache / "kernels.json" if cache is not None else None
    known = remembered_kernels(path)
    mine = known.get(ident)
    if isinstance(mine, dict) and mine.get("kernel") in ("plain", "packed"):
        set_one_row(model, mine["kernel"])
        return {"kernel": mine["kernel"], "how": "remembered",
                **{k: v for k, v in mine.items() if k.endswith("_ms") and isinstance(v, (int, float))}}
    runs = {"plain": [], "packed": []}
    for r in range(rounds):
        for kernel in (("plain", "packed") if r % 2 == 0 else ("packed", "plain")):
            set_one_row(model, kernel)
            runs[kernel].append(_decode_steps(model, forward))
    plain, packed = (statistics.median(t.value for t in runs[k]) for k in ("plain", "packed"))
    out = {"kernel": "packed" if packed < ONE_ROW_MARGIN * plain else "plain",
           "plain_step_ms": round(plain, 2), "packed_step_ms": round(packed, 2)}
    share = Timing([x for ts in runs.values() for t in ts for x in t.ms],
                   [x for ts in runs.values() for t in ts for x in t.cpu_ms]).share
    if share < ONE_ROW_SHARE_MIN:   # another process took the CPU: keep the default, measure again next time
        set_one_row(model, "plain")
        return dict(out, kernel="plain", how=f"busy machine (CPU share {share:.0%}): default kept, not remembered")
    set_one_row(model, out["kernel"])
    if path is not None:
        from ..util.paths import write_atomic

        known[ident] = out
        try:
            write_atomic(path, json.dumps(known, indent=1))
        except OSError:
            pass
    return dict(out, how="measured")


def remembered_kernels(path: Path | None) -> dict:
    """``kernels.json``'s choices ({} when there is none); a damaged file (not JSON, not an object,
    nested too deeply) is ignored with one line: the choice is measured again and the file rewritten."""
    from ..util.paths import log
    from ..util.text_in import load_json

    if path is None or not path.exists():
        return {}
    try:
        known = load_json(path.read_bytes())
        why = None if isinstance(known, dict) else f"expected a JSON object, got {type(known).__name__}"
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    if why:
        log(f"{path} is damaged ({why[:120]}): ignored, the kernel choice is measured again")
        return {}
    return known


def attach_codes(model: nn.Module, key: str = "") -> dict:
    """Run every fast-path linear of ``model`` whose weights are exact GGUF blocks from its codes
    (``blockq.attach``); what it did, as ``blockq.attach`` says."""
    return blockq.attach([(n, m) for n, m in model.named_modules() if isinstance(m, FastLinear)], key)
