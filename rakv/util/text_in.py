"""Text and JSON from outside the program (argv, stdin, files, a server's request bodies): checked
once here, the same way wherever it comes from.

The rule for text (docs/engine.md#text-from-outside): a prompt or chat line must be valid Unicode.
Invalid UTF-8 bytes (on argv Python keeps them as U+DC80..U+DCFF, "surrogateescape") and lone
surrogates (e.g. a JSON string's ``"\\ud800"``) are **refused** with one line that names where they
are (the argument, the file and line, stdin's line) and the character; nothing is replaced. A
replacement character would change the prompt's ids silently (and with them its prefix-cache hits
and its recording); a refusal lets the user fix the input.

The rule for JSON: ``load_json`` refuses what the decoder cannot take (nested deeper than the
recursion limit: a ``RecursionError`` there) and anything nested deeper than ``MAX_DEPTH`` levels,
with a ``ValueError``: every reader of a file the project reads reports it as that file's damage.

The bottom of the import graph (it imports nothing of the project).
"""

from __future__ import annotations

import json

MAX_DEPTH = 64      # no file the project reads nests deeper than 6 levels


class TextError(ValueError):
    """Text that is not valid Unicode; the message names where it came from."""


def text_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (None when it is): its first undecodable byte or lone
    surrogate, by character position (1-based)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        at = e.start
    cp = ord(text[at])
    if 0xDC80 <= cp <= 0xDCFF:
        return f"invalid UTF-8 (byte 0x{cp - 0xDC00:02x}) at character {at + 1}"
    return f"a lone surrogate U+{cp:04X} at character {at + 1}"


def checked_text(text: str, where: str) -> str:
    """``text`` itself when it is valid Unicode; else TextError "<where>: not valid text: ..."."""
    why = text_problem(text)
    if why:
        raise TextError(f"{where}: not valid text: {why} (invalid input is refused, not replaced)")
    return text


def decode_utf8(data: bytes, where: str) -> str:
    """Bytes -> text, strictly as UTF-8 (a leading BOM dropped); TextError naming the byte offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{where}: not valid text: invalid UTF-8 (byte 0x{data[e.start]:02x}) at byte "
                        f"{e.start + 1} (invalid input is refused, not replaced)") from None
    return text[1:] if text.startswith("\ufeff") else text


def decode_file(data: bytes, where: str) -> str:
    """A file's bytes -> its text, strictly as UTF-8 (a leading BOM dropped); TextError naming
    ``where:LINE`` and the byte."""
    try:
        return decode_utf8(data, where)
    except TextError:
        pass
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
    line = data.count(b"\n", 0, at) + 1
    col = at - (data.rfind(b"\n", 0, at) + 1) + 1
    raise TextError(f"{where}:{line}: not valid text: invalid UTF-8 (byte 0x{data[at]:02x}) at byte {col} of the "
                    "line (invalid input is refused, not replaced)") from None


def json_depth(obj) -> int:
    """How deeply a decoded JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        elif not isinstance(x, list):
            continue
        deepest = max(deepest, d + 1)
        if d + 1 > MAX_DEPTH:
            return d + 1
        stack.extend((y, d + 1) for y in x if isinstance(y, (list, dict)))
    return deepest


def load_json(text: str | bytes, max_depth: int = MAX_DEPTH):
    """``json.loads``, with a ValueError (not a RecursionError) for anything nested deeper than
    ``max_depth`` levels."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    if json_depth(obj) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return obj


def json_strings_problem(obj) -> str | None:
    """The first string (key or value) in a decoded JSON value that is not valid Unicode (a lone
    surrogate from a ``\\ud800`` escape), as text_problem says; None when all are."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            why = text_problem(x)
            if why:
                return why
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None
