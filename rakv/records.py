"""Plain-Python records: one schema for the engine callback, JSONL recordings and CSV.

A recording is JSON Lines: a ``header`` first, then one record a line, flushed per line.
Every record has ``type`` and ``t`` (seconds since the recorder/engine started).
"""

from __future__ import annotations

import copy
import csv
import json
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Callable, Iterable, Union, get_args, get_origin, get_type_hints

from .util.text_in import TextError, decode_file, load_json

SCHEMA_VERSION = 1


@dataclass
class RunHeader:
    type: str = "header"
    schema: int = SCHEMA_VERSION
    t: float = 0.0
    target: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    dtype: str = ""
    numerics: str = ""                # the target's linears: q8 | fp32
    device: str = ""
    threads: int = 0
    hardware: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    started: str = ""
    learned: dict = field(default_factory=dict)    # what earlier sessions left in the profile
    # the cost profile's calibration quality (rakv.decide.profile.quality_summary): contended and why,
    # per-term spread, CPU share, when and how long; {} without a profile
    profile: dict = field(default_factory=dict)


@dataclass
class RequestStart:
    type: str = "request_start"
    t: float = 0.0
    request_id: int = 0
    prompt: str = ""               # the user's text as typed (before any chat template)
    prompt_ids: list[int] = field(default_factory=list)   # the ids actually fed (templated or raw)
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    policy: str = ""
    templated: bool = False        # True: prompt_ids are the chat template applied to ``prompt``
    template_prefix: int = 0       # leading ids every templated prompt shares (the template's system prefix)
    sampling: dict = field(default_factory=dict)   # this request's sampling (rakv.config.Sampling: its seed is the call's + i)
    # a conversation's turn (rakv.engine.chat): conversation, turn, ids_from ("first" | "append" |
    # "template", and why), previous_tokens (the conversation before it, as fed), kept_tokens (how many
    # of those its ids start with), same_as_template (its ids == the chat template over the whole
    # conversation; first_diff where not); None outside conversations
    conversation: dict | None = None


@dataclass
class CacheLookup:
    type: str = "cache_lookup"
    t: float = 0.0
    request_id: int = 0
    model: str = "target"          # "target" or "draft"
    bucket: str = ""
    hit_tokens: int = 0            # q: longest common prefix with a stored prompt
    reused_tokens: int = 0         # positions cloned (q-1, or P on exact repeat)
    exact_repeat: bool = False
    prompt_tokens: int = 0
    bytes_used: int = 0
    budget: int = 0
    entries: int = 0
    evictions: int = 0
    stored: bool = False
    lookup_ms: float = 0.0
    prefill_ms: float = 0.0        # forward time for the non-reused part (0 on exact repeat)


@dataclass
class Candidate:
    reuse: int
    k: int
    predicted_ms: float
    feasible: bool = True
    reason: str = ""

    def to_dict(self) -> dict:
        """= dataclasses.asdict (flat fields), without its recursive copy (12 a decision)."""
        return {"reuse": self.reuse, "k": self.k, "predicted_ms": self.predicted_ms,
                "feasible": self.feasible, "reason": self.reason}


@dataclass
class Decision:
    type: str = "decision"
    t: float = 0.0
    request_id: int = 0
    round: int = -1                # -1: the per-request decision; else the round it re-decides
    candidates: list[dict] = field(default_factory=list)
    action: dict = field(default_factory=dict)     # {"reuse": r, "k": k}
    alpha: float = 0.0
    alpha_star: dict = field(default_factory=dict)  # k -> crossover alpha* (None if never pays)
    reason: str = ""               # "argmin", "fixed", "probe", "forced"
    decide_ms: float = 0.0
    explore_cost_ms: float = 0.0   # a probe's predicted cost beyond the plain steps it replaces
    explore_balance_ms: float = 0.0  # exploration budget left before this decision
    copy: bool = False             # the chosen action copies an exact repeat's earlier output (its copy rounds priced)
    predicted_passes: float | None = None   # target forwards after the prefill the chosen action is predicted to take
    cost_scales: dict = field(default_factory=dict)   # online cost scales now correcting the profile by > 10% (term -> x)
    # the batch's price (rakv serve --parallel): the other requests' rows and expected tokens a step
    # when this k was chosen, and the k the single-request rule would have taken; {} alone
    batch: dict = field(default_factory=dict)


