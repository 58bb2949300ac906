"""``rakv serve``: an OpenAI-compatible HTTP server on localhost over one engine (standard library only).

The engine, its prefix cache and its controller are those of ``rakv generate`` (``rakv.cli.Run``
builds them from the same flags). ``--parallel N`` requests decode together (``rakv.engine.batch``: a
lane each over the one engine's target, prefix cache and learned state; one forward a step carries
every active request's rows); a request beyond them waits in a queue of at most ``--max-queue``,
and one past that is refused with 429 and Retry-After. ``--api-key KEY``: every request must carry
``Authorization: Bearer KEY`` (else 401). Endpoints (docs/serve.md):

    GET  /v1/models                  the one model
    POST /v1/chat/completions        through the chat template; consecutive turns hit the cache
    POST /v1/completions             raw text (or token ids); with ``suffix``, the middle (rakv.fim)
    POST /infill                     llama.cpp server's fill in the middle (llama.vim, llama.vscode)
    GET  /rakv/records?since=N       the engine's records after the first N (long-poll with wait=S)

A chat request whose messages are a conversation this server answered (the same messages and
then the answer it gave) continues that conversation (``rakv.engine.chat``): its ids are the previous
turn's prompt ids, the answer's own ids and the new message, so the prefix cache serves all of it
but the new message. Other histories start a conversation of their own.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from . import api
from .. import argtypes as A
from .api import ApiError, Ask
from ..engine.chat import RAW_SEPARATOR, Turn, run_turn
from ..common import CliError
from ..util.paths import log
from .state import (MAX_PAGE, MAX_WAIT_S, StopText, TOKEN_FIELDS, RecordLog, ServerConversation, _history_key, Conversations, Current, RecordHook, forget, Result)  # noqa: F401 - (the server's face)

DEFAULT_PARALLEL = 4         # requests decoded together (docs/serve.md: why 4)
DEFAULT_MAX_QUEUE = 16       # requests waiting for a lane beyond those; more: 429

MAX_BODY = 8 * 2**20         # bytes of a request body


class Service:
    """Runs the API's requests on the session's engine: up to ``parallel`` at once, each on a lane
    of ``rakv.engine.batch.LanePool`` (their forwards share a pass), at most ``max_queue`` waiting."""

    def __init__(self, run, hook: RecordHook, model: str, parallel: int = 1, max_queue: int = DEFAULT_MAX_QUEUE):
        from ..engine.batch import LanePool

        self.run = run                  # the rakv.cli.Run
        self.hook = hook
        self.engine = run.engine
        self.model = model
        self.created = int(time.time())
        self.pool = LanePool(self.engine, parallel, on_step=self._step)
        self.max_queue = max_queue
        self._gate = threading.Condition()
        self.waiting = 0                # requests waiting for a lane
        self.open = 0                   # requests admitted and not yet answered
        self.closing = False
        self.convs = Conversations()
        self.default = self.engine.sampling       # the sampling flags' (a drawn seed if they gave none)
        self._conv_number = 0
        self.requests = 0
        self._latency = deque(maxlen=32)          # recent requests' seconds (Retry-After)

    @property
    def busy(self) -> bool:
        return self.pool.busy > 0

    def _step(self, info) -> None:
        """A step several lanes shared: a record of who shared it (rakv.records.Step)."""
        from ..records import Step

        if len(info.rows) > 1:
            self.engine._emit(Step(step=info.index, requests=[[r, n] for r, n in info.rows], ms=info.ms,
                                   shared=info.shared, predicted_ms=info.predicted_ms))

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it over the lanes, at the
        recent requests' mean duration (at least 1)."""
        mean = sum(self._latency) / len(self._latency) if self._latency else 1.0
        return max(1, int(mean * (1 + self.waiting / max(1, self.pool.size)) + 0.999))

    @contextmanager
    def admit(self):
        """Count a request in while it is open; past the queue's limit, 429 with Retry-After."""
        with self._gate:
            if self.closing:
                raise ApiError(503, "the server is shutting down", kind="server_error")
            if self.pool.busy >= self.pool.size and self.waiting >= self.max_queue:
                raise ApiError(429, f"the server is busy: {self.pool.size} requests running and "
                                    f"{self.waiting} waiting (--max-queue {self.max_queue})",
                               kind="server_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(self.retry_after())})
            self.open += 1
        try:
            yield
        finally:
            with self._gate:
                self.open -= 1
                self._gate.notify_all()

    # ---------------------------------------------------------------- one request
    def complete(self, ask: Ask, begin=None, emit=None) -> Result:
        """Run ``ask`` on a free lane (waiting for one); ``begin()`` when it starts, ``emit(text)``
        per piece. Call inside ``admit()``."""
        with ExitStack() as stack:
            with self._gate:
                self.waiting += 1
            try:
                eng = stack.enter_context(self.pool.lane())
            finally:
                with self._gate:
                    self.waiting -= 1
            return self._complete(eng, ask, begin, emit)

    def _complete(self, eng, ask: Ask, begin, emit) -> Result:
        from ..engine import EngineError

        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        t0 = time.perf_counter()
        self._use_sampling(eng, ask)
        fim = self._fim_tokens(eng) if ask.fim is not None else self._built_fim(eng, ask)
        if fim is None:
            cur = Current(eng, ask.stop, begin, emit)
        else:
            from ..fim import LineRules

            f = ask.fim
            cur = Current(eng, ask.stop, begin, emit, ends=fim.ends | eng.target.eos_ids,
                          rules=LineRules(f.n_indent, f.t_max_ms) if f is not None else LineRules())
        self.hook.current = cur
        conv = history = None
        fill: dict = {}
        try:
            if ask.chat:
                end, conv, history = self._chat(eng, ask)
            elif ask.fim is not None:
                end, fill = self._fill(eng, ask)
            else:
                end = self._completion(eng, ask)
        except ApiError:
            raise
        except EngineError as e:
            raise ApiError(400, _one_line(e), code="context_length_exceeded" if "context" in str(e) else None)
        except ValueError as e:                  # e.g. an empty message; a template that refuses the roles
            raise ApiError(400, _one_line(e))
        except Exception as e:  # noqa: BLE001 - a template error or a failure inside the engine
            if isinstance(e, _template_errors()):
                raise ApiError(400, f"the chat template refused these messages: {_one_line(e)}")
            raise ApiError(500, f"{type(e).__name__}: {_one_line(e)}", kind="server_error")
        finally:
            self.hook.current = None
        cur.finish()
        text = cur.stop.text()
        j = self.run.request_json(end)
        start = self.run.starts.get(end.request_id)
        j["conversation"] = start.conversation if start is not None else None
        forget(self.run, end.request_id)
        if self.run.args.json:          # generate's object on stdout, one a line
            sys.stdout.write(json.dumps(j) + "\n")
            sys.stdout.flush()
        if conv is not None and not cur.stop.hit and not cur.gone and end.stopped != "stop":
            system, pairs, user = history
            self.convs.put(system, pairs + [(user, text)], conv)
        self.requests += 1
        self._latency.append(time.perf_counter() - t0)
        if self.closing and end.stopped == "stop":
            raise ApiError(503, "the server is shutting down: this answer was cut short", kind="server_error")
        if fim is not None:
            fill.update(ids=list(cur.kept), ended=cur.ended or ("stop_string" if cur.stop.hit else end.stopped),
                        predicted=len(cur.kept) + (cur.ended == "fim_end"))
            if ask.infill:
                from ..fim import heal

                text = api.cut_at_stops(heal(cur.rules.text, fill.get("blanks", "")), ask.stop)
        return Result(end, text, api.finish_reason(end.stopped, cur.stop.hit), self._rakv(j, cur), fill)

    def _rakv(self, j: dict, cur: Current) -> dict:
        """The response's ``rakv`` object: generate's --json fields of the request (its text is the
        response's; a chat turn's ``conversation`` added) with every decision and the acceptance
        estimate as ``alpha``."""
        out = {k: v for k, v in j.items() if k != "text"}
        out["alpha"] = j.get("alpha_ewma")
        out["decisions"] = cur.decisions
        out["stop_string"] = cur.stop.hit
        return out

    def _use_sampling(self, eng, ask: Ask) -> None:
        """The request's sampling: the server's flags, overridden by the request's fields. A seed
        the request gives is the one its tokens use (the engine adds the request's number to its
        seed, so it gets that seed less the number)."""
        from ..engine import EngineError
        from ..config import SEED_LIMIT, problem

        d = self.default
        s = replace(d, temperature=d.temperature if ask.temperature is None else ask.temperature,
                    top_p=d.top_p if ask.top_p is None else ask.top_p,
                    top_k=d.top_k if ask.top_k is None else ask.top_k,
                    min_p=d.min_p if ask.min_p is None else ask.min_p)
        why = problem(s)
        if why:
            raise ApiError(400, why)
        if ask.seed is not None:
            s = replace(s, seed=(ask.seed - eng._next_id) % SEED_LIMIT)
        try:
            eng.set_sampling(s)
        except EngineError as e:
            raise ApiError(400, _one_line(e)) from None

    def _completion(self, eng, ask: Ask):
        from ..prompts import EncodedPrompt, raw_ids

        if isinstance(ask.prompt, str):
            tok = eng.target.tokenizer
            if tok is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            enc = EncodedPrompt(raw_ids(tok, ask.prompt), False, 0)
            return eng.generate(enc, ask.max_tokens, prompt_text=ask.prompt)
        return eng.generate(ask.prompt, ask.max_tokens)

    def _fim_tokens(self, eng):
        """The target's FIM tokens; a model without them: 400, one line."""
        from ..fim import NoFim, find_tokens

        try:
            return find_tokens(eng.target.tokenizer)
        except NoFim as e:
            raise ApiError(400, str(e), code="not_supported") from None

    def _built_fim(self, eng, ask: Ask):
        """A completion whose prompt is already a FIM prompt (Continue, Tabby and Twinny build one
        from the model's FIM tokens) ends where the middle ends, as a fill does: its FIM tokens, or
        None for any other request."""
        from ..fim import NoFim, find_tokens

        if ask.chat or ask.prompt is None:
            return None
        try:
            fim = find_tokens(eng.target.tokenizer)
        except NoFim:
            return None
        tok = eng.target.tokenizer
        if isinstance(ask.prompt, str):
            return fim if tok.convert_ids_to_tokens(fim.mid) in ask.prompt else None
        return fim if fim.mid in ask.prompt else None

    def _fill(self, eng, ask: Ask):
        """Fill in the middle (/infill, or a completion's suffix): the FIM prompt in the model's
        format (``rakv.fim.build``: the current line last, so a keystroke reuses the rest); 0 tokens
        to predict: a warm-up that stores the prompt's KV and returns."""
        from .. import fim as F

        f, tok, maxpos = ask.fim, eng.target.tokenizer, eng.target.max_positions
        N = eng.config.max_new_tokens if ask.max_tokens is None else ask.max_tokens
        line, blanks = F.split_blanks(f.line)
        p = F.build(tok, f.prefix, f.suffix, line, f.extra, n_predict=N, n_ctx=maxpos)
        P, truncated = len(p.ids), False          # (llama.cpp's truncated: the context ran out, not its FIM cuts)
        if maxpos is not None and P + N > maxpos:
            if P >= maxpos:
                raise ApiError(400, f"the FIM prompt ({P} tokens) does not fit the model's context of {maxpos}",
                               code="context_length_exceeded")
            N, truncated = maxpos - P, True
        info = {"prompt_tokens": P, "truncated": truncated, "n_predict": N, "blanks": blanks}
        text = f.prefix + f.line
        if N == 0:
            return eng.warm(p.ids, prompt_text=text), info
        return eng.generate(p.ids, N, prompt_text=text), info

    def _chat(self, eng, ask: Ask):
        """A conversation's next turn (continued, or started here); messages that are no
        conversation (two user messages in a row, ...) are one templated prompt."""
        parts = api.split_conversation(ask.messages)
        if eng.target.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        if parts is None:
            enc = self._one_prompt(eng, ask.messages)
            return eng.generate(enc, ask.max_tokens, prompt_text=ask.messages[-1]["content"]), None, None
        system, pairs, user = parts
        taken = self.convs.take(system, pairs)
        conv = taken or self._new_conversation(eng, system, pairs)
        try:
            end = run_turn(eng, conv, user, ask.max_tokens)
        except BaseException:
            if taken is not None:          # (the turn was abandoned: the conversation is as it was)
                self.convs.put(system, pairs, taken)
            raise
        return end, conv, (system, pairs, user)

    def _new_conversation(self, eng, system, pairs) -> ServerConversation:
        """A conversation whose earlier turns came from the request (the ids of their answers as the
        tokenizer gives them; the next turn checks them against the template, as always)."""
        self._conv_number += 1
        conv = ServerConversation.for_engine(eng, number=self._conv_number, system=list(system))
        tok = eng.target.tokenizer
        for user, answer in pairs:
            ids = conv._whole(user)
            out = [int(x) for x in tok(answer, add_special_tokens=False)["input_ids"]]
            conv.turns.append(Turn(user, answer, ids, out, "template"))
        return conv

    def _one_prompt(self, eng, messages: list[dict]):
        from ..util.ids import lcp
        from ..prompts import EncodedPrompt, _as_ids, has_chat_template, raw_ids, template_prefix

        tok = eng.target.tokenizer
        if eng.chat_template and has_chat_template(tok):
            ids = _as_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
            return EncodedPrompt(ids, True, lcp(ids, template_prefix(tok)))
        return EncodedPrompt(raw_ids(tok, RAW_SEPARATOR.join(m["content"] for m in messages)), False, 0)

    # ---------------------------------------------------------------- shutdown
    def close(self, wait_s: float = 30.0) -> None:
        """No new requests; the running ones stop within a round, and every open answer ends (a
        stream with a final error event) before this returns (at most ``wait_s``)."""
        with self._gate:
            self.closing = True
        deadline = time.monotonic() + wait_s
        with self._gate:
            while self.open and time.monotonic() < deadline:
                self.pool.stop_all()
                self._gate.wait(0.05)


def _template_errors() -> tuple:
    """The errors a chat template raises (jinja2's; a template's own raise_exception among them)."""
    try:
        from jinja2.exceptions import TemplateError

        return (TemplateError,)
    except ImportError:
        return ()


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# ----------------------------------------------------------------------------- HTTP
class Handler(BaseHTTPRequestHandler):
    """One connection's requests (ThreadingHTTPServer: a thread each). Errors are JSON, never a
    traceback; one line per request on stderr (the records polls are not logged)."""

    protocol_version = "HTTP/1.1"
    timeout = 300                      # an idle kept-alive connection is closed after this

    def version_string(self) -> str:
        from .. import __version__

        return f"rakv-serve/{__version__}"

    @property
    def service(self) -> Service:
        return self.server.service

    # ---------------------------------------------------------------- routing
    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def _route(self, method: str) -> None:
        self.t0 = time.perf_counter()
        self.note = ""
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        if not self._authorized():
            self.close_connection = True
            self._error(ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY' (the server's "
                                      "--api-key)", kind="invalid_request_error", code="invalid_api_key"))
            return
        gets = {"/v1/models": self._models, "/rakv/records": lambda: self._records(url.query)}
        posts = {"/infill": self._infill, "/v1/chat/completions": lambda: self._complete(True),
                 "/v1/completions": lambda: self._complete(False)}
        try:
            if method == "GET" and path in gets:
                gets[path]()
            elif method == "GET" and path.startswith("/v1/models/"):
                self._model(path[len("/v1/models/"):])
            elif method == "POST" and path in posts:
                posts[path]()
            elif path in gets or path in posts:
                self.close_connection = True
                raise ApiError(405, f"{method} is not allowed on {path}")
            else:
                self.close_connection = True
                raise ApiError(404, f"no such endpoint: {method} {path}", code="not_found")
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            if path != "/rakv/records":
                self._log(499, "the client went away")
        except Exception as e:  # noqa: BLE001 - a server bug is a 500, and the server goes on
            self._error(ApiError(500, f"{type(e).__name__}: {_one_line(e)}", kind="server_error"))

    def _authorized(self) -> bool:
        """With --api-key: the request's bearer token is the key (compared in constant time)."""
        import hmac

        key = getattr(self.server, "api_key", None)
        if not key:
            return True
        got = self.headers.get("Authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode("utf-8", "replace"), key.encode("utf-8"))

    # ---------------------------------------------------------------- endpoints
    def _models(self) -> None:
        s = self.service
        self._json(200, api.models_list(s.model, s.created))

    def _model(self, name: str) -> None:
        s = self.service
        if name != s.model:
            raise ApiError(404, f"no model {name!r} (this server has {s.model!r})", "model", code="model_not_found")
        self._json(200, api.model_card(s.model, s.created))

    def _records(self, query: str) -> None:
        q = parse_qs(query)
        try:
            since = int(q.get("since", ["0"])[0])
            wait = float(q.get("wait", ["0"])[0])
            limit = int(q.get("limit", [str(MAX_PAGE)])[0])
        except ValueError:
            raise ApiError(400, "since and limit must be integers, wait a number of seconds") from None
        if since < 0 or limit < 1 or not 0 <= wait <= 1e6:
            raise ApiError(400, "since >= 0, limit >= 1 and wait >= 0")
        out = self.server.records.read(since, min(wait, MAX_WAIT_S), min(limit, MAX_PAGE))
        out["busy"] = self.service.busy
        out["model"] = self.service.model
        self._json(200, out, log=False)

    def _complete(self, chat: bool) -> None:
        body = self._body()
        ask = api.parse_ask(body, chat)
        with self.service.admit():
            self._answer(chat, ask)

    def _infill(self) -> None:
        """llama.cpp server's /infill (llama.vim, llama.vscode): its answer's shape."""
        ask = api.parse_infill(self._body())
        s = self.service
        with s.admit():
            res = s.complete(ask)
        e, f = res.end, res.fill
        predicted_ms = max(0.0, e.latency_ms - e.ttft_ms) if e.stopped != "warm" else 0.0
        settings = {"n_predict": f.get("n_predict"), "n_indent": ask.fim.n_indent,
                    "t_max_predict_ms": ask.fim.t_max_ms, "temperature": ask.temperature, "top_k": ask.top_k,
                    "top_p": ask.top_p, "seed": ask.seed}
        self.note = ("warm-up; " if e.stopped == "warm" else "infill; ") + _summary(res)
        self._json(200, api.infill_response(s.model, res.text, stopped=f.get("ended", e.stopped),
                                            prompt_tokens=e.prompt_tokens, cache_n=_reused(e),
                                            predicted_n=f.get("predicted", 0), prompt_ms=e.ttft_ms,
                                            predicted_ms=predicted_ms, truncated=bool(f.get("truncated")),
                                            settings=settings, rakv=res.rakv, fields=ask.fim.fields))

    def _answer(self, chat: bool, ask) -> None:
        rid = api.new_id(chat)
        model = self.service.model
        if not ask.stream:
            res = self.service.complete(ask)
            use = api.usage(res.end.prompt_tokens, len(res.end.output_ids))
            self.note = _summary(res)
            self._json(200, api.response(ask, rid, model, res.text, res.finish, use, res.rakv))
            return
        sse = EventStream(self)

        def begin():
            sse.begin()
            if chat:
                sse.send(api.chunk(ask, rid, model, "", first=True))

        try:
            res = self.service.complete(ask, begin, lambda piece: sse.send(api.chunk(ask, rid, model, piece)))
        except ApiError as e:
            if not sse.started:
                raise
            sse.send(e.body())            # the stream had begun: the error is its last event
            self._log(e.status, e.message)
            sse.done()
            return
        use = api.usage(res.end.prompt_tokens, len(res.end.output_ids))
        self.note = "stream; " + _summary(res)
        if not sse.started:               # (a request that ended before its start: nothing to stream)
            sse.begin()
        try:
            sse.send(api.chunk(ask, rid, model, None, finish=res.finish, usage=use, rakv=res.rakv))
        except OSError:
            self.note += "; the client went away"
        self._log(200, self.note)         # before [DONE]: a client that saw the end finds its line
        try:
            sse.done()
        except OSError:
            pass

    # ---------------------------------------------------------------- reading and writing
    def _body(self):
        n = self.headers.get("Content-Length")
        if n is None:
            self.close_connection = True
            raise ApiError(411, "a request body with Content-Length is needed")
        try:
            n = int(n)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "bad Content-Length") from None
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})") from None

    def _json(self, status: int, obj: dict, log: bool = True, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if log:                  # before the body: a client that has its answer has its log line too
            self._log(status, self.note)
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, e: ApiError) -> None:
        try:
            self._json(e.status, e.body(), log=False, headers=e.headers)
        except OSError:
            pass
        self._log(e.status, e.message)

    def send_error(self, code, message=None, explain=None) -> None:
        """The base class's own errors (a bad request line, an unknown method): JSON too."""
        self.close_connection = True
        self.request_version = self.protocol_version      # (a garbled request line reads as HTTP/0.9: no headers)
        self.t0 = getattr(self, "t0", time.perf_counter())
        self.note = ""
        try:
            self._json(code, api.error_body(message or self.responses.get(code, ("error",))[0]), log=False)
        except OSError:
            pass
        self._log(code, message or "")

    def log_message(self, format, *args) -> None:     # noqa: A002 - our own line per request instead
        pass

    def _log(self, status: int, what: str = "") -> None:
        ms = (time.perf_counter() - getattr(self, "t0", time.perf_counter())) * 1e3
        req = "".join(c if c.isprintable() else "?" for c in (getattr(self, "requestline", "") or "-")[:200])
        print(f"[rakv] {self.client_address[0]} \"{req}\" {status} {ms:.0f} ms" + (f": {what}" if what else ""),
              file=sys.stderr, flush=True)


