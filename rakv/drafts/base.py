"""Draft sources: propose k tokens, then update on the verified outcome.

Like transformers' ``CandidateGenerator``: the engine calls ``begin`` once per request,
``propose(ids, k)`` before each verify, and ``commit(ids)`` after it. What a source can do is
declared on its class (``DraftSource``'s capabilities), so the engine, the planner, the oracle and
calibration ask it, never its type. A new draft is one module in this package and one line in
``rakv.drafts.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import decoding as dec
from ..prefix_cache import Hit, PrefixCache
from ..config import Sampling

now = dec.now


@dataclass
class Proposal:
    tokens: list[int]
    ms: float = 0.0                 # total drafting time, catch-up included
    catchup_tokens: int = 0         # tokens fed beyond the usual 1-2 (lazy catch-up / prompt)
    catchup_ms: float = 0.0
    prefill: "PrefillInfo | None" = None   # set on the request's first proposal (draft prompt KV)
    fed: int = 0                    # tokens the first draft forward read (2 after a fully accepted round)
    forward_ms: float = 0.0         # this round's draft forwards alone (the prompt's prefill left out)
    q_logits: object = None         # [k, V] the draft's logits per token (rejection verify); None: a point mass


@dataclass
class PrefillInfo:
    hit: Hit
    ms: float
    stored: bool
    lookup_ms: float


class DraftSource:
    """Interface. ``name`` shows in records; ``key`` names its prefix-cache entries and cost profile.

    Declared capabilities (class attributes; what callers ask instead of the source's type):

    - ``proposes``: it proposes tokens at all (False: every round is k = 0).
    - ``has_model``: a draft model with its own KV cache (``lm``): its prompt prefill D_pf and its
      step d apply, and it keeps its own prefix-cache entries under ``key``.
    - ``copies``: it proposes copies of earlier text (prompt lookup: ``sizes``, ``match(ids, k)``,
      ``propose_tree``): free to draft, so it serves as the gate's lookup itself, may verify more
      than max(K), and can repeat a whole earlier output of the same prompt.
    """

    name = "none"
    key = ""
    proposes = True
    has_model = False
    copies = False
    lm = None                          # the draft model (``has_model``)
    sampling: Sampling | None = None   # set by the engine per request; None or greedy: argmax drafts

    def begin(self, prompt_ids: list[int], store: PrefixCache | None, reuse: bool) -> None:
        pass

    def prepare(self) -> float:
        """Make what a first proposal needs (a lazy int8 draft's model); the ms it took, which is
        not a draft step's cost and stays out of every measured round."""
        return 0.0

    def propose(self, ids: list[int], k: int, gate=None, match=None) -> Proposal:
        """Up to k tokens after ``ids``. With a ``gate`` (rakv.gate.RoundGate), each token's
        confidence goes to ``gate.keep_going(conf)``, which may stop the draft early. ``match``:
        what ``match(ids, k)`` returned for these ids (an n-gram draft does not look again)."""
        return Proposal([])

    def commit(self, ids: list[int]) -> None:
        pass

    def fork(self) -> "DraftSource":
        """A source for another request stream running beside this one (a lane of
        ``rakv.engine.batch``): shares what is read-only (a model's weights), owns its per-request state."""
        return type(self)()

    def end(self) -> None:
        pass
