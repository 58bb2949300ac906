"""The OpenAI-style HTTP API's shapes (Qt-free, no I/O): request bodies checked into an ``Ask``,
and the JSON objects of responses, stream chunks and errors.

Only what changes the output is checked strictly: ``n`` (1 only), ``temperature``, ``top_p``,
``seed``, ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``stream``, and the messages or
the prompt; ``top_k`` and ``min_p`` are taken as extensions. A field that asks for something the
engine does not do (several choices, log-probabilities, ``echo``, tools) is refused with a 400;
anything else a client sends (``user``, ``model``, penalties at 0, ...) is ignored. A completion's
``suffix`` asks for the middle between the prompt and it (``rakv.fim``).

``parse_infill`` reads llama.cpp server's ``POST /infill`` as editors send it (llama.vim,
llama.vscode): ``input_prefix``, ``input_suffix``, ``input_extra``, ``prompt`` (the current line),
``n_predict`` (0: only fill the cache), ``n_indent``, ``t_max_predict_ms``, ``response_fields``;
``infill_response`` writes llama.cpp's answer (``content``, ``tokens_cached``, ``timings``, ...).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 16
ROLES_SYSTEM = ("system", "developer")


class ApiError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = dict(headers or {})          # extra response headers (429: Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Ask:
    """One checked request: a chat (``messages``) or a completion (``prompt``)."""

    chat: bool
    messages: list[dict] = field(default_factory=list)   # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None                # completion: text, or token ids
    stream: bool = False
    max_tokens: int | None = None      # None: the server's --max-new-tokens
    temperature: float | None = None   # None: the server's sampling flags
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    model: str = ""
    fim: "Fim | None" = None           # fill in the middle (/infill, or a completion's suffix)
    infill: bool = False               # llama.cpp's /infill: its response shape


@dataclass
class Fim:
    """What to fill: the text before the cursor, after it, the current line up to the cursor, the
    repository's other chunks [(filename, text)], and llama.cpp's line rules."""

    prefix: str
    suffix: str
    line: str = ""
    extra: list[tuple[str, str]] = field(default_factory=list)
    n_indent: int = 0
    t_max_ms: float = 0.0
    fields: list[str] = field(default_factory=list)     # response_fields: only these paths


# ----------------------------------------------------------------------------- reading a request
def parse_ask(body, chat: bool) -> Ask:
    """A request body (parsed JSON) -> Ask; ApiError(400) naming the field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    a = Ask(chat=chat)
    a.model = body.get("model") if isinstance(body.get("model"), str) else ""
    if chat:
        a.messages = _messages(body.get("messages"))
    else:
        a.prompt = _prompt(body.get("prompt"))
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, f"n must be 1 (this server returns one choice a request), got {n!r}", "n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1", "best_of")
    if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is not supported", "echo")
    suffix = body.get("suffix")
    if suffix is not None:
        if chat or not isinstance(suffix, str):
            raise ApiError(400, "suffix must be a string (on /v1/completions)", "suffix")
        if not isinstance(a.prompt, str):
            raise ApiError(400, "a suffix needs the prompt as text, not token ids", "prompt")
        if suffix:
            a.fim = Fim(prefix=a.prompt, suffix=suffix)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "log-probabilities are not supported", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools are not supported", "tools")
    for pen in ("presence_penalty", "frequency_penalty"):
        v = body.get(pen)
        if v not in (None, 0, 0.0):
            raise ApiError(400, f"{pen} is not supported (only 0)", pen)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    a.stream = bool(stream)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        if not _is_int(mt) or mt < 1:
            raise ApiError(400, f"max_tokens must be an integer >= 1, got {mt!r}", "max_tokens")
        a.max_tokens = int(mt)
    _sampling_fields(body, a)
    a.stop = _stops(body.get("stop"))
    return a


