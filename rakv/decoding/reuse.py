"""The target's (or a draft model's) prompt prefill through the prefix cache (``prefill_with_reuse``):
clone the reusable positions, forward the rest, store the prompt's KV for later requests."""

from __future__ import annotations

from dataclasses import dataclass

from .. import decoding as dec
from ..load.loaded import LoadedModel
from ..prefix_cache import Hit, PrefixCache

now = dec.now


@dataclass
class PrefillResult:
    cache: object
    logits: object            # [V] next-token logits after the prompt (None for a draft exact hit)
    hit: Hit
    forward_ms: float
    lookup_ms: float
    stored: bool


def prefill_with_reuse(lm: LoadedModel, ids: list[int], store: PrefixCache | None,
                       need_logits: bool = True) -> PrefillResult:
    """Prompt KV via the prefix cache: clone q-1 positions (or all P + stored logits on exact repeat),
    forward only the rest, and store the prompt's KV for later requests."""
    P = len(ids)
    hit = Hit()
    lookup_ms = 0.0
    if store is not None:
        t0 = now()
        hit = store.lookup(lm.key, ids)
        if hit.entry is not None and hit.q == P == len(hit.entry.ids) and not need_logits:
            hit.exact = True            # a draft needs no logits: all P positions are usable
        lookup_ms = (now() - t0) * 1e3
    use = hit.usable
    forward_ms = 0.0
    if use > 0:
        cache = dec.cache_from(store.clone_kv(hit))
    else:
        cache = dec.DynamicCache()
    if hit.exact and use == P:
        logits = hit.entry.logits.clone() if hit.entry.logits is not None else None
    else:
        t0 = now()
        logits = dec.prefill(lm.model, ids[use:], cache)
        forward_ms = (now() - t0) * 1e3
    stored = False
    if store is not None and not hit.exact:
        keep = logits.clone() if need_logits else None
        nbytes = dec.kv_nbytes(cache, P) + (0 if keep is None else keep.numel() * keep.element_size())
        if nbytes <= store.budget:
            stored = store.store(lm.key, ids, dec.kv_of(cache, P), keep)
        else:
            store.stats.rejected += 1
    return PrefillResult(cache, logits, hit, forward_ms, lookup_ms, stored)