def _reused(e) -> int:
    """The prompt tokens a request took from the prefix cache (a partial hit recomputes its last)."""
    q = e.hit_tokens if e.action.get("reuse") else 0
    return q if e.exact_repeat or q == 0 else q - 1


def _summary(res: Result) -> str:
    e = res.end
    n = (res.rakv or {}).get("copies_accepted", 0)       # the gate's copies, as the explorer counts them
    copies = f" + copy {n}" if n else ""
    return (f"request {e.request_id}, {len(e.output_ids)} tokens, TTFT {e.ttft_ms:.0f} ms, "
            f"r={e.action.get('reuse')} k={e.action.get('k')}{copies}, hit {e.hit_tokens}/{e.prompt_tokens}, "
            f"accepted {e.accepted}/{e.drafted}"
            + (f", copied {n}/{(res.rakv or {}).get('copied', 0)}" if n else "") + f", finish {res.finish}")


class EventStream:
    """Server-sent events on a handler's connection: ``data: {json}`` events, then ``data: [DONE]``;
    the connection closes after the stream."""

    def __init__(self, handler: Handler):
        self.h = handler
        self.started = False

    def begin(self) -> None:
        if self.started:
            return
        self.started = True
        h = self.h
        h.close_connection = True
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.flush()

    def send(self, obj: dict) -> None:
        self.h.wfile.write(b"data: " + json.dumps(obj).encode("utf-8") + b"\n\n")
        self.h.wfile.flush()

    def done(self) -> None:
        self.h.wfile.write(b"data: [DONE]\n\n")
        self.h.wfile.flush()


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def bind(host: str, port: int) -> HttpServer:
    """The listening socket (before any model loads: a port in use is one line, exit 2)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    cls = type("HttpServer6", (HttpServer,), {"address_family": fam}) if fam != socket.AF_INET else HttpServer
    try:
        return cls((host, port), Handler)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except OverflowError as e:
        raise CliError(f"bad port {port}: {e}") from None


class Server:
    """A bound HTTP server over the engine of a Run: ``serve_forever()`` (the command) or
    ``start()`` (a thread: tests, embedding); ``close()`` ends it and closes the recording.

    ``make_session(on_record)`` builds the ``rakv.cli.Run`` of the run flags with ``on_record``
    added to its callback (``rakv.cli`` passes it: the CLI sits above this module)."""

    def __init__(self, args, make_session):
        self.httpd = bind(args.host, args.port)
        self._thread: threading.Thread | None = None
        self._serving = False
        self.records = RecordLog()
        hook = RecordHook(self.records)
        try:
            self.run = make_session(hook)
        except BaseException:
            self.httpd.server_close()
            raise
        hook.session = self.run
        self.run.stream_text = False          # a server writes no answer text to stdout
        self.service = Service(self.run, hook, model_name(args, self.run.engine),
                               parallel=getattr(args, "parallel", 1), max_queue=getattr(args, "max_queue", DEFAULT_MAX_QUEUE))
        self.httpd.service = self.service
        self.httpd.records = self.records
        self.httpd.api_key = getattr(args, "api_key", None) or None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_forever(self) -> None:
        self._serving = True
        self.httpd.serve_forever(poll_interval=0.25)

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.serve_forever, name="rakv-serve", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.service.close()
        self.records.close()
        if self._serving:
            self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(10)
        self.run.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_name(args, engine) -> str:
    """The model's id in the API: the --target as given (``demo``, a hub id, a file's name)."""
    from pathlib import Path

    t = str(args.target)
    return Path(t).name if ("/" in t and Path(t).exists()) else t


# ----------------------------------------------------------------------------- the command
def add_serve_parser(sub, add_run_args) -> None:
    """``rakv serve``'s flags: ``add_run_args`` (generate's, from rakv.cli), --host, --port."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on localhost over the same engine",
                       description="An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, streaming by server-sent events; llama.cpp's /infill for editors) on one engine, prefix cache and "
                                   "controller; each response carries a 'rakv' object; the explorer can attach "
                                   "(GET /rakv/records). See docs/serve.md.")
    add_run_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=A.int_range(0, 65535), default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--parallel", type=A.int_range(1, 64), default=DEFAULT_PARALLEL,
                   help=f"requests decoded together, their rows in one forward a step (default {DEFAULT_PARALLEL}; "
                        "1: one at a time)")
    s.add_argument("--max-queue", type=A.int_range(0, 100_000), default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting beyond --parallel (default {DEFAULT_MAX_QUEUE}); more are refused with "
                        "429 and Retry-After")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="every request must send 'Authorization: Bearer KEY' (else 401); also read from "
                        "RAKV_API_KEY")


