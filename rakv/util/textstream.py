"""Token ids -> text, incrementally, as the engine commits them (what streaming prints).

Decoding each new id alone goes wrong: a multi-byte character can span several byte-level tokens
(its first pieces decode to U+FFFD), and some tokenizers decode a token differently at the start
of a text (SentencePiece's leading space). So the text is decoded over a window: the new suffix
is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, and it is held back while it ends in
U+FFFD (an incomplete character); once it is written the window moves on. The pieces written,
joined, are the text of all the ids (``finish`` writes what was held back).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed ids as they are committed; each ``push`` returns the text that is now certain."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0          # the window starts here
        self.read = 0            # ids up to here are written
        self.written: list[str] = []

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids) -> str:
        """Add committed ids; the text they complete ("" while a character is still incomplete)."""
        self.ids.extend(int(i) for i in ids)
        if self.tok is None or len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT) or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.written.append(piece)
        return piece

    def finish(self) -> str:
        """The rest (also an incomplete character, as U+FFFD): the request has ended."""
        if self.tok is None or len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        piece = now[len(before):] if now.startswith(before) else now
        self.prefix = self.read = len(self.ids)
        if piece:
            self.written.append(piece)
        return piece

    def text(self) -> str:
        return "".join(self.written)