@dataclass
class Round:
    type: str = "round"
    t: float = 0.0
    request_id: int = 0
    index: int = 0
    kind: str = "ar"               # "prefill" (first token), "ar", "spec"
    k: int = 0                     # k asked for
    drafted: int = 0               # tokens actually proposed
    accepted: int = 0
    emitted: list[int] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)   # per emitted: target | draft | stored
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    catchup_tokens: int = 0
    catchup_ms: float = 0.0
    round_ms: float = 0.0
    context: int = 0               # committed tokens before the round
    alpha: float = 0.0             # EWMA after this round
    explore_ms: float = 0.0        # a probe's measured cost beyond plain steps (0 otherwise)
    # the confidence gate (policy adaptive:gate): per drafted token its confidence and calibrated
    # chance of acceptance, and why the draft stopped (k_max | gate | cut | source; "" = no gate)
    draft_conf: list[float] = field(default_factory=list)
    draft_pred: list[float] = field(default_factory=list)
    draft_stop: str = ""
    draft_source: str = ""      # "lookup": an n-gram side draft the gate verified in a k = 0 round
    verify: str = ""            # how drafts were judged: "" greedy (argmax), "seeded" or "rejection"
    # a tree round (policy tree:N): the proposed tokens, each node's parent (-1: a child of the
    # pending token), the accepted nodes root first, and how it was verified ("tree": one forward
    # over the tree; "chain": its first path as a chain, where no tree forward exists)
    tree_tokens: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    tree_path: list[int] = field(default_factory=list)
    tree_verify: str = ""
    tree_expected: float | None = None      # adaptive:tree: the chosen tree's expected accepted tokens
    tree_predicted_ms: float | None = None  # ... and its measured verify cost V(n) (n = 0: a plain step)
    threads: int = 0            # the thread count its forwards ran at (rakv.util.threads; 0: not recorded)


@dataclass
class RequestEnd:
    type: str = "request_end"
    t: float = 0.0
    request_id: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    hit_tokens: int = 0
    exact_repeat: bool = False
    action: dict = field(default_factory=dict)
    latency_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    alpha_ewma: float = 0.0
    predicted_ms: float | None = None
    stopped: str = ""              # "eos", "max_new_tokens", "stop"
    forward_ms: float = 0.0        # time inside model forwards
    bookkeeping_ms: float = 0.0    # everything else inside rounds
    explore_ms: float = 0.0        # what this request's probes cost beyond plain steps
    threads: int = 0               # the thread count at its end (rakv.util.threads: adapts unless --threads)
    thread_switches: int = 0       # times the adaptive count changed so far in this engine
    # V(k) corrections the round records put in force (rakv.decide.profile.CostProfile.corrections):
    # {"V(8)": 0.52}: the calibrated V(8) was off by more than its noise; {} when none
    cost_corrections: dict = field(default_factory=dict)


@dataclass
class Step:
    """One forward several requests shared (``rakv serve --parallel``, ``rakv.engine.batch``): each
    request's id and the rows it fed (1 a decode step, 1 + k a verify, a chunk of a prompt), the
    step's wall ms, and whether the rows shared one pass over the weights (False: the backend ran
    each request's forward alone inside the step)."""

    type: str = "step"
    t: float = 0.0
    step: int = 0
    requests: list = field(default_factory=list)     # [[request_id, rows], ...]
    ms: float = 0.0
    shared: bool = True
    predicted_ms: float | None = None    # its passes' price before they ran (the batch's W(n); None: not priced)


