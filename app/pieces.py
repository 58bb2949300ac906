"""Token id -> display text ("pieces").

Live, pieces come from the target's tokenizer. Recordings hold only ids, so the worker writes a
small sidecar ``<recording>.pieces.json`` (id -> text) after each request; a replay reads it and
falls back to ``<id>`` for ids it does not know.
"""

from __future__ import annotations

import json
from pathlib import Path

from rakv.util.text_in import load_json


def sidecar(recording: str | Path) -> Path:
    p = Path(recording)
    return p.with_name(p.stem + ".pieces.json")


def piece_text(tokenizer, tid: int) -> str:
    try:
        return tokenizer.decode([int(tid)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception:  # noqa: BLE001
        return f"<{tid}>"


def save_pieces(recording: str | Path, tokenizer, ids) -> None:
    table = {str(i): piece_text(tokenizer, i) for i in sorted(set(ids))}
    out = sidecar(recording)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, ensure_ascii=False), encoding="utf-8")
    tmp.replace(out)


def load_pieces(recording: str | Path) -> dict[int, str]:
    try:
        d = load_json(sidecar(recording).read_bytes())
        return {int(k): str(v) for k, v in d.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


class Pieces:
    """A cached id -> text lookup over an optional tokenizer and an optional table."""

    def __init__(self, tokenizer=None, table: dict[int, str] | None = None):
        self.tokenizer = tokenizer
        self.table = dict(table or {})

    def __call__(self, tid: int) -> str:
        s = self.table.get(tid)
        if s is None:
            s = piece_text(self.tokenizer, tid) if self.tokenizer is not None else f"<{tid}>"
            self.table[tid] = s
        return s
