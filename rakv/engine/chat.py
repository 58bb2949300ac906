"""Conversations: the messages so far, the ids fed so far, and each new turn's ids (Qt-free).

A turn's prompt is the whole conversation through the chat template, generation prompt added. The
previous turn left its prompt and its answer in the prefix cache (``EncodedPrompt.keep_answer``:
the engine stores the KV of prompt + answer after the request), so the next turn should start with
exactly those ids. Re-templating the conversation from text would re-tokenize the decoded answer,
which can give other ids than the model produced and cut the hit short. So the next turn's ids are
built by APPENDING to the previous ids: previous prompt ids + the answer's ids as generated + the
ids of what the template writes after the answer (its end-of-turn, the new user message, the
generation prompt).

Appending is checked against the template every turn: the template must render the conversation
as the previous rendering + the answer + a suffix (a template that rewrites earlier turns, e.g.
one that drops an earlier answer's reasoning, does not), and the appended ids must decode to the
same text as the template applied to the whole conversation. When either fails the turn falls
back to the template's own ids (``ids_from = "template"``, with the reason). ``same_as_template``
records whether the appended ids are also identical to the template's; they differ only where the
model's ids are another tokenization of the same text.

Without a chat template (or raw) the conversation is plain text: each user message on a new line
after the previous answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..util.ids import lcp
from ..prompts import EncodedPrompt, _as_ids, has_chat_template, raw_ids, template_prefix

RAW_SEPARATOR = "\n"     # raw conversations: each user message on a new line after the answer


@dataclass
class Turn:
    """One finished turn."""

    user: str
    answer: str
    prompt_ids: list[int]
    output_ids: list[int]
    ids_from: str              # "first" | "append" | "template"
    stopped: str = ""


@dataclass
class Conversation:
    """Messages and ids of one conversation; ``prepare`` builds a turn, ``commit`` keeps its answer."""

    tokenizer: object
    eos_ids: frozenset = frozenset()
    raw: bool = False          # True: plain text turns (also when the tokenizer has no template)
    number: int = 1            # which conversation of a session (``reset`` counts up)
    turns: list[Turn] = field(default_factory=list)
    _pending: tuple | None = None

    @classmethod
    def for_engine(cls, engine, **kw) -> "Conversation":
        """A conversation over an engine's target tokenizer, EOS ids and chat-template switch."""
        return cls(engine.target.tokenizer, frozenset(engine.target.eos_ids), raw=not engine.chat_template, **kw)

    # ------------------------------------------------------------------ state
    @property
    def templated(self) -> bool:
        return not self.raw and has_chat_template(self.tokenizer)

    @property
    def ids(self) -> list[int]:
        """The conversation so far as fed: the last turn's prompt ids and its answer's ids."""
        if not self.turns:
            return []
        t = self.turns[-1]
        return t.prompt_ids + t.output_ids

    def messages(self, user: str | None = None) -> list[dict]:
        msgs = []
        for t in self.turns:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def reset(self) -> None:
        """Start a new conversation (the prefix cache keeps what it holds)."""
        self.turns = []
        self._pending = None
        self.number += 1

    # ------------------------------------------------------------------ one turn
    def prepare(self, text: str) -> EncodedPrompt:
        """The next turn's ids for the user message ``text`` (appended where the template allows)."""
        from ..util.text_in import checked_text

        if not checked_text(text, "message").strip():
            raise ValueError("empty message")
        whole = self._whole(text)
        ids, why = whole, ""
        if self.turns:
            appended, why = self._appended(text, whole)
            ids = whole if appended is None else appended
        same = ids == whole
        info = {"conversation": self.number, "turn": len(self.turns) + 1,
                "ids_from": "first" if not self.turns else ("template" if why else "append"),
                "previous_tokens": len(self.ids),          # the conversation before this turn, as fed
                "kept_tokens": lcp(ids, self.ids),         # of which this turn's ids start with
                "same_as_template": same,                  # ids == the template over the whole conversation
                "first_diff": -1 if same else lcp(ids, whole), "reason": why}
        S = lcp(ids, template_prefix(self.tokenizer)) if self.templated else 0
        enc = EncodedPrompt(list(ids), self.templated, S, conversation=info, keep_answer=True)
        self._pending = (text, enc)
        return enc

    def commit(self, output_ids: list[int], stopped: str = "") -> Turn:
        """The answer of the prepared turn (also a stopped one: it stays in the conversation)."""
        if self._pending is None:
            raise ValueError("no turn prepared")
        text, enc = self._pending
        self._pending = None
        out = [int(x) for x in output_ids]
        turn = Turn(text, self._text(self._body(out)), list(enc.ids), out, enc.conversation["ids_from"], stopped)
        self.turns.append(turn)
        return turn

    def abandon(self) -> None:
        """The prepared turn failed: the conversation stays as it was."""
        self._pending = None

    # ------------------------------------------------------------------ building ids
    def _whole(self, text: str) -> list[int]:
        """The whole conversation with the new message, encoded afresh (template or raw text)."""
        if self.templated:
            return _as_ids(self.tokenizer.apply_chat_template(self.messages(text), add_generation_prompt=True,
                                                              tokenize=True))
        return raw_ids(self.tokenizer, self._raw_text(text))

    def _raw_text(self, text: str) -> str:
        parts = []
        for t in self.turns:
            parts += [t.user, t.answer, RAW_SEPARATOR]
        return "".join(parts) + text

    def _render(self, msgs: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def _body(self, out: list[int]) -> list[int]:
        """The answer's ids without a final EOS token (the template writes its own end of turn)."""
        return out[:-1] if out and out[-1] in self.eos_ids else out

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _exact_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _appended(self, text: str, whole: list[int]) -> tuple[list[int] | None, str]:
        """Previous ids + the answer as generated + the template's suffix; (None, why) if not allowed."""
        last = self.turns[-1]
        if self.templated:
            before = self._render(self.messages()[:-1])          # the previous turn's prompt, as text
            after = self._render(self.messages(text))
            head = before + last.answer
            if not after.startswith(head):
                return None, "the chat template renders the earlier turns differently once a turn is added"
            suffix = after[len(head):]
        else:
            suffix = RAW_SEPARATOR + text
        tail = list(self.tokenizer(suffix, add_special_tokens=False)["input_ids"])
        out = last.output_ids
        if out and out[-1] in self.eos_ids:
            if tail[:1] == out[-1:]:
                tail = tail[1:]              # the model's EOS is the template's end of turn: keep it
            else:
                out = out[:-1]               # an EOS the template does not write
        appended = last.prompt_ids + out + tail
        if appended != whole and self._exact_text(appended) != self._exact_text(whole):
            return None, "the appended ids decode to other text than the templated conversation"
        return appended, ""


def run_turn(engine, conversation: Conversation, text: str, max_new_tokens: int | None = None):
    """One user turn on ``engine``: prepare, generate, commit. Returns the RequestEnd."""
    enc = conversation.prepare(text)
    try:
        end = engine.generate(enc, max_new_tokens, prompt_text=text)
    except BaseException:
        conversation.abandon()
        raise
    if end.stopped == "error":
        conversation.abandon()
    else:
        conversation.commit(end.output_ids, end.stopped)
    return end