@dataclass
class ActionMeasure:
    """One action (r, k) of an oracle measurement: R timed runs of the same request."""

    reuse: int
    k: int
    predicted_ms: float | None = None   # the controller's candidate cost (None: no controller)
    feasible: bool = True               # as the controller's candidate says
    runs_ms: list[float] = field(default_factory=list)   # RequestEnd.latency_ms of each run
    median_ms: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0
    output_tokens: int = 0


@dataclass
class OracleResult:
    """"Measure every action": every (r, k) of {0, 1} x K run R times on one prompt from the same
    prefix-cache and controller state, next to what the controller predicted and chose.

    ``oracle`` is the feasible action with the lowest median; ``regret`` =
    (median(choice) - median(oracle)) / median(oracle). ``adaptive_ms`` is the median latency of
    the adaptive policy itself on the same state (its per-round re-decisions and probes included).
    ``exact`` is False when any run's output differed from the others (``mismatch`` says where)."""

    type: str = "oracle"
    t: float = 0.0
    after_request: int = -1        # the last request of the session before the measurement
    prompt: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    templated: bool = False        # True: prompt_ids are the chat template applied to ``prompt``
    max_new_tokens: int = 0
    hit_tokens: int = 0            # the target's prefix-cache hit q at the measured state
    exact_repeat: bool = False
    repeats: int = 0
    k_set: list[int] = field(default_factory=list)
    actions: list[dict] = field(default_factory=list)     # ActionMeasure as dicts
    choice: dict = field(default_factory=dict)            # {"reuse": r, "k": k} of the controller
    choice_reason: str = ""
    alpha: float | None = None     # the controller's acceptance estimate at the decision
    oracle: dict = field(default_factory=dict)            # {"reuse": r, "k": k}
    regret: float | None = None
    adaptive_ms: float | None = None
    output_tokens: int = 0
    exact: bool = True
    mismatch: str = ""
    elapsed_ms: float = 0.0        # wall time of the whole measurement


RECORD_TYPES = {f.default: cls for cls in (RunHeader, RequestStart, CacheLookup, Decision, Round, RequestEnd,
                                           OracleResult, Step)
                for f in fields(cls) if f.name == "type"}

Record = RunHeader | RequestStart | CacheLookup | Decision | Round | RequestEnd | OracleResult | Step
Callback = Callable[[object], None]


class RecordingError(ValueError):
    """A recording could not be read; the message names the file and line."""


_ATOMS = (int, float, str, bool, type(None))
_NAMES: dict[type, tuple[str, ...]] = {}


def to_dict(rec) -> dict:
    """``dataclasses.asdict(rec)``, the same dict, made field by field: asdict deep-copies every
    number, and a server makes a dict of every record between its steps (docs/serve.md)."""
    return _plain(rec)


def _plain(v):
    t = type(v)
    if t in _ATOMS:
        return v
    if t is list:
        return list(v) if all(type(x) in _ATOMS for x in v) else [_plain(x) for x in v]
    if t is dict:
        return {k: _plain(x) for k, x in v.items()}
    names = _NAMES.get(t)
    if names is None:
        if not (is_dataclass(v) and not isinstance(v, type)):
            return _other(v)
        names = _NAMES[t] = tuple(f.name for f in fields(v))
    return {n: _plain(getattr(v, n)) for n in names}


