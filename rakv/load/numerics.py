"""A loaded model's arithmetic and forward path: ``wrap`` (an in-memory model made ready), ``set_fast``
(the packed linears, the lean forward, the block codes; its backend chosen last), ``set_numerics``
(``fp32`` | ``q8``), and the choice of numerics for a model argument (``resolve_numerics``,
``apply_numerics``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..backends import choose_one_row, lean_of, read_switches, select_backend, set_lean
from ..config import env_fast
from ..util.paths import cache_dir, log
from .demo import DEMO_NAME
from .loaded import LoadedModel, ModelError, _dtype_of, _eos_ids, _max_positions, weights_hash
from .presets import PRESETS
from .slim import _materialize


def wrap(model: torch.nn.Module, tokenizer=None, name: str = "model", revision: str | None = None,
         fast: bool | None = None, codes_file: str = "", numerics: str = "fp32", slim: bool = False) -> LoadedModel:
    """Wrap an in-memory model (tests build tiny random ones from a config).

    ``fast``: put the model on the packed oneDNN forward path (``rakv.kernels.fastpath``) where it applies;
    None = the process default (on unless ``RAKV_FAST=0``); False = leave it plain.
    """
    model.eval()
    dtype = str(_dtype_of(model)).replace("torch.", "")
    rev = revision or weights_hash(model)
    lm = LoadedModel(
        name=name, model=model, tokenizer=tokenizer, key=f"{name}@{rev}:{dtype}",
        max_positions=_max_positions(model.config), eos_ids=_eos_ids(model, tokenizer), codes_file=codes_file,
    )
    lm.numerics = "q8" if numerics in ("q8", "auto-q8") else "fp32"
    lm.slim = slim
    try:
        return set_fast(lm, fast)
    except ModelError as e:
        if numerics != "auto-q8":
            raise
        log(f"numerics fp32 for {name}: {e}")
        lm.numerics = "fp32"
        return set_fast(lm, fast)


def set_fast(lm: LoadedModel, fast: bool | None = None) -> LoadedModel:
    """Switch ``lm`` to (or off) the fast forward path, in place; returns ``lm``. The fast path is
    the packed linears (``rakv.kernels.fastpath``) and, where the architecture allows, the lean forward
    (``rakv.kernels.lean``; ``RAKV_LEAN=0`` keeps HF's forward over the packed linears), with every linear
    whose weights are exactly block-coded running from its codes (``rakv.kernels.blockq``; ``RAKV_BLOCKQ=0``).
    The environment's switches are read here, once (``backend.read_switches``), and the model's backend
    is chosen last (``backend.select_backend``): every load and numerics switch chooses again."""
    from ..kernels import fastpath

    sw = read_switches()
    on = env_fast() if fast is None else bool(fast)
    if lm.slim and not (on and lm.numerics == "q8"):
        _materialize(lm)                    # fp32 arithmetic: the weights the codes stand for
    info = fastpath.set_fast(lm.model, on)
    lm.fast = bool(info["fast"])
    lm.fast_reason = "" if lm.fast or not on else info["reason"]
    lm.blockq = _attach_codes(lm, sw.blockq) if lm.fast else {}
    if lm.numerics == "q8":
        why = _q8_unavailable(lm, sw.blockq)
        if why:
            raise ModelError(f"--numerics q8 is not available for {lm.name}: {why}")
        _q8_blocks(lm, lanes=not sw.tiles)
        if lm.narrow:
            _narrow_blocks(lm)
    lm.key = _numerics_key(lm.key.replace("+n4", ""), lm.numerics) + ("+n4" if lm.narrow else "")
    attach_lean(lm, lm.fast and sw.lean, switches=sw)
    if lm.fast and lm.numerics == "q8" and lm.blockq.get("layers"):
        lm.blockq = dict(lm.blockq, tiles=_attach_tiles(lm))
    if lm.fast and lm.blockq.get("layers") and lm.blockq["layers"] == lm.blockq.get("of") and sw.one_row == "auto":
        # every linear runs one row from its codes: the one-row fp32 kernel is never called, so
        # there is nothing to time (that takes seconds, and is not remembered on a busy machine)
        fastpath.set_one_row(lm.model, "plain")
        lm.one_row = {"kernel": "plain", "how": "every linear runs from block codes (unused)"}
    elif lm.fast:
        lm.one_row = choose_one_row(lm.model, lm.key, cache_dir(), forced=sw.one_row)
    select_backend(lm, sw)
    return lm


NUMERICS = ("fp32", "q8")


def set_numerics(lm: LoadedModel, numerics: str) -> LoadedModel:
    """Give every linear of ``lm`` the arithmetic ``numerics``, in place; returns ``lm``.

    ``fp32``: the fp32 linear of the weights (exact block codes where they rebuild them). ``q8``:
    every linear, the LM head included, runs from its codes with 8-bit activation blocks and
    integer dot products (``kernels/blockq.c``, "q8 numerics"), at every row count, so a verify or
    tree row and a prefill row compute what the decode step computes; a linear without codes of
    its own (an fp32 checkpoint, a head tied to an unquantized embedding) gets Q8_0 codes once.
    The model key names the numerics, so prefix-cache entries and cost profiles stay apart."""
    if numerics not in NUMERICS:
        raise ModelError(f"--numerics must be one of {', '.join(NUMERICS)}, not {numerics!r}")
    if numerics == lm.numerics:
        return lm
    if numerics == "q8":
        why = _q8_unavailable(lm)
        if why:
            raise ModelError(f"--numerics q8 is not available for {lm.name}: {why}")
    lm.numerics = numerics
    return set_fast(lm, lm.fast)


def _numerics_key(key: str, numerics: str) -> str:
    """The model key with its numerics: ``name@rev+q8:dtype`` for q8, ``name@rev:dtype`` for fp32."""
    base = key.replace("+q8:", ":")
    if numerics != "q8":
        return base
    at = base.rfind(":")
    return base[:at] + "+q8" + base[at:]


def _q8_blocks(lm: LoadedModel, lanes: bool = False) -> None:
    """Every fast-path linear of ``lm`` on its codes under q8 numerics (Q8_0 codes made for one
    without), a weight shared by two modules (a tied head) one set of codes; ``lm.blockq`` says so.
    ``lanes``: the lane form, not the tiled one (``RAKV_TILES=0`` as this load read it)."""
    from ..kernels import blockq
    from ..kernels.fastpath import FastLinear

    seen: dict[int, blockq.BlockWeight] = {}
    for name, m in lm.model.named_modules():
        if not isinstance(m, FastLinear):
            continue
        if id(m.weight) not in seen:
            b = m.block if m.block is not None else blockq.quantize_q8_0(blockq._matrix(m))
            seen[id(m.weight)] = b.with_numerics("q8", lanes=lanes)
        m.block = seen[id(m.weight)]
    kinds: dict[str, int] = {}
    for b in seen.values():
        kinds[b.kind] = kinds.get(b.kind, 0) + 1
    lm.blockq = dict(lm.blockq, numerics="q8", layers=lm.blockq.get("of", len(seen)), reason="",
                     bytes=sum(b.streamed_bytes for b in seen.values()), kinds=kinds)


def _attach_tiles(lm: LoadedModel) -> dict:
    """The tiled form of every block the forward calls, read from (once: made into) the cache dir
    (``blockq.attach_tiles``): the lean forward's stacked layers and head, else each linear's codes."""
    from ..kernels import blockq
    from ..kernels.fastpath import FastLinear

    lean = lean_of(lm.model) if lm.lean else None
    if lean is not None and hasattr(lean, "coded_blocks"):
        blocks = lean.coded_blocks()
    else:
        blocks = [(n, m.block) for n, m in lm.model.named_modules() if isinstance(m, FastLinear) and m.block is not None]
    named, seen = {}, set()
    for n, b in blocks:
        if isinstance(b, blockq.BlockWeight) and id(b) not in seen:
            seen.add(id(b))
            named[n] = b
    return blockq.attach_tiles(named, lm.key)


def _narrow_blocks(lm: LoadedModel) -> None:
    """Every linear whose codes are wider than 4 bits (Q8_0, Q5_0, Q6_K ...) on Q4_1 codes of its
    own weights (``blockq.narrower_q4``), made once per load and kept in the cache dir."""
    from ..kernels import blockq
    from ..kernels.fastpath import FastLinear

    path = blockq._cache_path(_numerics_key(lm.key.replace("+n4", ""), "q8") + "+n4")   # made once, then read back
    saved = blockq.load_codes(path)
    seen: dict[int, blockq.BlockWeight] = {}
    made: dict = {}
    for name, m in lm.model.named_modules():
        if isinstance(m, FastLinear) and m.block is not None:
            if id(m.block) not in seen:
                b = saved.get(name)
                ok = b is not None and (b.kind, b.N, b.K) == ("q4", m.block.N, m.block.K)
                seen[id(m.block)] = b.with_numerics(m.block.numerics, lanes=m.block.lanes) if ok \
                    else blockq.narrower_q4(m.block)
            m.block = seen[id(m.block)]
            made[name] = m.block
    if made and any(saved.get(n) is None for n in made):
        blockq.save_codes(path, made)
    lm.blockq = dict(lm.blockq, narrow=lm.narrow,
                     bytes=sum(b.streamed_bytes for b in {id(b): b for b in seen.values()}.values()))


def _q8_unavailable(lm: LoadedModel, blockq_on: bool | None = None) -> str:
    """Why q8 numerics cannot run ``lm`` ("" when they can): they need the fast path on CPU in
    float32 and the compiled kernel, and every linear's inputs in whole blocks of 32."""
    from ..kernels import blockq
    from ..kernels.fastpath import FastLinear

    if not lm.fast:
        return lm.fast_reason or "the fast path is off (--no-fast or RAKV_FAST=0)"
    if blockq.library() is None:
        return f"the C kernel is unavailable ({blockq.reason() or 'RAKV_BLOCKQ=0'})"
    if not (read_switches().blockq if blockq_on is None else blockq_on):
        return "RAKV_BLOCKQ=0"
    for name, m in lm.model.named_modules():
        if isinstance(m, FastLinear) and m.in_features % blockq.BLK:
            return f"layer {name} has {m.in_features} inputs, not a multiple of {blockq.BLK}"
    return ""


def _attach_codes(lm: LoadedModel, enabled: bool | None = None) -> dict:
    """Block codes for the fast path's linears (``blockq.attach``), offering those read from the
    model's GGUF (every GGUF type the kernel runs; each still checked against its weight)."""
    from ..kernels import blockq
    from ..kernels.fastpath import FastLinear

    offered = blockq.load_codes(Path(lm.codes_file)) if lm.codes_file else {}
    return blockq.attach([(n, m) for n, m in lm.model.named_modules() if isinstance(m, FastLinear)],
                         lm.key, {n: b for n, b in offered.items() if b is not None}, trusted=lm.slim,
                         enabled=enabled)


def attach_lean(lm: LoadedModel, on: bool = True, like: LoadedModel | None = None, switches=None) -> None:
    """The lean forward for ``lm`` (``like``: the model whose layers it shares, for layers:L), and
    its backend chosen (``backend.select_backend``) with ``switches`` (the environment as the load
    read it; None: read now)."""
    from ..kernels import lean

    base = lean_of(like.model) if like is not None else None
    if on and base is not None and lean.supported(lm.model) is None:
        set_lean(lm.model, base.truncated(lm.model))
        lm.lean = lean.kind(lm.model)
    else:
        lm.lean = lean.kind(lm.model) if lean.attach(lm.model, on) == "" else ""
    select_backend(lm, switches)


def _switches_of(target: LoadedModel):
    """The switches ``target``'s load read (a draft made from it, now or later, runs by them)."""
    return getattr(getattr(target, "backend", None), "switches", None)


def resolve_numerics(spec: str, numerics: str = "auto") -> str:
    """``auto``: q8 for a model that comes from a GGUF (the demo, a ``.gguf`` file, a preset: what its
    users run), fp32 for any other; q8 and fp32 as given."""
    n = (numerics or "auto").strip().lower()
    if n not in ("auto", *NUMERICS):
        raise ModelError(f"--numerics must be auto, {' or '.join(NUMERICS)}, not {numerics!r}")
    if n != "auto":
        return n
    s = (spec or "").strip()
    gguf = s == DEMO_NAME or s.lower().endswith(".gguf") or s in PRESETS
    return "q8" if gguf else "fp32"


def _wrap_numerics(spec: str, numerics: str) -> str:
    """What ``wrap`` is asked for: "fp32", "q8" (refused where it cannot run), or "auto-q8" (q8, else
    fp32 with a one-line note)."""
    want = resolve_numerics(spec, numerics)
    return "auto-q8" if want == "q8" and (numerics or "auto").strip().lower() == "auto" else want


def apply_numerics(lm: LoadedModel, spec: str, numerics: str = "auto") -> LoadedModel:
    """``set_numerics`` with ``resolve_numerics``'s choice; an ``auto`` q8 that cannot run here keeps
    fp32 and says why in one line (an explicit ``q8`` that cannot: ModelError)."""
    want = resolve_numerics(spec, numerics)
    if want == "q8" and (numerics or "auto").strip().lower() == "auto":
        why = _q8_unavailable(lm)
        if why:
            log(f"numerics fp32 for {lm.name}: q8 needs {why}")
            return set_numerics(lm, "fp32")
    return set_numerics(lm, want)
