"""The chat transcript (no Qt): each request as the user's text and the answer, as the Chat tab shows
them and as a conversation is exported (Markdown, JSON).

Built from plain records only (``SessionState.exchanges``: ``RequestStart.prompt`` is the user's text
as typed, ``RequestEnd.text`` the answer with special tokens skipped), so a replay gives the same
transcript as the live run. With the template shown, the prompt is the ids actually fed
(``RequestStart.prompt_ids``: system prompt, role markers, special tokens) and the answer its ids,
both as token pieces.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from app.state import Exchange

FORMAT = "rakv-transcript"
VERSION = 1
# pieces that are special tokens of the common chat templates (<|im_end|>, <|eot_id|>, <s>, </s>,
# <end_of_turn>, ...): hidden from a running answer unless the template is shown (a finished answer
# is RequestEnd.text, decoded with the tokenizer's own list of special tokens skipped)
SPECIAL = re.compile(r"^\s*(<\|[^<>|]{1,40}\|>|</?s>|<(start|end)_of_turn>|<unk>|<pad>|\[/?INST\])\s*$")


@dataclass
class Message:
    role: str                    # "user" or "assistant"
    content: str
    request_id: int
    conversation: int | None = None
    turn: int | None = None
    done: bool = True
    tokens: int = 0
    latency_ms: float | None = None
    stopped: str = ""


def is_special(piece: str) -> bool:
    return bool(SPECIAL.match(piece))


def joined(ids, pieces, keep_special: bool) -> str:
    return "".join(p for p in (pieces(i) for i in ids) if keep_special or not is_special(p))


def user_text(ex: Exchange, pieces, show_template: bool = False) -> str:
    """The user's message: as typed, or (template shown) the whole prompt as fed."""
    if show_template:
        return joined(ex.prompt_ids, pieces, True)
    return ex.prompt


def answer_text(ex: Exchange, pieces, show_template: bool = False) -> str:
    """The answer: RequestEnd.text once done (special tokens skipped), else the pieces so far."""
    if show_template:
        return joined(ex.output_ids, pieces, True)
    if ex.text is not None:
        return ex.text
    return joined(ex.output_ids, pieces, False)


def messages(exchanges: list[Exchange], pieces, show_template: bool = False) -> list[Message]:
    out = []
    for ex in exchanges:
        out.append(Message("user", user_text(ex, pieces, show_template), ex.request_id, ex.conversation, ex.turn))
        out.append(Message("assistant", answer_text(ex, pieces, show_template), ex.request_id, ex.conversation,
                           ex.turn, ex.done, len(ex.output_ids), ex.latency_ms, ex.stopped))
    return out


def last_answer(exchanges: list[Exchange], pieces) -> str | None:
    """The latest answer (finished, or as far as it got): what Copy answer copies."""
    return answer_text(exchanges[-1], pieces) if exchanges else None


def groups(exchanges: list[Exchange]) -> list[tuple[str, list[Exchange]]]:
    """Consecutive turns of one conversation together; a request outside conversations alone."""
    out: list[tuple[str, list[Exchange]]] = []
    for ex in exchanges:
        if ex.conversation is not None and out and out[-1][1][-1].conversation == ex.conversation:
            out[-1][1].append(ex)
        else:
            title = (f"Conversation {ex.conversation}" if ex.conversation is not None else f"Request {ex.request_id}")
            out.append((title, [ex]))
    return out


def to_json(exchanges: list[Exchange], pieces, meta: dict | None = None, show_template: bool = False) -> str:
    """{"format", "version", "exported", "models", "conversations": [{"title", "conversation",
    "messages": [{"role", "content", "request_id", ...}]}]} (messages as chat APIs take them)."""
    convs = []
    for title, exs in groups(exchanges):
        msgs = []
        for m in messages(exs, pieces, show_template):
            d = {"role": m.role, "content": m.content, "request_id": m.request_id}
            if m.turn is not None:
                d["turn"] = m.turn
            if m.role == "assistant":
                d.update({"tokens": m.tokens, "latency_ms": m.latency_ms, "stopped": m.stopped or None,
                          "complete": m.done})
            msgs.append(d)
        convs.append({"title": title, "conversation": exs[0].conversation, "messages": msgs})
    doc = {"format": FORMAT, "version": VERSION, "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "template_shown": show_template, **(meta or {}), "conversations": convs}
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def to_markdown(exchanges: list[Exchange], pieces, meta: dict | None = None, show_template: bool = False) -> str:
    meta = meta or {}
    models = meta.get("models") or {}
    head = ["# RAKV Explorer transcript", ""]
    if models:
        head.append(f"*{models.get('target', '?')} + draft {models.get('draft', '?')}, exported "
                    f"{time.strftime('%Y-%m-%d %H:%M')}*")
        head.append("")
    body = []
    for title, exs in groups(exchanges):
        body += [f"## {title}", ""]
        for m in messages(exs, pieces, show_template):
            if m.role == "user":
                body += ["**User**" + (f" (turn {m.turn})" if m.turn else ""), ""]
            else:
                info = f"{m.tokens} tokens" + (f", {m.latency_ms:.0f} ms" if m.latency_ms is not None else "")
                info += f", {m.stopped}" if m.stopped else (", incomplete" if not m.done else "")
                body += [f"**Assistant** ({info})", ""]
            body += [fence(m.content) if show_template else (m.content.strip() or "*(empty)*"), ""]
    return "\n".join(head + body)


def fence(text: str) -> str:
    """Verbatim text (template shown: markers and special tokens) in a fence longer than any inside."""
    n = max([3] + [len(r) + 1 for r in re.findall(r"`{3,}", text)])
    return f"{'`' * n}\n{text}\n{'`' * n}"