def _other(v):
    """What ``asdict`` makes of a value that is not a record, a list, a dict or an atom."""
    if isinstance(v, tuple):
        items = [_plain(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    return copy.deepcopy(v)


def from_dict(d: dict):
    cls = RECORD_TYPES.get(d.get("type"))
    if cls is None:
        raise RecordingError(f"unknown record type {d.get('type')!r}")
    hints = _hints(cls)
    for k, v in d.items():
        if k in hints and not _has_type(v, hints[k]):
            raise RecordingError(f"{d['type']} field {k!r}: expected {_type_name(hints[k])}, got {v!r}"[:160])
    for k, v in d.items():
        inner = NESTED.get(k)
        for item in (v if isinstance(v, list) else [v]) if inner else ():
            if not isinstance(item, dict):
                raise RecordingError(f"{d['type']} field {k!r}: expected objects, got {item!r}"[:160])
            missing = next((f for f in NESTED_REQUIRED.get(k, ()) if f not in item), None)
            if missing:
                raise RecordingError(f"{d['type']} field {k!r}: an entry without {missing!r}: {item!r}"[:160])
            bad = next((f for f, t in inner.items() if f in item and not _has_type(item[f], t)), None)
            if bad:
                raise RecordingError(f"{d['type']} field {k!r}: {bad!r} expected {_type_name(inner[bad])}, "
                                     f"got {item[bad]!r}"[:160])
    return cls(**{k: v for k, v in d.items() if k in hints})


# the fields inside nested objects that the explorer reads (checked when present)
_ACTION = {"reuse": int, "k": int}
NESTED = {"action": _ACTION, "candidates": {**_ACTION, "predicted_ms": float | None, "feasible": bool, "reason": str},
          # OracleResult
          "choice": _ACTION, "oracle": _ACTION,
          "actions": {**_ACTION, "predicted_ms": float | None, "feasible": bool, "runs_ms": list[float],
                      "median_ms": float, "min_ms": float, "max_ms": float}}


# the nested fields the explorer and the CSV read without a default (every writer wrote them)
NESTED_REQUIRED = {"candidates": ("reuse", "k", "predicted_ms", "feasible"),
                   "actions": ("reuse", "k", "predicted_ms", "feasible", "median_ms", "min_ms", "max_ms")}


_HINTS: dict = {}


def _hints(cls) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _has_type(v, t) -> bool:
    """Does a JSON value fit a field annotation (int, float, str, bool, dict, list[X], X | None)?"""
    origin = get_origin(t)
    if origin is Union or type(t).__name__ == "UnionType":
        return any(_has_type(v, a) for a in get_args(t))
    if t is type(None):
        return v is None
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if origin is list:
        (elt,) = get_args(t) or (object,)
        return isinstance(v, list) and all(_has_type(x, elt) for x in v)
    if origin is dict:
        return isinstance(v, dict)
    if t is object:
        return True
    return isinstance(v, t)


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object"}.get(
        t, str(t).replace("typing.", ""))


class Recorder:
    """Writes records as JSON Lines, one line per record, flushed per line (nothing is lost)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")

    def __call__(self, rec) -> None:
        if self._f.closed:
            return
        self._f.write(json.dumps(to_dict(rec), separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class Recording(list):
    """The records of a file, with the line each came from and warnings about what was skipped."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.lines: list[int] = []
        self.warnings: list[str] = []

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}" if 0 <= i < len(self.lines) else str(self.path)


