"""Tokenizers: the one a folder this loader made keeps ready built (pickled beside it, read in a
thread while the model loads: ``_TokenizerRead``, ``load_tokenizer``), the BOS flag made to say what
the tokenizer does (``_note_bos``), and a draft's tokenizer checked against the target's
(``check_same_tokenizer``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..util.paths import log
from .loaded import LoadedModel, ModelError


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
# vocabulary and merges to the Rust library as Python objects (seconds; docs/fastpath.md). A folder this
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

        from ..kernels import trust

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
        from ..kernels import trust

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
