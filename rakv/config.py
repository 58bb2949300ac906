"""One frozen configuration passed top-down (engine, controller, cache, CLI, GUI).

Every default lives here, in one place, with the sampling settings (``Sampling``: pure data and
its checks; the sampler's arithmetic is rakv.decoding.sampling's).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from .util.paths import env_on

DEFAULT_K_SET: tuple[int, ...] = (0, 1, 2, 4, 6, 8)
POLICIES_HELP = "adaptive | adaptive:gate | adaptive:nogate | adaptive:tree | ar | kv | spec:K | joint:K | tree:N"
TREE_MAX_NODES = 16         # a tree verify of up to 17 rows keeps the block kernel's own attention
PREFILL_CHUNK = 64        # prompt tokens a request feeds a step while others decode (rakv serve --parallel)
LOOKUP_K = 16             # an n-gram lookup may verify up to this many tokens: drafting it is free, a verify of 17 costs ~1.7 steps
HISTORY_TOKENS = 32768    # token ids of earlier requests an n-gram lookup may copy from (256 KiB; 0: off)
DRAFT_VOCAB = 65536       # a separate draft model of a vocabulary of at least twice this drafts from its first this many ids
GATE_BY_DEFAULT = True    # plain "adaptive" = adaptive:gate: it measured at least as fast as the paper's controller (docs/controller.md#constants)


VERIFY_MODES = ("seeded", "rejection")
SEED_LIMIT = 2**63                # seeds are in [0, 2**63)


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature, filters, seed and the verification mode."""

    temperature: float = 0.0      # 0 = greedy: exactly argmax, today's path
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # (0, 1]; 1 = off
    min_p: float = 0.0            # [0, 1); 0 = off
    seed: int | None = None       # None until drawn: see draw_seed()
    verify: str = "seeded"        # "seeded" | "rejection"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def key(self) -> str:
        """What acceptance is learned per: temperature and filters (and the verification mode);
        the seed is not part of it. "greedy" at temperature 0, whatever the filters."""
        if self.greedy:
            return "greedy"
        return (f"T{self.temperature:g}/k{self.top_k}/p{self.top_p:g}/m{self.min_p:g}"
                f"/{self.verify}")

    def for_request(self, i: int) -> "Sampling":
        """The settings of request i of one call: seed + i (mod 2**63). Greedy settings without a
        seed stay without one."""
        if self.seed is None:
            if self.greedy:
                return self
            raise ValueError("sampling needs a seed: draw one with draw_seed()")
        return replace(self, seed=(self.seed + i) % SEED_LIMIT)

    def to_dict(self) -> dict:
        return asdict(self)


def problem(s: Sampling) -> str | None:
    """One line saying what is wrong with ``s``, or None when every value is allowed."""
    t = s.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
    k = s.top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        return f"top-k must be an integer >= 0 (0 = off), got {k!r}"
    p = s.top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:   # NaN fails too
        return f"top-p must be in (0, 1] (1 = off), got {p!r}"
    m = s.min_p
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
        return f"min-p must be in [0, 1) (0 = off), got {m!r}"
    seed = s.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < SEED_LIMIT):
        return f"seed must be an integer in [0, 2**63), got {seed!r}"
    if s.verify not in VERIFY_MODES:
        return f"verify must be one of {', '.join(VERIFY_MODES)}, got {s.verify!r}"
    return None


def draw_seed() -> int:
    """A fresh seed in [0, 2**63) from os.urandom; record it, and any run can be reproduced."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def env_fast() -> bool:
    """The fast forward path's default: on unless ``RAKV_FAST`` is 0 / false / off / no."""
    return env_on("RAKV_FAST")


# The demo's default draft: prompt lookup. Its step is free, so speculation pays wherever the answer
# copies the prompt (alpha* of k = 1 is ~0.01) and k = 0 stays where it finds nothing. The int8 copy
# (``--draft int8``, by name) cannot pay under q8 numerics: its step measured 2.2x the demo's target step
# on the 2-core Intel Xeon VM (2026-12-07; 16.2 vs 7.4 ms before), so its alpha* is "never".
DEMO_DRAFT = "ngram"
GENERIC_DRAFT = "int8"          # any other target's default draft


def default_draft(target: str | None) -> str:
    """The draft a target gets when none is named: the demo's ``DEMO_DRAFT`` (the draft that pays on
    its copies under q8 numerics), any other target's ``GENERIC_DRAFT``."""
    return DEMO_DRAFT if (target or "demo").strip() == "demo" else GENERIC_DRAFT