def cmd_serve(args, make_session) -> int:
    if args.api_key is None:
        from ..util.paths import env_text

        args.api_key = env_text("RAKV_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log(f"warning: listening on {args.host}: anyone who can reach it can use this server (no --api-key)")
    server = Server(args, make_session)
    stop = threading.Event()
    restore = _signals_set(stop)
    try:
        s = server.service
        log(f"serving {s.model} (policy {server.run.policy.name}, {s.pool.size} at once, queue {s.max_queue}"
            + (", API key required" if args.api_key else "") + f") on {server.url}: POST /v1/chat/completions, "
            f"/v1/completions, /infill; GET /v1/models, /rakv/records" + (f"; recording to {args.record}" if args.record else "")
            + "; Ctrl-C stops")
        server.start()
        s.pool.batcher.runner.drive(stop)       # this thread, which loaded the models, runs every step
        log(f"shutting down after {s.requests} requests")
    finally:
        server.close()
        restore()
    return 0


def _signals_set(stop: threading.Event):
    """Ctrl-C and SIGTERM set ``stop`` (the server then closes: open streams end with an error
    event, the recording is closed, the learning saved); a second Ctrl-C interrupts as usual."""
    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
    except ValueError:               # not the main thread
        pass

    def restore() -> None:
        for sig, h in old.items():
            signal.signal(sig, h)
    return restore