def read_recording(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> Recording:
    """Read a recording; raises RecordingError with file:line on anything malformed.

    A last line cut off mid-record (no final newline: a crash or a full disk) is skipped with a
    warning (``warn(msg)`` and ``.warnings``); every complete record before it is kept.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise RecordingError(f"recording not found: {p}") from None
    except OSError as e:
        raise RecordingError(f"cannot read recording {p}: {e.strerror or e}") from None
    # a last line without its newline may be cut mid-character as well as mid-record: decoded on its own
    head, nl, tail = data.rpartition(b"\n")
    head, tail = (head + nl, tail) if nl else (b"", data)
    try:
        text = decode_file(head, str(p))
        tail_text = tail.decode("utf-8") if tail.strip() else ""
    except TextError as e:
        raise RecordingError(str(e)) from None
    except UnicodeDecodeError:
        tail_text = None                    # cut inside a character
    if not text and tail_text is not None and tail_text.startswith("\ufeff"):
        tail_text = tail_text[1:]
    out = Recording(p)
    lines = text.splitlines()
    n_cut = len(lines) + 1 if tail.strip() else 0        # the number of an unterminated last line
    for n, line in enumerate(lines + ([tail_text] if n_cut else []), 1):
        if line is not None and not line.strip():
            continue
        try:
            if line is None:
                raise ValueError("cut inside a UTF-8 character")
            d = load_json(line)
        except ValueError as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            if n == n_cut and n > 1:
                out.warnings.append(f"{p}:{n}: the last line is cut off ({msg}); replaying the "
                                    f"{len(out)} complete records before it")
                if warn:
                    warn(out.warnings[-1])
                break
            raise RecordingError(f"{p}:{n}: not valid JSON ({msg})") from None
        if not isinstance(d, dict):
            raise RecordingError(f"{p}:{n}: a record must be a JSON object")
        try:
            rec = from_dict(d)
        except (RecordingError, TypeError) as e:
            raise RecordingError(f"{p}:{n}: {e}") from None
        if not out and not isinstance(rec, RunHeader):
            raise RecordingError(f"{p}:{n}: a recording starts with a header record")
        out.append(rec)
        out.lines.append(n)
    if not out:
        raise RecordingError(f"{p}: empty recording")
    if out[0].schema > SCHEMA_VERSION:
        raise RecordingError(f"{p}: schema {out[0].schema} is newer than this program's ({SCHEMA_VERSION})")
    return out


# ----------------------------------------------------------------------------- CSV
CSV_COLUMNS = [
    ("request_id", "request number within the session"),
    ("prompt_tokens", "P, prompt length in tokens"),
    ("hit_tokens", "q, target prefix-cache hit (longest common prefix)"),
    ("exact_repeat", "1 if the prompt was an exact repeat served from stored logits"),
    ("reuse", "r of the chosen action"),
    ("k", "k of the chosen action (per-request decision)"),
    ("output_tokens", "generated tokens"),
    ("rounds", "decoding rounds after the first token"),
    ("drafted", "draft tokens proposed (the draft's own rounds; gate copies are in copied)"),
    ("accepted", "draft tokens accepted (the draft's own rounds; gate copies are in copies_accepted)"),
    ("mean_accept_len", "tokens per decoding round after the first token: 1 + (accepted + copies_accepted) / rounds"),
    ("alpha_ewma", "acceptance EWMA at the end of the request"),
    ("prefill_ms", "target prompt forward time (0 on exact repeat)"),
    ("draft_ms", "sum of draft time over rounds (incl. catch-up)"),
    ("verify_ms", "sum of target verify/step time over rounds"),
    ("ttft_ms", "time to first token"),
    ("latency_ms", "request latency"),
    ("predicted_ms", "controller's predicted latency of the chosen action"),
    ("tokens_per_s", "output tokens / latency"),
    ("stopped", "eos | max_new_tokens | stop"),
    ("templated", "1 if the prompt went through the chat template (prompt_tokens counts the templated ids)"),
    ("template_prefix", "leading prompt tokens every templated prompt shares (the template's system prefix)"),
    ("explore_ms", "what probes cost beyond the plain steps they replaced"),
    ("gate_rounds", "drafting rounds the confidence gate decided (policy adaptive:gate)"),
    ("gate_stops", "why the gate's drafts stopped, counted: k_max / gate / cut / source"),
    ("gate_pred", "mean predicted acceptance of the judged drafted tokens (accepted + first rejected)"),
    ("gate_observed", "their observed acceptance rate (compare with gate_pred)"),
    ("copied", "n-gram tokens the confidence gate copied and verified (rounds with draft_source lookup, "
               "k = 0 ones included; as rakv generate --json)"),
    ("copies_accepted", "of them accepted by the target (the explorer's gate copy tokens)"),
    ("shared_steps", "forwards this request shared with other requests (rakv serve --parallel)"),
    ("max_batch", "most requests in one of its shared forwards (1: it never shared one)"),
    ("shared_with", "the requests it shared forwards with, separated by ';'"),
]


def accept_len(accepted: int, rounds: int) -> float:
    """Mean acceptance length: tokens per decoding round (one target forward each) after the first
    token, 1 + accepted / rounds, where ``accepted`` counts every accepted drafted token, the
    confidence gate's n-gram copies included (a k = 0 round that copies 5 tokens gives 6 tokens for
    its forward); 1.0 without rounds. The timing CSV and the bench executions CSV both use it."""
    return round(1 + accepted / rounds, 4) if rounds else 1.0


def request_rows(records: Iterable) -> list[dict]:
    """One row per finished request, columns as in CSV_COLUMNS."""
    rows: dict[int, dict] = {}
    for r in records:
        rid = getattr(r, "request_id", None)
        if isinstance(r, RequestStart):
            rows[rid] = {"request_id": rid, "prompt_tokens": r.prompt_tokens, "prefill_ms": 0.0,
                         "draft_ms": 0.0, "verify_ms": 0.0, "copied": 0, "copies_accepted": 0,
                         "templated": int(r.templated),
                         "template_prefix": r.template_prefix}
        elif isinstance(r, CacheLookup) and rid in rows and r.model == "target":
            rows[rid]["prefill_ms"] = round(r.prefill_ms, 3)
        elif isinstance(r, Round) and rid in rows and r.kind != "prefill":
            rows[rid]["draft_ms"] += r.draft_ms
            rows[rid]["verify_ms"] += r.verify_ms
            if r.draft_source == "lookup":       # gate copies: not in RequestEnd.drafted / accepted
                rows[rid]["copied"] += r.drafted
                rows[rid]["copies_accepted"] += r.accepted
            if r.draft_stop:
                _gate_row(rows[rid], r)
        elif isinstance(r, Step):
            ids = [q for q, _ in r.requests]
            for q in ids:
                if q in rows:
                    row = rows[q]
                    row["shared_steps"] = row.get("shared_steps", 0) + 1
                    row["max_batch"] = max(row.get("max_batch", 1), len(ids))
                    row.setdefault("_with", set()).update(x for x in ids if x != q)
        elif isinstance(r, RequestEnd) and rid in rows:
            row = rows[rid]
            row.setdefault("shared_steps", 0)
            row.setdefault("max_batch", 1)
            row["shared_with"] = ";".join(str(x) for x in sorted(row.pop("_with", ())))
            row.update(hit_tokens=r.hit_tokens, exact_repeat=int(r.exact_repeat),
                       reuse=r.action.get("reuse", 0), k=r.action.get("k", 0),
                       output_tokens=len(r.output_ids), rounds=r.rounds, drafted=r.drafted,
                       accepted=r.accepted,
                       mean_accept_len=accept_len(r.accepted + row["copies_accepted"], r.rounds),
                       alpha_ewma=round(r.alpha_ewma, 4), ttft_ms=round(r.ttft_ms, 3),
                       latency_ms=round(r.latency_ms, 3),
                       predicted_ms="" if r.predicted_ms is None else round(r.predicted_ms, 3),
                       tokens_per_s=round(r.tokens_per_s, 3), stopped=r.stopped,
                       explore_ms=round(r.explore_ms, 3))
            row["draft_ms"] = round(row["draft_ms"], 3)
            row["verify_ms"] = round(row["verify_ms"], 3)
            if row.get("gate_rounds"):
                stops = row.pop("_stops")
                row["gate_stops"] = " ".join(f"{k}:{stops[k]}" for k in ("k_max", "gate", "cut", "source") if k in stops)
                n, p, h = row.pop("_judged")
                row["gate_pred"] = round(p / n, 4) if n else ""
                row["gate_observed"] = round(h / n, 4) if n else ""
            row["done"] = True
    return [{c: row.get(c, "") for c, _ in CSV_COLUMNS} for row in rows.values() if row.get("done")]


def _gate_row(row: dict, r: "Round") -> None:
    """Fold one gated round into a request row (stops counted; judged tokens' prediction vs outcome)."""
    row["gate_rounds"] = row.get("gate_rounds", 0) + 1
    stops = row.setdefault("_stops", {})
    stops[r.draft_stop] = stops.get(r.draft_stop, 0) + 1
    from .util.acceptance import judged

    n, p, h = row.get("_judged", (0, 0.0, 0))
    js = judged(r.draft_pred, r.drafted, r.accepted)
    row["_judged"] = (n + len(js), p + sum(x for x, _ in js), h + sum(ok for _, ok in js))


def _write_rows(rows: list[dict], columns, out: str | os.PathLike) -> int:
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=[c for c, _ in columns])
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def write_csv(records: Iterable, out: str | os.PathLike) -> int:
    return _write_rows(request_rows(records), CSV_COLUMNS, out)