@dataclass(frozen=True)
class RakvConfig:
    # models
    target: str = "demo"            # hub id, local dir, .gguf file, or "demo"
    draft: str | None = None        # model (same forms), "int8", "ngram", "none"; None: default_draft(target)
    revision: str | None = None     # hub revision for hub ids
    dtype: str = "float32"
    numerics: str = "auto"          # the target's (and a model draft's) linears: q8 | fp32 | auto (q8 for a GGUF-backed model)
    draft_vocab: int = DRAFT_VOCAB  # a separate large-vocabulary draft model drafts from its first this many ids (0: all)
    draft_codes: str = "auto"       # a separate draft model's codes: file | q4 | auto (q4 under q8 numerics)
    device: str = "auto"            # auto (cuda, else mps, else cpu) | cpu | cuda | mps; the CLI stores the resolved one
    fast: bool = field(default_factory=env_fast)  # packed oneDNN linears on CPU (rakv.kernels.fastpath); --no-fast / RAKV_FAST=0
    threads: int | None = None      # torch.set_num_threads; None = torch default
    # prompts
    chat_template: bool = True      # apply the tokenizer's chat template (if it has one); False = raw text
    # decoding
    policy: str = "adaptive"        # adaptive | ar | kv | spec:K | joint:K
    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)   # temperature 0 = greedy; a seed is drawn if none
    k_set: tuple[int, ...] = DEFAULT_K_SET
    # prefix cache
    budget_mib: float = 512.0
    bucket_tokens: int = 16          # paper: BLAKE2b over the first 16 token ids
    history_tokens: int = HISTORY_TOKENS  # with r = 1, n-gram lookups also copy earlier requests' outputs
    # n-gram prompt lookup draft
    ngram_sizes: tuple[int, ...] = (3, 2)
    lookup_k: int = LOOKUP_K         # longest gated n-gram lookup verify (past max(k_set); the gate picks the length)
    # controller
    granularity: str = "request"     # "request" (paper; measured faster here) or "round" (re-decide k every round)
    alpha_decay: float = 0.3         # EWMA weight of the newest round's acceptance
    alpha_prior: float | None = None  # None: from calibration
    probe_every: int = 8             # at least this many non-drafting rounds between probes
    explore_share: float = 0.005     # probes may spend this share of the stream's time (priced, budgeted)
    force_action: tuple[int, int] | None = None  # (r, k) override, GUI "force"

    def with_(self, **kw) -> "RakvConfig":
        return replace(self, **kw)

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mib * 1024 * 1024)

    def __post_init__(self):
        if self.draft is None:              # no draft named: the target's default (default_draft)
            object.__setattr__(self, "draft", default_draft(self.target))


@dataclass(frozen=True)
class Policy:
    """A parsed policy: ``adaptive`` or a fixed action (reuse, k)."""

    name: str
    reuse: bool = False
    k: int = 0
    adaptive: bool = False
    gate: bool = False          # the confidence gate (rakv.decide.gate) cuts each drafting round
    tree: bool = False          # tree:N: reuse, and each round verifies an n-gram token tree of up to k = N nodes;
                                # adaptive:tree: each round the tree of up to TREE_MAX_NODES with the most
                                # expected tokens per ms (none: a plain step)

    @staticmethod
    def parse(text: str) -> "Policy":
        t = text.strip().lower()
        if t == "adaptive":
            return Policy("adaptive", adaptive=True, gate=GATE_BY_DEFAULT)
        if t == "adaptive:tree":     # the controller's reuse; each round's tree (none, a chain, a tree) priced
            return Policy(t, adaptive=True, tree=True)
        if t in ("adaptive:gate", "adaptive:nogate"):
            return Policy(t, adaptive=True, gate=t == "adaptive:gate")
        if t == "ar":
            return Policy("ar", reuse=False, k=0)
        if t == "kv":
            return Policy("kv", reuse=True, k=0)
        for prefix, reuse in (("spec:", False), ("joint:", True)):
            if t.startswith(prefix):
                try:
                    k = int(t[len(prefix):])
                except ValueError:
                    raise ValueError(f"bad policy {text!r}: k must be an integer ({POLICIES_HELP})") from None
                if k < 0:
                    raise ValueError(f"bad policy {text!r}: k must be >= 0")
                return Policy(t, reuse=reuse, k=k)
        if t.startswith("tree:"):
            try:
                n = int(t[len("tree:"):])
            except ValueError:
                raise ValueError(f"bad policy {text!r}: N must be an integer ({POLICIES_HELP})") from None
            if not 1 <= n <= TREE_MAX_NODES:
                raise ValueError(f"bad policy {text!r}: N (tree nodes) must be 1..{TREE_MAX_NODES}")
            return Policy(t, reuse=True, k=n, tree=True)
        raise ValueError(f"unknown policy {text!r} (expected {POLICIES_HELP})")


def parse_k_set(text: str) -> tuple[int, ...]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip() != ""})
    except ValueError:
        raise ValueError(f"bad --k-set {text!r}: expected comma-separated integers like 0,1,2,4") from None
    if not ks:
        raise ValueError("--k-set is empty")
    if any(k < 0 for k in ks):
        raise ValueError(f"bad --k-set {text!r}: k must be >= 0")
    if any(k > 64 for k in ks):
        raise ValueError(f"bad --k-set {text!r}: k above 64 is not supported")
    return tuple(ks)
