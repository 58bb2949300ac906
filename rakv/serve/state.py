"""What the server keeps beside the engine: stop strings cut from the text, the record log of
/rakv/records, the conversations a later request may continue, and each running request's text as
the engine commits it (``Current``, routed by the thread the request runs in: ``RecordHook``)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from ..engine.chat import RAW_SEPARATOR, Conversation
from ..util.textstream import TextStream

MAX_WAIT_S = 30.0            # the longest long-poll of /rakv/records
MAX_PAGE = 5000              # records a poll returns at most
RECORDS_KEPT = 20_000        # records the server keeps for /rakv/records (the header always)
CONVERSATIONS_KEPT = 64      # conversations kept for continuing (least recently used dropped)


# ----------------------------------------------------------------------------- stop strings
class StopText:
    """Text pieces in, the text before the first stop string out. A piece is held back while its
    end could still begin a stop string, so a stream never shows part of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.out: list[str] = []
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit or not piece:
            return ""
        self.buf += piece
        at = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if at:
            self.hit = True
            safe, self.buf = self.buf[: min(at)], ""
        else:
            cut = len(self.buf) - self._held(self.buf)
            safe, self.buf = self.buf[:cut], self.buf[cut:]
        self.out.append(safe)
        return safe

    def _held(self, s: str) -> int:
        """The longest end of ``s`` that begins a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s)), best, -1):
                if s.endswith(stop[:k]):
                    best = k
                    break
        return best

    def finish(self) -> str:
        rest, self.buf = ("" if self.hit else self.buf), ""
        self.out.append(rest)
        return rest

    def text(self) -> str:
        return "".join(self.out)


# ----------------------------------------------------------------------------- the records endpoint
TOKEN_FIELDS = ("prompt_ids", "emitted", "tree_tokens")


class RecordLog:
    """The engine's records as dicts, numbered from 0 (the run header), for /rakv/records; with
    each token id's text piece, so a viewer without the tokenizer shows text. Thread-safe; readers
    may wait for new records (long-poll)."""

    def __init__(self, keep: int = RECORDS_KEPT):
        self.cond = threading.Condition()
        self.keep = keep
        self.header: dict | None = None
        self.items: deque = deque()
        self.base = 1                  # the index of items[0]
        self.pieces: dict[int, str] = {}
        self.closed = False
        self.instance = uuid.uuid4().hex[:12]    # a restarted server numbers from 0 again

    @property
    def next(self) -> int:
        return self.base + len(self.items)

    def add(self, rec: dict, pieces: dict[int, str]) -> None:
        with self.cond:
            self.pieces.update(pieces)
            if rec.get("type") == "header" and self.header is None:
                self.header = rec
            else:
                self.items.append(rec)
                if len(self.items) > self.keep:
                    self.items.popleft()
                    self.base += 1
            self.cond.notify_all()

    def read(self, since: int, wait: float = 0.0, limit: int = MAX_PAGE) -> dict:
        """The records from index ``since`` on (at most ``limit``), waiting up to ``wait`` seconds
        for one when there are none yet. ``next``: the ``since`` of the next poll; ``skipped``:
        records no longer kept."""
        with self.cond:
            if wait > 0 and since >= self.next and not self.closed:
                self.cond.wait_for(lambda: self.next > since or self.closed, timeout=wait)
            out = [self.header] if since <= 0 and self.header is not None else []
            start = max(since, self.base)
            page = list(islice(self.items, start - self.base, start - self.base + limit))
            out += page
            ids = {int(t) for r in out for f in TOKEN_FIELDS for t in (r.get(f) or ())}
            return {"records": out, "next": start + len(page), "first": self.base,
                    "skipped": max(0, self.base - max(since, 1)), "server": self.instance,
                    "pieces": {str(i): self.pieces[i] for i in sorted(ids) if i in self.pieces}}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


# ----------------------------------------------------------------------------- the engine's side
@dataclass
class ServerConversation(Conversation):
    """A conversation of the server: ``rakv.engine.chat.Conversation`` with the request's system messages
    in front of its turns."""

    system: list = field(default_factory=list)

    def messages(self, user: str | None = None) -> list[dict]:
        return [dict(m) for m in self.system] + super().messages(user)

    def _raw_text(self, text: str) -> str:
        return "".join(m["content"] + RAW_SEPARATOR for m in self.system) + super()._raw_text(text)


def _history_key(system: list[dict], pairs: list[tuple[str, str]]) -> str:
    return json.dumps([[m["content"] for m in system], [[u.strip(), a.strip()] for u, a in pairs]])


class Conversations:
    """The conversations a later request may continue, by the messages that continue them."""

    def __init__(self, keep: int = CONVERSATIONS_KEPT):
        self.keep = keep
        self.items: OrderedDict[str, ServerConversation] = OrderedDict()

    def take(self, system, pairs) -> ServerConversation | None:
        return self.items.pop(_history_key(system, pairs), None) if pairs else None

    def put(self, system, pairs, conv: ServerConversation) -> None:
        self.items[_history_key(system, pairs)] = conv
        while len(self.items) > self.keep:
            self.items.popitem(last=False)


class Current:
    """The running request's text as the engine commits it: decoded (``TextStream``), cut at a stop
    string (which stops the engine), and sent on (``emit``) as it becomes certain."""

    def __init__(self, engine, stops: list[str], begin=None, emit=None, ends=None, rules=None):
        self.engine = engine
        self.text = TextStream(engine.target.tokenizer)
        self.stop = StopText(stops)
        self.begin, self.emit = begin, emit
        self.rid: int | None = None
        self.decisions: list[dict] = []
        self.gone = False              # the client went away: the engine was asked to stop
        # fill in the middle: the answer ends at the first of ``ends`` (the model's FIM end tokens and
        # EOS, not part of it) or where ``rules`` (rakv.fim.LineRules) end it; ``kept`` its ids
        self.ends = frozenset(ends or ())
        self.rules = rules
        self.kept: list[int] | None = [] if rules is not None else None
        self.ended = ""                # "fim_end" | "indent" | "time"
        self.fed = 0                   # of rules.text passed on
        self.t_gen: float | None = None

    def see(self, rec) -> None:
        from ..records import Decision, RequestStart, Round

        if isinstance(rec, RequestStart):
            self.rid = rec.request_id
            if self.begin is not None:
                self._safely(self.begin)
        elif isinstance(rec, Decision) and rec.request_id == self.rid:
            self.decisions.append({"round": rec.round, "action": dict(rec.action), "reason": rec.reason,
                                   "alpha": rec.alpha, "alpha_star": dict(rec.alpha_star),
                                   "candidates": [dict(c) for c in rec.candidates]})
        elif isinstance(rec, Round) and rec.request_id == self.rid:
            if self.rules is not None:
                self._fim_round(rec.emitted)
            else:
                self.send(self.stop.push(self.text.push(rec.emitted)))
            if self.stop.hit or self.ended:
                self.engine.stop()     # the round ends the request

    def _fim_round(self, emitted: list[int]) -> None:
        """A round of a fill in the middle, token by token as llama.cpp's server takes them: the
        tokens past the middle's end (or past where a line rule ended it) are not the answer."""
        t = time.perf_counter()
        if self.t_gen is None:         # (the prefill round: generation starts)
            self.t_gen = t
        ms = (t - self.t_gen) * 1e3
        for tok in emitted:
            if self.ended or self.stop.hit:
                return
            if tok in self.ends:
                self.ended = "fim_end"
                return
            self.kept.append(int(tok))
            if not self.rules.push(self.text.push([tok]), ms):
                self.ended = self.rules.why
            self._pass_on()

    def _pass_on(self) -> None:
        new = self.rules.text[self.fed:]
        self.fed = max(self.fed, len(self.rules.text))
        self.send(self.stop.push(new))

    def send(self, piece: str) -> None:
        if piece and self.emit is not None:
            self._safely(lambda: self.emit(piece))

    def _safely(self, fn) -> None:
        if self.gone:
            return
        try:
            fn()
        except OSError:                # the client closed the connection: stop generating for it
            self.gone = True
            self.engine.stop()

    def finish(self) -> None:
        if self.rules is not None:
            rest = self.text.finish()
            if not self.ended and not self.stop.hit:
                self.rules.push(rest, 0.0)
                self._pass_on()
        else:
            self.send(self.stop.push(self.text.finish()))
        self.send(self.stop.finish())