# ----------------------------------------------------------------------------- oracle CSV
ORACLE_CSV_COLUMNS = [
    ("measurement", "oracle measurement number within the session (0, 1, ...)"),
    ("after_request", "the session's last request before the measurement"),
    ("prompt_tokens", "P, prompt length in tokens"),
    ("hit_tokens", "q, target prefix-cache hit at the measured state"),
    ("exact_repeat", "1 if the measured state held the prompt (exact repeat)"),
    ("max_new_tokens", "N asked for"),
    ("output_tokens", "tokens generated (the same for every action)"),
    ("repeats", "R, timed runs per action"),
    ("reuse", "r of this action"),
    ("k", "k of this action"),
    ("feasible", "1 if the controller considered the action feasible"),
    ("predicted_ms", "the controller's predicted latency of this action"),
    ("median_ms", "median measured latency over the R runs"),
    ("min_ms", "fastest run"),
    ("max_ms", "slowest run"),
    ("runs_ms", "every run's latency, separated by ';'"),
    ("chosen", "1 for the controller's choice"),
    ("oracle", "1 for the measured best feasible action"),
    ("regret", "(median(choice) - median(oracle)) / median(oracle), same on every row"),
    ("adaptive_ms", "median latency of the adaptive policy itself on the same state"),
    ("exact", "1 if every run produced the same tokens"),
]


