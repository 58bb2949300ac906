"""Fill-in-the-middle prompts: the model's own FIM tokens found in its tokenizer, and the ids of an
editor's request (the text before the cursor, after it, the current line, other files of the
repository) in the order a code model was trained on.

The order is llama.cpp server's repository-level pattern (Qwen2.5-Coder's report, arXiv 2409.12186),
with the current line last:

    [REP]myproject\\n [SEP]file0\\n text0 ... [SEP]filename\\n [PRE]prefix [SUF]suffix [MID]line

so a keystroke (which changes the current line) changes only the end of the prompt, and the exact
prefix cache reuses the rest. llama.cpp's server as vendored in llama-cpp-python 0.3.36 puts the
line at the end of the prefix instead (``[PRE]prefix line [SUF]suffix [MID]``); earlier llama.cpp
servers put it after ``[MID]`` as here. The prefix, suffix and extra
chunks are cut to llama.cpp's shares of a batch (``build``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

# the names each FIM role's token goes by (llama.cpp's vocabulary loader knows the same ones)
NAMES = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>"),
    "eot": ("<EOT>", "▁<EOT>", "<|endoftext|>"),
}
N_BATCH = 2048           # llama-server's default batch: the prefix gets 3/4 of it, the suffix the rest
REPO = "myproject\n"     # the repository's name in the prompt (llama.cpp's)
FILENAME = "filename\n"  # the current file's (llama.cpp's)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"   # between extra chunks of a model without a file separator


class NoFim(ValueError):
    """The model's tokenizer lacks a FIM token; the message is one line."""


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM ids: prefix, suffix and middle (needed); pad, repository, file separator
    and end-of-text (where it has them)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None
    eot: int | None = None

    @property
    def ends(self) -> frozenset[int]:
        """Ids that end the middle (llama.cpp counts them as end of generation)."""
        return frozenset(t for t in (self.pad, self.rep, self.sep, self.eot) if t is not None)


_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def find_tokens(tokenizer) -> FimTokens:
    """The tokenizer's FIM tokens, by name; NoFim (one line naming what is missing) without them."""
    if tokenizer is None:
        raise NoFim("fill-in-the-middle needs the model's tokenizer")
    try:
        out = _FOUND.get(tokenizer)
    except TypeError:
        out = None
    if out is None:
        out = _look_up(tokenizer)
        try:
            _FOUND[tokenizer] = out          # (the answer kept: the vocabulary is read once)
        except TypeError:
            pass
    if isinstance(out, str):
        raise NoFim(out)
    return out


