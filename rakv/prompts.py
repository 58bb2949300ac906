"""Prompt text -> the token ids actually fed to the model (Qt-free, no model needed).

By default a prompt goes through the tokenizer's chat template as one user turn with the
generation prompt added (``apply_chat_template``), when the tokenizer has a template: an instruct
model then answers instead of continuing the text. ``raw=True`` (``--raw``, the explorer's "Raw
prompt" box) sends the text as it is: the plain encoding, with a BOS token in front when the
tokenizer asks for one (``add_bos_token``). A template brings its own special tokens, so nothing
is added to it.

Every templated prompt starts with the same tokens (the template's system prompt and the user-turn
header): ``template_prefix`` is that shared prefix's length for this prompt, found as the longest
common prefix of the template applied to two unrelated probe texts. The prefix cache sees it as a
partial hit on every templated request; the explorer's cache panel says how much of a hit it is.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .util.ids import lcp
from .util.text_in import checked_text

# two unrelated user texts: their templated ids agree on the template's shared prefix only
_PROBES = ("Hello.", "42 + 7 = ?")


@dataclass(frozen=True)
class EncodedPrompt:
    ids: list[int]             # the ids fed to the model
    templated: bool            # True: the chat template was applied
    template_prefix: int = 0   # leading ids that every templated prompt shares (system prompt, headers)
    conversation: dict | None = None   # a conversation's turn (rakv.engine.chat): how these ids were built
    keep_answer: bool = False  # store prompt + answer KV after the request (the next turn starts with them)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_notice(tokenizer, chat_template: bool = True, name: str = "the model") -> str:
    """One line when the chat template was asked for (the default) but the tokenizer has none, so
    prompts go in as raw text (a base model then continues the text rather than answering); "" else."""
    if not chat_template or tokenizer is None or has_chat_template(tokenizer):
        return ""
    return (f"{name} has no chat template: prompts are sent as raw text (a base model continues the text, "
            "it does not answer; pass --raw to silence this)")


def _as_ids(out) -> list[int]:
    """apply_chat_template's result (a list, or a BatchEncoding / dict in transformers 5) -> ids."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):        # a batch of one
        out = out[0]
    return [int(x) for x in out]


def chat_ids(tokenizer, text: str) -> list[int]:
    """The chat template applied to one user turn, generation prompt added."""
    return _as_ids(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True))


def raw_ids(tokenizer, text: str) -> list[int]:
    """The text as it is; a BOS token in front when the tokenizer asks for one."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if getattr(tokenizer, "bos_token_id", None) is not None and getattr(tokenizer, "add_bos_token", False):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def template_prefix(tokenizer) -> list[int]:
    """The ids every templated prompt of this tokenizer starts with ([] without a template)."""
    if not has_chat_template(tokenizer):
        return []
    key = getattr(tokenizer, "chat_template", None)
    i = id(tokenizer)
    hit = _PREFIXES.get(i)
    if hit is not None and hit[0]() is tokenizer and hit[1] == key:
        return hit[2]
    a, b = (chat_ids(tokenizer, p) for p in _PROBES)
    prefix = a[:lcp(a, b)]
    try:
        ref = weakref.ref(tokenizer, lambda _r, i=i: _PREFIXES.pop(i, None))
    except TypeError:               # a tokenizer that cannot be referred to weakly just recomputes
        return prefix
    _PREFIXES[i] = (ref, key, prefix)
    return prefix


# each tokenizer's template prefix, by id: (a weak reference to it, its chat template, the prefix);
# an entry leaves when its tokenizer does, and nothing is set on the tokenizer
_PREFIXES: dict[int, tuple] = {}


def encode_prompt(tokenizer, text: str, raw: bool = False) -> EncodedPrompt:
    """Prompt text -> the ids to feed: chat template unless ``raw`` or the tokenizer has none.
    Text that is not valid Unicode is refused (``rakv.util.text_in.TextError``, a ValueError)."""
    checked_text(text, "prompt")
    if raw or not has_chat_template(tokenizer):
        return EncodedPrompt(raw_ids(tokenizer, text), False, 0)
    ids = chat_ids(tokenizer, text)
    return EncodedPrompt(ids, True, lcp(ids, template_prefix(tokenizer)))
