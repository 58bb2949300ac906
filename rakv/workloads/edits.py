"""The edit trace (``rakv bench --edits``): source files "typed" as an editor's completion client
would send them to an ``/infill`` server, modelled on llama.vim (ggml-org/llama.vim).

What the client sends, per request: ``input_prefix`` (up to ``n_prefix`` lines above the cursor),
``input_suffix`` (the rest of the cursor's line after the cursor, then up to ``n_suffix`` lines
below), ``prompt`` (the cursor's line up to the cursor), ``input_extra`` (chunks of other files:
llama.vim's ring buffer), ``n_predict``, ``n_indent`` (the line's indentation), ``cache_prompt``.

The trace, deterministic: per file, ``points`` cursor lines spread over the file; at each, the
cursor moves onto the line (now empty: the user is about to type it), a warm-up is sent (the same
request with ``n_predict`` 0: the server caches the new context before the first keystroke), then
one completion request per pause as the line is typed, at word boundaries (``keys`` of them, spread
over the line). The line's text after the cursor is kept as ``truth`` (what the user went on to
type), never sent.

The files are modules of Python's standard library on this machine (nobody here wrote them), in
two fixed sets chosen by name: ``TUNING`` (every choice of this trace and of the controller for
completions was tried on these) and ``HELD_OUT`` (only ever measured, to confirm).
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# the sets, by name: (file, the one-line reason it is in the set)
TUNING: tuple[tuple[str, str], ...] = (
    ("shlex.py", "a hand-written tokenizer class: state-machine methods whose lines repeat each other"),
    ("textwrap.py", "long docstrings beside code: prose and code in one file"),
    ("base64.py", "families of near-identical encode/decode functions: the copy path's best case"),
)
HELD_OUT: tuple[tuple[str, str], ...] = (
    ("calendar.py", "classes of date arithmetic and text formatting, unlike the tuning files' parsing"),
    ("heapq.py", "algorithmic code with long explanatory comments"),
    ("glob.py", "short recursive functions over paths, os and re calls"),
)
SETS = {"tuning": TUNING, "heldout": HELD_OUT}

# the client's settings (llama.vim's names). Its defaults are n_prefix 256 / n_suffix 64 lines and
# n_predict 256 cut by t_max_predict_ms 1500; on a 2-core CPU a 1.5B model decodes ~10 tokens in
# that time, so a completion here is N_PREDICT 16 tokens (about one line), with no time limits
# (both servers run to n_predict or the end of the line's block, greedy), and the windows are
# smaller so one warm-up's prefill stays within seconds, not a minute.
N_PREFIX = 128
N_SUFFIX = 16
N_PREDICT = 16
RING_CHUNKS = 2          # chunks of other files in input_extra (llama.vim: ring_n_chunks 16)
RING_CHUNK_LINES = 32    # lines a chunk (llama.vim picks ring_chunk_size / 2 = 32 lines)
POINTS = 3               # cursor moves per file
KEYS = 4                 # completion requests per typed line (after its warm-up)
MIN_LINE = 20            # a cursor line has at least this many lines above it (a prefix to reuse)


def stdlib_dir() -> Path:
    """Where the standard library's modules are: /usr/lib/python3.11 where it exists (the files
    the issue names), else this interpreter's own standard library."""
    p = Path("/usr/lib/python3.11")
    return p if (p / "shlex.py").is_file() else Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class EditRequest:
    file: str
    point: int            # which cursor move in the file (0..points-1)
    line: int             # 0-based line number of the cursor
    kind: str             # "warmup" (n_predict 0, on a cursor move) | "key" (a completion while typing)
    key: int              # 0 for the warm-up, then 1.. for each keystroke request of the line
    input_prefix: str
    input_suffix: str
    prompt: str
    input_extra: tuple[tuple[str, str], ...] = field(default=())   # (filename, text)
    n_predict: int = N_PREDICT
    n_indent: int = 0
    truth: str = ""       # what the user typed next on the line (never sent)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.key}"

    def body(self) -> dict:
        """The JSON body of the /infill request (greedy, no time limits, the server's cache used)."""
        return {"input_prefix": self.input_prefix, "input_suffix": self.input_suffix,
                "input_extra": [{"filename": f, "text": t} for f, t in self.input_extra],
                "prompt": self.prompt, "n_predict": self.n_predict, "n_indent": self.n_indent,
                "temperature": 0.0, "top_k": 1, "stream": False, "cache_prompt": True}


