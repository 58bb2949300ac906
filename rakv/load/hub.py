"""Model loading: a hub id or local dir (``from_pretrained``), a ``.gguf`` file, a preset, or the
embedded offline ``demo``, each returned as one ``LoadedModel`` with its backend (``load_model``).

A ``.gguf`` file (a preset is one, and so is the demo) is converted once into the cache dir
(``rakv.load.gguf``, ``rakv.load.slim``) and loaded from there afterwards."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

from ..config import env_fast
from ..util.paths import log, write_atomic
from .demo import DEMO_NAME, ensure_demo
from .gguf import ensure_gguf, gguf_codes
from .loaded import LoadedModel, ModelError, _eos_ids, check_all_loaded
from .numerics import _wrap_numerics, resolve_numerics, set_fast, wrap
from .presets import PRESETS, PresetError, ensure_preset
from .slim import CODES_FILE, CODES_FORMAT, CONVERTED_MARK, _from_slim, _ino, _slim_folder
from .tokenizer import _note_bos, _tokenizer_in, _TokenizerRead, load_tokenizer


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
    from ..kernels import blockq

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


# ----------------------------------------------------------------------------- loading
def looks_like_path(spec: str) -> bool:
    """A model argument meant as a local path (not a hub id like ``gpt2`` or ``org/name``)."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or "\\" in spec or spec.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in spec or (len(spec) > 1 and spec[1] == ":"):
        return True     # Windows separators, drive letters
    head = spec.split("/")[0]
    return "/" in spec and Path(head).is_dir()      # org/name whose "org" is a local folder


def load_model(spec: str, dtype: str = "float32", revision: str | None = None, device: str = "cpu",
               fast: bool | None = None, numerics: str = "fp32") -> LoadedModel:
    """Load a target (or a draft model) from ``demo``, a ``.gguf`` file, a local dir or a hub id.

    ``device``: auto | cpu | cuda[:i] | mps (``rakv.util.device.resolve``); ``fast``: see ``wrap``."""
    from ..util.device import register, resolve

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

    on = env_fast() if fast is None else bool(fast)
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


def _dir_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()