def _look_up(tokenizer) -> "FimTokens | str":
    """The FIM tokens in the tokenizer's vocabulary, or the line saying which are missing."""
    vocab = tokenizer.get_vocab()
    found = {role: next((vocab[n] for n in names if n in vocab), None) for role, names in NAMES.items()}
    missing = [role for role in ("pre", "suf", "mid") if found[role] is None]
    if missing:
        names = ", ".join(NAMES[r][0] for r in missing)
        return f"this model cannot fill in the middle: its tokenizer has no {names} token"
    return FimTokens(**found)


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` as plain text: no special tokens added, and none read out of it (a file that
    mentions ``<|fim_prefix|>`` is not a FIM prompt)."""
    if not text:
        return []
    try:
        enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
    except TypeError:                  # (a tokenizer without the option)
        enc = tokenizer(text, add_special_tokens=False)
    return [int(x) for x in enc["input_ids"]]


@dataclass
class FimPrompt:
    ids: list[int]
    prefix_tokens: int        # of the prefix kept (its end)
    suffix_tokens: int        # of the suffix kept (its start)
    extra_tokens: int         # of the repository context kept (its end)
    truncated: bool           # something was cut to fit


def extra_ids(tokenizer, fim: FimTokens, extra: list[tuple[str, str]]) -> list[int]:
    """The repository context: the repository's name, each (filename, text) chunk after a file
    separator, and the current file's separator last (llama.cpp's pattern)."""
    out: list[int] = []
    if fim.rep is not None:
        out += [fim.rep] + text_ids(tokenizer, REPO)
    for filename, text in extra:
        if fim.sep is not None:
            out += [fim.sep] + text_ids(tokenizer, (filename or "tmp") + "\n")
        else:
            out += text_ids(tokenizer, CHUNK_SEPARATOR)
        out += text_ids(tokenizer, text)
    if fim.sep is not None:
        out += [fim.sep] + text_ids(tokenizer, FILENAME)
    return out


def build(tokenizer, prefix: str, suffix: str, line: str = "", extra: list[tuple[str, str]] = (),
          n_predict: int = 0, n_ctx: int | None = None, n_batch: int | None = None) -> FimPrompt:
    """The FIM prompt's ids, cut as llama.cpp's server cuts them: the prefix's last 3/4 of a batch,
    the suffix's first quarter (``suffix_share``), the repository context's end in what the
    context leaves after a batch and twice the tokens to predict (``n_batch`` None: ``batch_for``).
    NoFim without FIM tokens."""
    fim = find_tokens(tokenizer)
    n_batch = batch_for(n_ctx) if n_batch is None else n_batch
    pre, suf, cur = text_ids(tokenizer, prefix), text_ids(tokenizer, suffix), text_ids(tokenizer, line)
    ext = extra_ids(tokenizer, fim, list(extra))
    n_pre = min(len(pre), 3 * (n_batch // 4))
    n_suf = min(len(suf), suffix_share(n_batch))
    room = len(ext) if n_ctx is None else max(0, n_ctx - n_batch - 2 * max(0, n_predict))
    n_ext = min(room, len(ext))
    bos = _bos(tokenizer)
    ids = (ext[len(ext) - n_ext:] + bos + [fim.pre] + pre[len(pre) - n_pre:] + [fim.suf] + suf[:n_suf]
           + [fim.mid] + cur)
    return FimPrompt(ids, n_pre, n_suf, n_ext, n_pre < len(pre) or n_suf < len(suf) or n_ext < len(ext))


def split_blanks(line: str) -> tuple[str, str]:
    """(the current line without its trailing spaces and tabs, those blanks). The blanks stay out of
    the prompt: after the middle token the model never saw a lone space token (BPE joins a space to
    the next word), so "    return " reads as a request for " a + b", not "a + b". The answer loses
    as much of them from its start (``heal``); a keystroke that types a space changes no prompt."""
    body = line.rstrip(" \t")
    return body, line[len(body):]


def heal(text: str, blanks: str) -> str:
    """The answer without the blanks the line held back (as many of them as it starts with)."""
    n = 0
    while n < len(blanks) and n < len(text) and text[n] == blanks[n]:
        n += 1
    return text[n:]


def suffix_share(n_batch: int) -> int:
    """The suffix's tokens: a quarter of the batch less the two FIM tokens. llama.cpp also takes
    the current line's length off it; here the line sits after the middle token and a keystroke
    must leave the suffix as it was, so the prefix cache reuses everything up to the line."""
    return max(0, n_batch // 4 - 2)


def batch_for(n_ctx: int | None) -> int:
    """The batch whose shares ``build`` cuts to: llama-server's 2048, at most a quarter of the
    context (a small model's repository context keeps room)."""
    return N_BATCH if n_ctx is None else max(16, min(N_BATCH, n_ctx // 4))


def _bos(tokenizer) -> list[int]:
    """A BOS in front of the FIM prefix where the tokenizer adds one to every text."""
    b = getattr(tokenizer, "bos_token_id", None)
    return [b] if b is not None and getattr(tokenizer, "add_bos_token", False) else []


# ----------------------------------------------------------------------------- llama.cpp's line rules
class LineRules:
    """Where an editor's completion ends, as llama.cpp's server decides it token by token: a line
    after the first indented less than ``n_indent`` is cut before its first non-blank character;
    past ``t_max_ms`` of generation, the next token with a newline is the last. ``push(piece, ms)``
    takes one token's text and the generation's milliseconds so far; it returns False once the
    completion has ended (``text`` is then final, ``why`` says which rule ended it)."""

    def __init__(self, n_indent: int = 0, t_max_ms: float = 0.0):
        self.n_indent, self.t_max_ms = n_indent, t_max_ms
        self.text = ""
        self.has_new_line = False
        self.last_nl = 0
        self.why = ""

    def push(self, piece: str, ms: float) -> bool:
        if self.why:
            return False
        self.text += piece
        if self.has_new_line and self.n_indent > 0:
            if self._indent_short():
                return False
            nl = self.text.find("\n", self.last_nl)
            if nl >= 0:
                self.last_nl = nl + 1
        if "\n" in piece:
            self.has_new_line = True
            if self.t_max_ms > 0 and ms > self.t_max_ms:
                self.why = "time"
                return False
        return True

    def _indent_short(self) -> bool:
        """The current line (after the first) has text and less indentation than n_indent: cut it."""
        if self.last_nl <= 0:
            return False
        pos = self.last_nl
        while pos < len(self.text) and self.text[pos] in " \t":
            pos += 1
        if pos < len(self.text) and pos - self.last_nl < self.n_indent:
            self.text = self.text[:pos]
            self.why = "indent"
            return True
        return False