def oracle_rows(records: Iterable) -> list[dict]:
    """One row per action per oracle measurement, columns as in ORACLE_CSV_COLUMNS."""
    rows = []
    n = 0
    for r in records:
        if not isinstance(r, OracleResult):
            continue
        for a in r.actions:
            is_ = lambda d: int(d.get("reuse") == a["reuse"] and d.get("k") == a["k"])  # noqa: E731
            rows.append({"measurement": n, "after_request": r.after_request, "prompt_tokens": r.prompt_tokens,
                         "hit_tokens": r.hit_tokens, "exact_repeat": int(r.exact_repeat),
                         "max_new_tokens": r.max_new_tokens, "output_tokens": r.output_tokens,
                         "repeats": r.repeats, "reuse": a["reuse"], "k": a["k"], "feasible": int(a["feasible"]),
                         "predicted_ms": "" if a.get("predicted_ms") is None else a["predicted_ms"],
                         "median_ms": a["median_ms"], "min_ms": a["min_ms"], "max_ms": a["max_ms"],
                         "runs_ms": ";".join(f"{x:g}" for x in a.get("runs_ms", [])),
                         "chosen": is_(r.choice), "oracle": is_(r.oracle),
                         "regret": "" if r.regret is None else round(r.regret, 5),
                         "adaptive_ms": "" if r.adaptive_ms is None else r.adaptive_ms, "exact": int(r.exact)})
        n += 1
    return rows


def oracle_csv_path(out: str | os.PathLike) -> Path:
    """Where the oracle CSV goes beside a timing CSV: ``timings.csv`` -> ``timings.oracle.csv``."""
    p = Path(out)
    return p.with_name(p.stem + ".oracle" + (p.suffix or ".csv"))


def write_oracle_csv(records: Iterable, out: str | os.PathLike) -> int:
    return _write_rows(oracle_rows(records), ORACLE_CSV_COLUMNS, out)