def parse_infill(body) -> Ask:
    """llama.cpp server's /infill body -> Ask (``fim`` set, ``infill`` True); ApiError(400), one line.
    ``n_predict`` (or ``max_tokens``) < 0: the server's --max-new-tokens; 0: a warm-up that only fills
    the cache. Accepted and not used: ``cache_prompt`` (the prefix cache always keeps the prompt),
    ``samplers``, ``t_max_prompt_ms``, ``id_slot``."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise ApiError(400, f"\"{name}\" is required", name)
        if not isinstance(body[name], str):
            raise ApiError(400, f"\"{name}\" must be a string", name)
    line = body.get("prompt", "")
    if not isinstance(line, str):
        raise ApiError(400, "\"prompt\" must be a string (the current line up to the cursor)", "prompt")
    extra = body.get("input_extra", [])
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise ApiError(400, "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}", "input_extra")
    chunks = []
    for i, c in enumerate(extra):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise ApiError(400, f"input_extra[{i}] must have a \"text\" string", "input_extra")
        if not isinstance(c.get("filename", ""), str):
            raise ApiError(400, f"input_extra[{i}].filename must be a string", "input_extra")
        chunks.append((c.get("filename") or "tmp", c["text"]))
    fields = body.get("response_fields", [])
    if fields is None:
        fields = []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise ApiError(400, "response_fields must be a list of strings", "response_fields")
    if body.get("stream") not in (None, False):
        raise ApiError(400, "stream is not supported on /infill (send \"stream\": false)", "stream")
    a = Ask(chat=False, prompt=body["input_prefix"] + line, infill=True)
    a.model = body.get("model") if isinstance(body.get("model"), str) else ""
    n = body.get("n_predict", body.get("max_tokens"))
    if n is not None:
        if not _is_int(n):
            raise ApiError(400, f"n_predict must be an integer, got {n!r}", "n_predict")
        a.max_tokens = int(n) if n >= 0 else None
    ind = body.get("n_indent", 0)
    if ind is None:
        ind = 0
    if not _is_int(ind) or ind < 0:
        raise ApiError(400, f"n_indent must be an integer >= 0, got {ind!r}", "n_indent")
    t_max = _number(body, "t_max_predict_ms", lo=0.0) or 0.0
    a.fim = Fim(body["input_prefix"], body["input_suffix"], line, chunks, int(ind), t_max, list(fields))
    _sampling_fields(body, a, random_seed=-1)        # (llama.cpp's seed -1: a random seed)
    a.stop = _stops(body.get("stop"))
    return a



def _sampling_fields(body: dict, a: Ask, random_seed: int | None = None) -> None:
    """The sampling fields both request kinds take into ``a``; a seed equal to ``random_seed`` is
    none (the server's flags draw one)."""
    a.temperature = _number(body, "temperature", lo=0.0)
    a.top_p = _number(body, "top_p", lo=0.0)
    a.min_p = _number(body, "min_p", lo=0.0)
    tk = body.get("top_k")
    if tk is not None:
        if not _is_int(tk) or tk < 0:
            raise ApiError(400, f"top_k must be an integer >= 0, got {tk!r}", "top_k")
        a.top_k = int(tk)
    seed = body.get("seed")
    if seed is not None and (random_seed is None or seed != random_seed):
        if not _is_int(seed):
            raise ApiError(400, f"seed must be an integer, got {seed!r}", "seed")
        a.seed = int(seed)

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, lo: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ApiError(400, f"{name} must be a finite number >= {lo:g}, got {v!r}", name)
    return float(v)


def _stops(v) -> list[str]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings", "stop")
    return [s for s in items if s]


def _content(c, i: int) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string", "messages")


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role {role!r} is not supported "
                                "(system, developer, user, assistant)", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    if not out[-1]["content"].strip():
        raise ApiError(400, "the last user message is empty", "messages")
    return out


def _prompt(v) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]                        # a batch of one
    if isinstance(v, str):
        if not v.strip():
            raise ApiError(400, "prompt is empty", "prompt")
        return v
    if isinstance(v, list) and v and all(_is_int(x) for x in v):
        return [int(x) for x in v]
    if isinstance(v, list) and len(v) > 1:
        raise ApiError(400, "one prompt a request (a batch of prompts is not supported)", "prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")


def split_conversation(messages: list[dict]):
    """(system messages, [(user, assistant), ...], last user text) when the messages are leading
    system messages and then user / assistant turns in order, ending with a user message; else None."""
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        i += 1
    system, rest = messages[:i], messages[i:]
    if len(rest) % 2 != 1:
        return None
    pairs = []
    for j in range(0, len(rest) - 1, 2):
        u, a = rest[j], rest[j + 1]
        if u["role"] != "user" or a["role"] != "assistant":
            return None
        pairs.append((u["content"], a["content"]))
    return system, pairs, rest[-1]["content"]


