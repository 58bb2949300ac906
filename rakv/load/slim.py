"""Converted once: a checkpoint the loader has to transform (a ``.gguf`` file, the demo) is written
ONCE into the cache dir and loaded from there afterwards. Here: the converted folder's files and
marker, the content hash that names it (remembered by the file's stat), the lock and atomic install,
and the slim copy (a GGUF's coded linears kept as their codes, ``_from_slim``; their fp32 weights made
only when needed, ``_materialize``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..util.paths import cache_dir, log
from .loaded import LoadedModel, ModelError


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

    from ..util.paths import write_atomic

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


def _ensure_converted(out: Path, ready, convert, what: str, lock_name: str = "") -> Path:
    """``out`` as ``convert(out)`` makes it, made at most once: under a lock next to it (``lock_name``,
    else ``.<out's name>.lock``), and only when ``ready(out)`` is false before and after taking the lock."""
    from ..util.filelock import file_lock

    if ready(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / (lock_name or f".{out.name}.lock")
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

        from ..kernels import blockq

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

    from ..kernels import blockq

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
    from ..kernels import blockq

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


def _demo_ready(out: Path) -> bool:
    return ((out / "model.safetensors").exists() or _slim_folder(out)) and (out / "tokenizer.json").exists()