class RecordHook:
    """What a server adds to its Run's callback (``Run(on_record=...)``): every record
    kept for /rakv/records with its tokens' text, and passed to the running request."""

    def __init__(self, records: RecordLog):
        self.records = records
        self.session = None            # set once the Run is built (its header came before)
        self._local = threading.local()   # each request runs in its own thread: its Current there
        self._seen: set[int] = set()

    @property
    def current(self) -> "Current | None":
        return getattr(self._local, "current", None)

    @current.setter
    def current(self, cur: "Current | None") -> None:
        self._local.current = cur

    def __call__(self, rec) -> None:
        from ..records import to_dict

        d = to_dict(rec)
        self.records.add(d, self._new_pieces(d))
        cur = self.current
        if cur is not None:
            cur.see(rec)

    def _new_pieces(self, d: dict) -> dict[int, str]:
        tok = getattr(getattr(getattr(self.session, "engine", None), "target", None), "tokenizer", None)
        new = {int(t) for f in TOKEN_FIELDS for t in (d.get(f) or ())} - self._seen
        if tok is None or not new:
            return {}
        self._seen |= new
        out = {}
        for t in new:
            try:
                out[t] = tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot show is shown as <id>
                out[t] = f"<{t}>"
        return out


def forget(run, rid: int) -> None:
    """Drop what the Run kept of a finished request (a server runs for long)."""
    for kept in (run.starts, run.last_decision, run.gated):
        kept.pop(rid, None)


@dataclass
class Result:
    end: object
    text: str
    finish: str
    rakv: dict
    fill: dict = field(default_factory=dict)      # a fill in the middle's counts (the /infill answer)
