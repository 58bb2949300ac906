"""Watching a vLLM server's ``/metrics``: successive scrapes turned into plain records.

vLLM (0.32, V1 engine) exposes Prometheus counters, labelled ``engine`` and ``model_name``; this
module reads the ones about speculation and the prefix cache:

  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position="j"}``,
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
  ``vllm:prompt_tokens_cached_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason=...}`` and the histogram
  ``vllm:inter_token_latency_seconds`` (its ``_sum`` and ``_count``).

Names are matched with or without the ``_total`` suffix (an OpenMetrics
exposition, or a client's own renaming) and summed over every label set (engines, models, finish
reasons). ``_created`` samples are ignored.

A ``Watch`` keeps the last scrape: each new one gives a ``WatchRecord`` with the totals since the
server started (``total``) and what happened since the previous scrape (``delta``). A counter that
went down (or vanished) means another server process answers now (restarted): the record says
``restarted`` and the watch starts fresh from it (no delta across the restart).

No vLLM import, no Qt: text in, frozen dataclasses out. Only ``GET`` is ever sent (``fetch``).
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

from ..decide.policy import alpha_star
from ..decide.profile import load_vllm_profile, verify_costs
from .vllm_advise import acceptance, parse_prometheus

# base name (no "vllm:", no "_total") -> field of Counters
COUNTERS = {
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted",
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "prompt_tokens_cached": "prompt_cached",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "requests",
    "inter_token_latency_seconds_sum": "itl_sum_s",
    "inter_token_latency_seconds_count": "itl_count",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
EPS = 1e-6          # counters are floats: a fall smaller than this is not a restart


def base_name(name: str) -> str | None:
    """``vllm:prefix_cache_hits_total`` -> ``prefix_cache_hits`` (None: not a vLLM sample, or a
    ``_created`` timestamp)."""
    if not name.startswith("vllm:"):
        return None
    n = name[5:]
    if n.endswith("_created"):
        return None
    if n.endswith("_total"):
        n = n[:-6]
    return n


@dataclass(frozen=True)
class Counters:
    """vLLM's counters at one scrape (or their difference between two), summed over labels.
    ``present``: the counters the server exposes (a server without speculation has no spec_decode
    ones; a field absent there is 0 here)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple = ()                 # accepted tokens at draft position 0, 1, ...
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    prompt_cached: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests: float = 0.0
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    present: frozenset = field(default_factory=frozenset)
    models: tuple = ()

    # ------------------------------------------------------------------ derived
    @property
    def speculating(self) -> bool:
        return "drafts" in self.present or "per_pos" in self.present

    @property
    def k(self) -> int:
        """The positions vLLM counts (its num_speculative_tokens)."""
        return len(self.per_pos)

    def _acc(self) -> dict:
        return acceptance({"drafts": self.drafts, "accepted": self.accepted,
                           "per_pos": dict(enumerate(self.per_pos)),
                           "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits})

    @property
    def per_position(self) -> list:
        """vLLM's own per-position acceptance rate: drafts whose position j was accepted, over drafts."""
        return [round(a / self.drafts, 4) if self.drafts > 0 else None for a in self.per_pos]

    @property
    def conditional(self) -> list:
        """Position j's rate given that j - 1 was accepted, a_j / a_(j-1) (a_-1 = drafts)."""
        return self._acc()["per_position"]

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance, pooled over positions: sum a_j / sum a_(j-1) (the alpha of
        E_k(alpha) and of the crossover alpha*(k))."""
        return self._acc()["alpha"]

    @property
    def mean_accepted(self) -> float | None:
        """Draft tokens accepted per draft (vLLM's "mean acceptance length" is this plus one)."""
        return round(self.accepted / self.drafts, 4) if self.drafts > 0 else None

    @property
    def draft_acceptance(self) -> float | None:
        """Accepted over drafted tokens."""
        return round(self.accepted / self.draft_tokens, 4) if self.draft_tokens > 0 else None

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hits over queries, in tokens."""
        return round(self.prefix_hits / self.prefix_queries, 4) if self.prefix_queries > 0 else None

    @property
    def itl_ms(self) -> float | None:
        """Mean inter-token latency in ms (vLLM's own measured time per output token)."""
        return round(self.itl_sum_s / self.itl_count * 1e3, 3) if self.itl_count > 0 else None

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in ("drafts", "draft_tokens", "accepted", "prefix_queries", "prefix_hits",
                                             "prompt_cached", "prompt_tokens", "generation_tokens", "requests")}
        d.update(per_pos=list(self.per_pos), per_position=self.per_position, conditional=self.conditional,
                 alpha=self.alpha, mean_accepted=self.mean_accepted, draft_acceptance=self.draft_acceptance,
                 hit_rate=self.hit_rate, itl_ms=self.itl_ms, k=self.k, models=list(self.models))
        return d


def counters(text: str) -> Counters:
    """One scrape's counters from a /metrics text (ValueError: no vLLM metric in it)."""
    vals: dict[str, float] = {}
    pos: dict[int, float] = {}
    models: set[str] = set()
    seen = False
    for name, labels, v in parse_prometheus(text):
        b = base_name(name)
        if b is None:
            continue
        seen = True
        if "model_name" in labels:
            models.add(labels["model_name"])
        if not math.isfinite(v):
            continue
        if b == PER_POS:
            try:
                j = int(labels.get("position", 0))
            except ValueError:
                continue
            pos[j] = pos.get(j, 0.0) + v
        elif b in COUNTERS:
            f = COUNTERS[b]
            vals[f] = vals.get(f, 0.0) + v
    if not seen:
        raise ValueError("the answer has no vllm: metrics (is this a vLLM server's /metrics?)")
    present = set(vals) | ({"per_pos"} if pos else set())
    per_pos = tuple(pos.get(j, 0.0) for j in range(max(pos) + 1)) if pos else ()
    return Counters(**{k: v for k, v in vals.items()}, per_pos=per_pos, present=frozenset(present),
                    models=tuple(sorted(models)))


_FIELDS = ("drafts", "draft_tokens", "accepted", "prefix_queries", "prefix_hits", "prompt_cached", "prompt_tokens",
           "generation_tokens", "requests", "itl_sum_s", "itl_count")


def went_down(old: Counters, new: Counters) -> bool:
    """A counter lower than before, or one that vanished: another server process answers."""
    if any(getattr(new, f) < getattr(old, f) - EPS for f in _FIELDS):
        return True
    if len(new.per_pos) < len(old.per_pos):
        return True
    if any(b < a - EPS for a, b in zip(old.per_pos, new.per_pos)):
        return True
    return bool(old.present - new.present)


def delta(old: Counters, new: Counters) -> Counters:
    """What happened between two scrapes of one server (new - old)."""
    n = max(len(old.per_pos), len(new.per_pos))
    a = old.per_pos + (0.0,) * (n - len(old.per_pos))
    b = new.per_pos + (0.0,) * (n - len(new.per_pos))
    return Counters(**{f: getattr(new, f) - getattr(old, f) for f in _FIELDS},
                    per_pos=tuple(y - x for x, y in zip(a, b)), present=new.present, models=new.models)


@dataclass(frozen=True)
class WatchRecord:
    """One poll of a watched vLLM server."""

    poll: int                     # polls of this watch that answered (1 = the first)
    t: float                      # seconds since the watch started (the caller's clock)
    total: Counters               # since the server (re)started
    delta: Counters | None        # since the previous poll (None: the first, or after a restart)
    restarted: bool = False       # the counters went down: a new server process (the series starts again)
    restarts: int = 0             # restarts seen by this watch so far


class Watch:
    """Successive scrapes of one server -> WatchRecords (the previous scrape is kept)."""

    def __init__(self):
        self.prev: Counters | None = None
        self.polls = 0
        self.restarts = 0

    def update(self, text: str, t: float = 0.0) -> WatchRecord:
        new = counters(text)
        self.polls += 1
        restarted = self.prev is not None and went_down(self.prev, new)
        if restarted:
            self.restarts += 1
        d = None if self.prev is None or restarted else delta(self.prev, new)
        self.prev = new
        return WatchRecord(self.polls, float(t), new, d, restarted, self.restarts)


# ----------------------------------------------------------------------------- URL, fetch, costs
def metrics_url(text: str) -> str:
    """A vLLM server's /metrics URL from what a user typed: ``host:port``, ``http://host:port``,
    its OpenAI base URL (``.../v1``) or the metrics URL itself (ValueError: one line)."""
    from ..serve.api import user_url

    u = user_url(text, ("http", "https"), "watched")
    path = u.path.rstrip("/")
    for tail in ("/metrics", "/v1"):
        if path.endswith(tail):
            path = path[: -len(tail)]
            break
    return f"{u.scheme}://{u.netloc}{path}/metrics"


def fetch(url: str, timeout: float = 5.0) -> str:
    """One scrape: ``GET url`` (a /metrics URL); OSError on failure. Never anything but GET."""
    req = urllib.request.Request(url, method="GET", headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout) as r:        # noqa: S310 - the user's own server
        return r.read().decode("utf-8", "replace")


@dataclass(frozen=True)
class Crossover:
    """A vLLM cost profile's measured costs and the crossover alpha*(k) per k."""

    path: str
    t_ms: float
    V_ms: dict                    # k -> V(k) ms (k >= 1, interpolated as the proposer does)
    alpha_star: dict              # "k" -> alpha* (None: never pays)
    measured_ks: tuple            # the k the profile measured

    def star(self, k: int) -> float | None:
        return self.alpha_star.get(str(k))


def crossover(path: str, k_max: int = 8) -> Crossover:
    """The crossover of a profile written by ``rakv calibrate --engine vllm`` (ValueError: not one)."""
    try:
        prof = load_vllm_profile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the cost profile {path}: {e}") from None
    if not isinstance(prof, dict) or "t_ms" not in prof:
        raise ValueError(f"{path} is not a vLLM cost profile (no t_ms; make one with `rakv calibrate --engine vllm`)")
    try:
        ks = tuple(sorted(int(k) for k in prof.get("V_ms", {})))
        V = verify_costs(prof, max(k_max, max(ks, default=1)))
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: bad V_ms ({e})") from None
    return Crossover(str(path), round(V[0], 3), {k: round(v, 3) for k, v in enumerate(V) if k}, alpha_star(V), ks)