def cursor_lines(lines: list[str], points: int) -> list[int]:
    """``points`` lines to type, spread evenly over the file's typable lines (code with at least
    three words, not a comment, at least MIN_LINE lines down)."""
    ok = [i for i, s in enumerate(lines)
          if i >= MIN_LINE and not s.lstrip().startswith("#") and len(_pauses(s)) >= 3]
    if not ok:
        return []
    n = min(points, len(ok))
    return [ok[(j + 1) * len(ok) // (n + 1)] for j in range(n)]


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _pauses(line: str) -> list[int]:
    """Cursor columns where a typist pauses: after each word or punctuation mark of the line, the
    indentation typed, the line not yet complete."""
    ends = [m.end() for m in _TOKEN.finditer(line)]
    return [e for e in ends if e < len(line.rstrip())]


def key_columns(line: str, keys: int) -> list[int]:
    """``keys`` of the line's pauses, spread over it (the first and the last kept)."""
    ps = _pauses(line)
    if len(ps) <= keys:
        return ps
    return sorted({ps[round(j * (len(ps) - 1) / (keys - 1))] for j in range(keys)}) if keys > 1 else ps[:1]


def ring_chunk(name: str, lines: list[str]) -> tuple[str, str]:
    """The chunk an editor's ring buffer picked from a file left: RING_CHUNK_LINES lines around its
    middle (llama.vim picks around the cursor on leaving a buffer)."""
    mid = len(lines) // 2
    lo = max(0, mid - RING_CHUNK_LINES // 2)
    return name, "\n".join(lines[lo:lo + RING_CHUNK_LINES]) + "\n"


def file_trace(name: str, lines: list[str], extra: tuple[tuple[str, str], ...], points: int = POINTS,
               keys: int = KEYS, n_predict: int = N_PREDICT) -> list[EditRequest]:
    """One file's requests: at each cursor line a warm-up, then the keystrokes."""
    out: list[EditRequest] = []
    for p, y in enumerate(cursor_lines(lines, points)):
        full = lines[y]
        indent = len(full) - len(full.lstrip())
        prefix = "\n".join(lines[max(0, y - N_PREFIX):y]) + "\n"
        below = "\n".join(lines[y + 1:y + 1 + N_SUFFIX]) + "\n"
        common = dict(file=name, point=p, line=y, input_prefix=prefix, input_extra=extra, n_indent=indent)
        # the cursor moves onto the line, emptied (llama.vim: a blank line is sent with no prefix/suffix)
        out.append(EditRequest(**common, kind="warmup", key=0, input_suffix="\n" + below, prompt="",
                               n_predict=0, truth=full))
        for j, x in enumerate(key_columns(full, keys), 1):
            out.append(EditRequest(**common, kind="key", key=j, input_suffix="\n" + below, prompt=full[:x],
                                   n_predict=n_predict, truth=full[x:]))
    return out


def edit_trace(which: str = "tuning", root: str | Path | None = None, points: int = POINTS, keys: int = KEYS,
               n_predict: int = N_PREDICT, files: int | None = None) -> dict[str, list[EditRequest]]:
    """The trace of a set (``tuning`` or ``heldout``), file by file (in the set's order; ``files``:
    the first that many). Each file's input_extra: a chunk of each of the set's RING_CHUNKS files
    before it (cyclically), as if the user had just left them. A missing file: ValueError."""
    if which not in SETS:
        raise ValueError(f"edit trace set {which!r}: choose from {', '.join(SETS)}")
    root = Path(root) if root is not None else stdlib_dir()
    names = [n for n, _ in SETS[which]]
    texts = {}
    for n in names:
        p = root / n
        if not p.is_file():
            raise ValueError(f"the edit trace needs {p} (a module of Python's standard library)")
        texts[n] = p.read_text(encoding="utf-8").splitlines()
    chosen = names[:files] if files else names
    trace = {}
    for i, n in enumerate(chosen):
        ring = tuple(ring_chunk(names[(i - j) % len(names)], texts[names[(i - j) % len(names)]])
                     for j in range(RING_CHUNKS, 0, -1) if names[(i - j) % len(names)] != n)
        trace[n] = file_trace(n, texts[n], ring, points, keys, n_predict)
    return trace
