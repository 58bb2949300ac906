"""A draft model (a separate model, the int8 self-draft, a layer-truncated one): its own KV cache
and its own prefix-cache entries. It catches up lazily: after k=0 rounds it feeds every token it
missed in one forward the next time it drafts, and that cost is reported as catch-up."""

from __future__ import annotations

import torch

from .. import decoding as dec
from ..decoding import sampling as S
from ..backends import lean_of
from ..load.loaded import LoadedModel
from ..decoding.reuse import prefill_with_reuse
from ..prefix_cache import PrefixCache
from ..config import Sampling
from .base import DraftSource, PrefillInfo, Proposal, now


def draft_token(logits, s: Sampling | None, position: int) -> int:
    """The drafted token at output ``position``: the argmax when greedy; under sampling the same
    noise as the target's sample there (seeded: a coupled draft) or a sample of q (rejection)."""
    return dec.argmax(logits) if s is None else S.propose(logits, s, position)


def confidence(logits, s: Sampling | None, token: int) -> float:
    """The draft's confidence in ``token`` for the gate: its top probability when greedy, else the
    token's probability under the draft's filtered, tempered distribution."""
    if s is None:
        return dec.top_prob(logits)
    return float(S.logprobs(logits, s)[token].exp())


def vocab_ids(lm: LoadedModel, n: int):
    """The ids a draft model drafts from when limited to ``n``: its first n (a BPE vocabulary runs
    in merge order, the most frequent pieces first) and its end-of-sequence ids; None (every id)
    where n is 0 or covers the vocabulary, or the model has no lean forward to limit."""
    import torch

    if n <= 0:
        return None
    lean = lean_of(lm.model) if lm.lean else None
    if lean is None or not hasattr(lean, "limit_head") or n >= lm.vocab_size:
        return None
    V = lm.vocab_size
    extra = sorted(e for e in lm.eos_ids if n <= e < V)
    return torch.cat([torch.arange(n), torch.tensor(extra, dtype=torch.long)])


class ModelDraft(DraftSource):
    """A draft model with its own DynamicCache and its own prefix-cache entries. ``vocab``: draft
    from its first ``vocab`` ids (and its end-of-sequence ids) only, its head reading those rows
    (``vocab_ids``; 0: every id). Any draft keeps every policy exact: the target verifies."""

    has_model = True

    def __init__(self, lm: LoadedModel, vocab: int = 0):
        self.lm = lm
        self.name = lm.name
        self.key = lm.key
        self.vocab = 0
        ids = vocab_ids(lm, vocab)
        if ids is not None:
            lean_of(lm.model).limit_head(ids)
            self.vocab = vocab
            self.name = f"{lm.name} ({vocab} ids)"
            self.key = f"{lm.key}+v{vocab}"          # its own cost profile (its step is cheaper)
        self._reset()

    def _reset(self):
        self.cache = None
        self.cached: list[int] = []       # the token ids whose KV the draft cache holds
        self.prompt: list[int] = []
        self.store: PrefixCache | None = None
        self.reuse = False

    def prepare(self) -> float:
        t0 = now()
        self.lm.model            # noqa: B018 - a lazy draft's model is made on first use
        return (now() - t0) * 1e3

    def begin(self, prompt_ids, store, reuse):
        self._reset()
        self.prompt = list(prompt_ids)
        self.store, self.reuse = store, reuse

    def _prefill_prompt(self) -> PrefillInfo:
        """First proposal of a request: the draft's prompt KV, from its prefix-cache entry if any."""
        res = prefill_with_reuse(self.lm, self.prompt, self.store if self.reuse else None,
                                 need_logits=False)
        self.cache = res.cache
        self.cached = list(self.prompt[: dec.cache_len(self.cache)])
        return PrefillInfo(hit=res.hit, ms=res.forward_ms, stored=res.stored, lookup_ms=res.lookup_ms)

    def propose(self, ids: list[int], k: int, gate=None, match=None) -> Proposal:
        if k <= 0:
            return Proposal([])
        t0 = now()
        info = self._prefill_prompt() if self.cache is None else None
        n = len(self.cached)
        new = ids[n:]                               # >= 1 token: at least the pending one
        model = self.lm.model
        ta = now()
        logits = dec.prefill(model, new, self.cache)
        first_ms = (now() - ta) * 1e3
        s = self.sampling if self.sampling is not None and not self.sampling.greedy else None
        pos = len(ids) - len(self.prompt)              # the output position of the first drafted token
        rows = [logits] if s is not None and s.verify == "rejection" else None
        toks = [draft_token(logits, s, pos)]
        while len(toks) < k and (gate is None or gate.keep_going(confidence(logits, s, toks[-1]))):
            logits = dec.decode_one(model, toks[-1], self.cache)
            toks.append(draft_token(logits, s, pos + len(toks)))
            if rows is not None:
                rows.append(logits)
        if gate is not None and len(gate.confs) < len(toks):
            gate.keep_going(confidence(logits, s, toks[-1]))      # the last token's confidence
        self.cached = list(ids) + toks[:-1]
        catch = max(0, len(new) - 2)   # 1 (pending) or 2 (last accepted + pending) is a normal round
        ms = (now() - t0) * 1e3
        return Proposal(toks, ms=ms, catchup_tokens=catch, catchup_ms=first_ms if catch else 0.0,
                        prefill=info, fed=len(new), forward_ms=(now() - ta) * 1e3,
                        q_logits=None if rows is None else torch.stack(rows))

    def commit(self, ids: list[int]) -> None:
        """Roll the draft cache back to the longest prefix that is still committed."""
        if self.cache is None:
            return
        n = min(len(self.cached), len(ids))
        i = len(self.prompt)
        # the prompt part always agrees; compare only the generated tail
        while i < n and self.cached[i] == ids[i]:
            i += 1
        i = min(i, n, len(ids) - 1)      # the pending token stays unfed: the next proposal feeds it
        if i < len(self.cached):
            dec.crop_to(self.cache, i)
            del self.cached[i:]

    def fork(self) -> "ModelDraft":
        return ModelDraft(self.lm, self.vocab)

    def end(self) -> None:
        self.cache = None