# ----------------------------------------------------------------------------- writing responses
FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length"}


def finish_reason(stopped: str, stop_hit: bool) -> str:
    return "stop" if stop_hit else FINISH.get(stopped, "stop")


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(ask: Ask, rid: str, model: str, text: str, finish: str, use: dict, rakv: dict) -> dict:
    """The non-streamed response object."""
    if ask.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if ask.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "rakv": rakv}


def chunk(ask: Ask, rid: str, model: str, text: str | None, finish: str | None = None, first: bool = False,
          **extra) -> dict:
    """One streamed chunk: a piece of text, the first (the role, for a chat), or the last (finish
    reason, usage and the rakv object in ``extra``)."""
    if ask.chat:
        delta = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], **extra}


def cut_at_stops(text: str, stops: list[str]) -> str:
    """``text`` before the first of ``stops`` (all of it when none occurs)."""
    at = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(at)] if at else text


STOP_TYPE = {"eos": "eos", "fim_end": "eos", "stop_string": "word", "warm": "none"}


def infill_response(model: str, content: str, *, stopped: str, prompt_tokens: int, cache_n: int,
                    predicted_n: int, prompt_ms: float, predicted_ms: float, truncated: bool,
                    settings: dict, rakv: dict, fields: list[str]) -> dict:
    """llama.cpp server's answer to /infill (its non-OpenAI completion object); with
    ``response_fields``, only those paths ("timings/prompt_n"), each under its path as the key.
    ``tokens_cached``: the prompt tokens the prefix cache now holds for the next request."""
    pn = prompt_tokens - cache_n
    timings = {"cache_n": cache_n, "prompt_n": pn, "prompt_ms": prompt_ms,
               "prompt_per_token_ms": prompt_ms / pn if pn else 0.0,
               "prompt_per_second": 1e3 * pn / prompt_ms if prompt_ms > 0 else 0.0,
               "predicted_n": predicted_n, "predicted_ms": predicted_ms,
               "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
               "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0}
    out = {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": model,
           "tokens_predicted": predicted_n, "tokens_evaluated": prompt_tokens, "generation_settings": settings,
           "has_new_line": "\n" in content, "truncated": truncated, "stop_type": STOP_TYPE.get(stopped, "limit"),
           "stopping_word": "", "tokens_cached": prompt_tokens, "timings": timings, "rakv": rakv}
    return pick_fields(out, fields) if fields else out


def pick_fields(obj: dict, paths: list[str]) -> dict:
    """llama.cpp's response_fields: each path ("a/b") that exists, its value under the path."""
    out = {}
    for path in paths:
        cur, ok = obj, True
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "rakv"}


# ----------------------------------------------------------------------------- a client's side
def user_url(text: str, schemes: tuple = ("http",), verb: str = "attached"):
    """A server address a user typed, split (``urllib.parse.SplitResult``): ``host:port`` alone is
    taken as http; a scheme outside ``schemes``, a bad port or no host: ValueError, one line."""
    from urllib.parse import urlsplit

    t = (text or "").strip()
    if not t:
        raise ValueError("no server URL given (e.g. http://127.0.0.1:8000)")
    if "://" not in t:
        t = "http://" + t
    u = urlsplit(t)
    if u.scheme not in schemes:
        raise ValueError(f"only {' or '.join(s + '://' for s in schemes)} servers can be {verb}, got {text!r}")
    try:
        u.port
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not u.hostname:
        raise ValueError(f"no host in {text!r}")
    return u


def server_url(text: str) -> str:
    """The base URL of a running ``rakv serve`` from what a user typed: ``http://host:port``
    (``host:port`` alone is taken as http; an OpenAI base URL's ``/v1`` is dropped). ValueError:
    one line."""
    u = user_url(text)
    port = u.port
    path = u.path.rstrip("/")
    if path in ("", "/v1"):
        path = ""
    else:
        raise ValueError(f"expected a server's address like http://127.0.0.1:8000, got {text!r}")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"http://{host}" + (f":{port}" if port else "")
