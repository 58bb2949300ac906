"""The paper's cache rules."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from rakv.config import RakvConfig
from rakv.drafts import ModelDraft
from rakv.engine import Engine
from rakv.prefix_cache import PrefixCache, bucket_digest, lcp
from rakv.records import CacheLookup
from tests.tiny import make_pair, oracle


def kv(n, layers=2, val=0.0):
    return [(torch.full((1, 2, n, 4), val), torch.full((1, 2, n, 4), val)) for _ in range(layers)]


def entry_bytes(n, layers=2, logits=8):
    return layers * 2 * (2 * n * 4 * 4) + logits * 4


def test_bucket_is_blake2b_96_of_first_16_ids():
    ids = list(range(100, 140))
    want = hashlib.blake2b(np.asarray(ids[:16], dtype="<i4").tobytes(), digest_size=12).digest()
    assert bucket_digest(ids) == want and len(want) == 12
    assert bucket_digest(ids) == bucket_digest(ids[:16] + [1, 2, 3])
    assert bucket_digest(ids) != bucket_digest([0] + ids[1:])


def test_lcp():
    a = np.array([1, 2, 3, 4]); b = np.array([1, 2, 9])
    assert lcp(a, b) == 2 and lcp(a, a) == 4 and lcp(a, a[:0]) == 0


def test_lookup_longest_common_prefix_and_q_minus_1():
    c = PrefixCache(1 << 20)
    base = list(range(50))
    c.store("m", base[:30], kv(30), torch.zeros(8))
    c.store("m", base[:40], kv(40), torch.zeros(8))
    h = c.lookup("m", base[:35] + [999])
    assert h.q == 35 and not h.exact and h.usable == 34
    cloned = c.clone_kv(h)
    assert cloned[0][0].shape[2] == 34
    h = c.lookup("m", base[:40])
    assert h.exact and h.usable == 40
    # a strict prefix of a stored prompt: q = P, boundary recomputed
    h = c.lookup("m", base[:20])
    assert h.q == 20 and not h.exact and h.usable == 19
    # other model key: miss
    assert c.lookup("other", base[:40]).q == 0


def test_short_prompts_reuse_only_on_exact_repeat():
    c = PrefixCache(1 << 20)
    c.store("m", [1, 2, 3, 4, 5, 6], kv(6), torch.zeros(8))
    assert c.lookup("m", [1, 2, 3, 4, 5, 6]).exact
    assert c.lookup("m", [1, 2, 3, 4, 5, 6, 7]).q == 0      # different digest (all of its ids)
    assert c.lookup("m", [1, 2, 3, 4, 5]).q == 0


def test_budget_zero_stores_nothing():
    c = PrefixCache(0)
    assert not c.store("m", list(range(20)), kv(20), torch.zeros(8))
    assert len(c) == 0 and c.bytes_used == 0


def test_entry_larger_than_budget_is_not_stored():
    c = PrefixCache(entry_bytes(10))
    assert c.store("m", list(range(10)), kv(10), torch.zeros(8))
    assert not c.store("m", list(range(100, 120)), kv(20), torch.zeros(8))
    assert len(c) == 1 and c.bytes_used == entry_bytes(10)


def test_lru_eviction_never_exceeds_budget():
    c = PrefixCache(3 * entry_bytes(20))
    prompts = [[i] * 20 for i in range(5)]
    for p in prompts[:3]:
        c.store("m", p, kv(20), torch.zeros(8))
    c.lookup("m", prompts[0])          # touch 0: now 1 is least recently used
    c.store("m", prompts[3], kv(20), torch.zeros(8))
    left = [int(e.ids[0]) for e in c.entries()]
    assert left == [2, 0, 3] and c.stats.evictions == 1
    assert c.bytes_used <= c.budget
    c.set_budget(entry_bytes(20))
    assert [int(e.ids[0]) for e in c.entries()] == [3] and c.bytes_used <= c.budget


def test_bytes_are_counted_for_real():
    c = PrefixCache(1 << 30)
    k = kv(7)
    c.store("m", list(range(7)), k, torch.zeros(8))
    assert c.bytes_used == sum(t.numel() * t.element_size() for kv_ in k for t in kv_) + 32


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", "mostly")


def count_forwards(model):
    n = {"calls": 0}
    h = model.register_forward_pre_hook(lambda *a, **k: n.__setitem__("calls", n["calls"] + 1))
    return n, h


def test_exact_repeat_runs_no_target_forward_for_the_prompt(pair):
    target, draft = pair
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="kv"))
    p = list(range(10, 50))
    first = eng.generate(p, 1)
    n, h = count_forwards(target.model)
    try:
        again = eng.generate(p, 1)
    finally:
        h.remove()
    assert again.exact_repeat and again.hit_tokens == 40
    assert n["calls"] == 0 and again.output_ids == first.output_ids == oracle(target.model, p, 1)


def test_partial_hit_recomputes_from_boundary(pair):
    target, draft = pair
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="kv"), callback=recs.append)
    p = list(range(10, 50))
    eng.generate(p, 4)
    q = p[:30] + [3, 4, 5]
    end = eng.generate(q, 4)
    look = [r for r in recs if isinstance(r, CacheLookup)][-1]
    assert (look.hit_tokens, look.reused_tokens, look.exact_repeat) == (30, 29, False)
    assert end.output_ids == oracle(target.model, q, 4)


def test_draft_prompt_kv_is_reused(pair):
    target, draft = pair
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:4"), callback=recs.append)
    p = list(range(60, 100))
    eng.generate(p, 8)
    eng.generate(p[:35] + [1, 2], 8)
    dl = [r for r in recs if isinstance(r, CacheLookup) and r.model == "draft"]
    assert dl[0].hit_tokens == 0 and dl[0].stored
    assert dl[1].hit_tokens == 35 and dl[1].reused_tokens == 34
    keys = {e.key for e in eng.store.entries()}
    assert keys == {target.key, draft.key}


def test_policies_without_reuse_neither_look_up_nor_store(pair):
    target, draft = pair
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:4"))
    p = list(range(10, 40))
    eng.generate(p, 4)
    end = eng.generate(p, 4)
    assert end.hit_tokens == 0 and len(eng.store) == 0 and eng.store.stats.lookups == 0


def test_lookup_is_fast_with_1000_entries():
    import time

    c = PrefixCache(1 << 34)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, 256).tolist() for _ in range(1000)]
    for p in prompts:
        c.store("m", p, kv(1, layers=1), None)
    assert len(c) == 1000
    # correctness of the fast path under load (the timing figure lives in the benchmark notes)
    assert c.lookup("m", prompts[500]).q == 256


def test_vectorised_bucket_lcp_matches_scalar():
    rng = np.random.default_rng(1)
    c = PrefixCache(1 << 30)
    head = list(range(16))
    stored = [head + rng.integers(0, 5, int(rng.integers(0, 30))).tolist() for _ in range(40)]
    for s in stored:
        c.store("m", s, kv(1, layers=1), torch.zeros(2))
    for _ in range(50):
        q = head + rng.integers(0, 5, int(rng.integers(0, 30))).tolist()
        h = c.peek("m", q)
        want = max(lcp(np.array(q), e.ids) for e in c.entries())
        assert h.q == want
        if h.exact:
            assert list(h.entry.ids) == q


# ----------------------------------------------------------------------------- token history
def test_history_keeps_whole_recent_sequences_within_its_cap():
    from rakv.prefix_cache import TokenHistory

    h = TokenHistory(max_tokens=20)
    h.add([1, 2, 3, 4, 5])
    h.add([6, 7, 8])
    assert h.tokens.tolist() == [-1, 1, 2, 3, 4, 5, -1, 6, 7, 8]
    h.add(list(range(10, 18)))            # 19 tokens: still fits
    assert len(h) == 19
    h.add([30, 31, 32])                   # over the cap: the oldest sequence goes, whole
    assert len(h) <= 20 and h.tokens[0] == -1
    assert h.tokens.tolist() == [-1, 6, 7, 8, -1] + list(range(10, 18)) + [-1, 30, 31, 32]
    h.add(list(range(100, 150)))          # longer than the cap: its tail
    assert len(h) == 20 and h.tokens[0] == -1 and h.tokens[-1] == 149
    off = TokenHistory(max_tokens=0)
    off.add([1, 2, 3])
    assert len(off) == 0


def test_history_snapshot_restore_and_clear():
    c = PrefixCache(1 << 20)
    c.history.add([1, 2, 3])
    snap = c.snapshot()
    c.history.add([4, 5, 6])
    c.restore(snap)
    assert c.history.tokens.tolist() == [-1, 1, 2, 3]
    c.clear()
    assert len(c.history) == 0


def test_history_match_takes_the_longest_context_and_never_crosses_sequences():
    from rakv.drafts import ngram_match
    from rakv.prefix_cache import TokenHistory

    h = TokenHistory()
    h.add([50, 51, 1, 2, 3, 60, 61, 62])      # "1 2 3" after 51: then 60 61 62
    h.add([52, 1, 2, 3, 70, 71])              # later, after 52: then 70 71 (end of that request)
    # the current context ends "51 1 2 3": the older occurrence matches 4 tokens, the newer 3
    assert ngram_match([9, 51, 1, 2, 3], 8, history=h) == ([60, 61, 62], 4)
    # equal context: the latest occurrence; its continuation stops at the end of its request
    assert ngram_match([9, 1, 2, 3], 8, history=h) == ([70, 71], 3)
    # an in-context match as long as the history's wins (prompt lookup, as without a history)
    assert ngram_match([1, 2, 3, 80, 9, 1, 2, 3], 4, history=h)[0] == [80, 9, 1, 2]
    assert ngram_match([9, 1, 2, 3], 8) == ([], 0)               # no history: no match


def test_an_exact_repeat_copies_the_earlier_output_only_with_reuse():
    from rakv.drafts import NgramDraft

    target, _ = make_pair("llama", "mostly")
    p = list(range(5, 45))
    for policy, copies in (("joint:8", True), ("spec:8", False)):
        eng = Engine(target, NgramDraft(), RakvConfig(policy=policy))
        first = eng.generate(p, 24)
        again = eng.generate(p, 24)
        assert first.output_ids == again.output_ids == oracle(target.model, p, 24)
        if copies:       # 23 tokens after the first, 9 a round: 3 rounds, every draft accepted
            assert again.rounds == 3 and again.accepted == again.drafted == 20
        else:            # r = 0: neither the KV nor the history of earlier requests
            assert (again.rounds, again.drafted) == (first.rounds, first.drafted) and len(eng.store.history) == 0


def test_the_controller_knows_an_exact_repeat_will_copy_its_earlier_output():
    from rakv.drafts import NgramDraft
    from rakv.records import Decision
    from tests.test_gate import profile

    target, _ = make_pair("llama", "mostly")
    decisions = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:nogate"),
                 lambda r: decisions.append(r) if isinstance(r, Decision) else None, profile(d=0.0, alpha0=0.1))
    p = list(range(5, 45))
    first = eng.generate(p, 24)
    again = eng.generate(p, 24)
    shorter = eng.generate(p[:30] + [7, 8], 24)        # no exact repeat: no copy
    assert first.output_ids == again.output_ids == oracle(target.model, p, 24)
    assert [d.copy for d in decisions] == [False, True, False]
    assert decisions[1].alpha == 0.99 and decisions[1].action["k"] == max(eng.k_set)
    assert shorter.output_ids == Engine(target, None, RakvConfig(policy="ar")).generate(p[:30] + [7, 8], 24).output_ids
