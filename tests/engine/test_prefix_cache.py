"""The paper's cache rules."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.prefix_cache import PrefixCache, bucket_digest, lcp
from rakv.records import CacheLookup
from tests.tiny import assert_exact, make_pair, oracle


def kv(n, layers=2, val=0.0):
    return [(torch.full((1, 2, n, 4), val), torch.full((1, 2, n, 4), val)) for _ in range(layers)]


def entry_bytes(n, layers=2, logits=8):
    return layers * 2 * (2 * n * 4 * 4) + logits * 4


@pytest.mark.fast
def test_bucket_is_blake2b_96_of_first_16_ids():
    ids = list(range(100, 140))
    want = hashlib.blake2b(np.asarray(ids[:16], dtype="<i4").tobytes(), digest_size=12).digest()
    assert bucket_digest(ids) == want and len(want) == 12
    assert bucket_digest(ids) == bucket_digest(ids[:16] + [1, 2, 3])
    assert bucket_digest(ids) != bucket_digest([0] + ids[1:])


@pytest.mark.fast
def test_lcp():
    a = np.array([1, 2, 3, 4]); b = np.array([1, 2, 9])
    assert lcp(a, b) == 2 and lcp(a, a) == 4 and lcp(a, a[:0]) == 0


@pytest.mark.fast
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


@pytest.mark.fast
def test_short_prompt_rule_at_15_16_17_tokens():
    """Under 16 tokens the bucket is the digest of all of them; from 16 on, of the first 16. So a
    15-token prompt meets only itself; 16 and 17 tokens with the same first 16 share a bucket."""
    base = list(range(40, 60))
    p15, p16, p17 = base[:15], base[:16], base[:17]
    assert bucket_digest(p15) != bucket_digest(p16) == bucket_digest(p17)
    c = PrefixCache(1 << 20)
    c.store("m", p15, kv(15), torch.zeros(8))
    assert c.peek("m", p15).exact and c.peek("m", p15).usable == 15
    assert c.peek("m", p16).q == 0 and c.peek("m", p17).q == 0      # longer: another bucket
    c.store("m", p16, kv(16), torch.zeros(8))
    h = c.peek("m", p17)                                            # 17 meets 16: a partial hit
    assert (h.q, h.exact, h.usable) == (16, False, 15)
    assert c.peek("m", p15).exact and c.peek("m", p15).entry.ids.tolist() == p15   # not the 16's
    assert c.peek("m", base[:14]).q == 0                            # shorter than a short prompt: a miss
    c.store("m", p17, kv(17), torch.zeros(8))
    h = c.peek("m", p16)                                            # 16 is stored itself: exact
    assert h.exact and h.entry.ids.tolist() == p16
    c2 = PrefixCache(1 << 20)
    c2.store("m", p17, kv(17), torch.zeros(8))
    h = c2.peek("m", p16)                                           # a strict prefix of a stored 17
    assert (h.q, h.exact, h.usable) == (16, False, 15)


def test_a_forced_digest_collision_is_caught_by_the_lcp(monkeypatch):
    """Every prompt in one bucket (as if BLAKE2b collided): validation by the exact common prefix
    still reuses only what matches, in the cache and through the engine."""
    import rakv.prefix_cache as pc

    monkeypatch.setattr(pc, "bucket_digest", lambda ids, n=pc.BUCKET_TOKENS: b"\0" * pc.DIGEST_BYTES)
    c = PrefixCache(1 << 20)
    a, b = list(range(100, 130)), list(range(200, 230))
    c.store("m", a, kv(30), torch.zeros(8))
    assert c.lookup("m", b).q == 0 and c.lookup("m", b).usable == 0 and c.stats.hits == 0
    h = c.lookup("m", a[:10] + b[:20])
    assert (h.q, h.usable, h.exact) == (10, 9, False)
    target, draft = make_pair("llama", "mostly")
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:4"))
    for p, hit in ((a, 0), (b, 0), (a[:10] + b[:20], 10), (b, 30)):
        end = eng.generate(p, 8)
        assert end.hit_tokens == hit
        assert_exact(end, target, p, 8)


def test_peek_leaves_lru_order_hits_and_stats_alone():
    c = PrefixCache(3 * entry_bytes(20))
    prompts = [[i] * 20 for i in range(4)]
    for p in prompts[:3]:
        c.store("m", p, kv(20), torch.zeros(8))
    stats = replace(c.stats)
    h = c.peek("m", prompts[0])                      # the oldest: a peek must not make it recent
    assert h.exact and h.entry.hits == 0
    assert c.stats == stats and [int(e.ids[0]) for e in c.entries()] == [0, 1, 2]
    c.store("m", prompts[3], kv(20), torch.zeros(8))
    assert [int(e.ids[0]) for e in c.entries()] == [1, 2, 3]        # 0 was still the least recent
    c.lookup("m", prompts[1])                        # a lookup does
    c.store("m", prompts[0], kv(20), torch.zeros(8))
    assert [int(e.ids[0]) for e in c.entries()] == [3, 1, 0]       # 2 was the least recent now


def test_budget_zero_stores_nothing():
    c = PrefixCache(0)
    assert not c.store("m", list(range(20)), kv(20), torch.zeros(8))
    assert len(c) == 0 and c.bytes_used == 0


def test_entry_larger_than_budget_is_not_stored():
    c = PrefixCache(entry_bytes(10))
    assert c.store("m", list(range(10)), kv(10), torch.zeros(8))
    assert not c.store("m", list(range(100, 120)), kv(20), torch.zeros(8))
    assert len(c) == 1 and c.bytes_used == entry_bytes(10)


@pytest.mark.fast
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


@pytest.mark.fast
def test_bytes_are_counted_for_real():
    c = PrefixCache(1 << 30)
    k = kv(7)
    c.store("m", list(range(7)), k, torch.zeros(8))
    assert c.bytes_used == sum(t.numel() * t.element_size() for kv_ in k for t in kv_) + 32


def count_forwards(monkeypatch, model) -> list:
    """Every forward of ``model`` the engine runs (the lean one or HF's: all go through
    ``rakv.decoding.forward``), as the number of tokens each fed."""
    from rakv import decoding

    fed, real = [], decoding.forward

    def counted(m, tokens, cache, keep=0):
        if m is model:
            fed.append(len(tokens))
        return real(m, tokens, cache, keep)
    monkeypatch.setattr(decoding, "forward", counted)
    return fed


def test_exact_repeat_runs_no_target_forward_for_the_prompt(pair, monkeypatch):
    target, draft = pair
    fed = count_forwards(monkeypatch, target.model)
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="kv"))
    p = list(range(60, 100))
    first = eng.generate(p, 1)
    assert fed == [40]                               # a miss: the prompt's prefill (the counter sees it)
    again = eng.generate(p, 1)
    assert again.exact_repeat and again.hit_tokens == 40
    assert fed == [40] and again.output_ids == first.output_ids == oracle(target, p, 1)
    longer = eng.generate(p, 3)                      # later tokens: one step each, no prompt forward
    assert longer.exact_repeat and len(longer.output_ids) == 3 and fed == [40, 1, 1]
    assert_exact(longer, target, p, 3)


@pytest.mark.fast
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
    assert_exact(end, target, q, 4)


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


def test_lookup_in_a_bucket_of_1000_entries_is_vectorised_and_exact(monkeypatch):
    """1000 prompts with the same first 16 ids: one bucket, compared in one vectorised pass (its
    padded matrix built once, not per lookup), every answer the longest common prefix."""
    import rakv.prefix_cache as pc

    c = PrefixCache(1 << 34)
    rng = np.random.default_rng(0)
    head = list(range(1000, 1016))
    prompts = [head + rng.integers(0, 4, int(rng.integers(0, 60))).tolist() for _ in range(1000)]
    for p in prompts:
        c.store("m", p, kv(1, layers=1), torch.zeros(1))
    assert len(c) == len({tuple(p) for p in prompts}) > 900 and len(c._buckets) == 1
    scalar = []
    monkeypatch.setattr(pc, "lcp", lambda a, b: scalar.append(1) or lcp(a, b))     # the per-entry path
    ids = np.array([e.ids for e in c.entries()], dtype=object)
    queries = [prompts[500], prompts[7][:20], head + [0] * 70, head + [3, 2, 1], head, head[:15] + [1]]
    queries += [head + rng.integers(0, 4, int(rng.integers(0, 70))).tolist() for _ in range(30)]
    for q in queries:
        h = c.lookup("m", q)
        want = max(lcp(np.array(q), e) for e in ids) if q[:16] == head else 0      # else: another bucket
        assert h.q == want, q
        if want:
            assert lcp(np.array(q), h.entry.ids) == want
            assert h.exact == (want == len(q) == len(h.entry.ids))
    assert not scalar                                # never entry by entry
    assert len(c._mats) == 1 and next(iter(c._mats.values())).shape[0] == len(c)
    new = head + [9] * 80                            # a store after lookups: the matrix follows
    c.store("m", new, kv(1, layers=1), torch.zeros(1))
    h = c.lookup("m", new)
    assert h.exact and h.entry.ids.tolist() == new and not scalar


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
    from rakv.drafts.ngram import ngram_match
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
    from rakv.drafts.ngram import NgramDraft

    target, _ = make_pair("llama", "mostly")
    p = list(range(5, 45))
    for policy, copies in (("joint:8", True), ("spec:8", False)):
        eng = Engine(target, NgramDraft(), RakvConfig(policy=policy))
        first = eng.generate(p, 24)
        again = eng.generate(p, 24)
        assert_exact(first, target, p, 24)
        assert_exact(again, target, p, 24)
        if copies:       # 23 tokens after the first, 9 a round: 3 rounds, every draft accepted
            assert again.rounds == 3 and again.accepted == again.drafted == 20
        else:            # r = 0: neither the KV nor the history of earlier requests
            assert (again.rounds, again.drafted) == (first.rounds, first.drafted) and len(eng.store.history) == 0


def test_the_controller_knows_an_exact_repeat_will_copy_its_earlier_output():
    from rakv.drafts.ngram import NgramDraft
    from rakv.records import Decision
    from tests.unit.test_gate import profile

    target, _ = make_pair("llama", "mostly")
    decisions = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:nogate"),
                 lambda r: decisions.append(r) if isinstance(r, Decision) else None, profile(d=0.0, alpha0=0.1))
    p = list(range(5, 45))
    first = eng.generate(p, 24)
    again = eng.generate(p, 24)
    shorter = eng.generate(p[:30] + [7, 8], 24)        # no exact repeat: no copy
    assert_exact(first, target, p, 24)
    assert_exact(again, target, p, 24)
    assert [d.copy for d in decisions] == [False, True, False]
    assert decisions[1].alpha == 0.99 and decisions[1].action["k"] == max(eng.k_set)
    assert shorter.output_ids == Engine(target, None, RakvConfig(policy="ar")).generate(p[:30] + [7, 8], 24).output_ids


def test_the_indexed_history_match_is_the_numpy_one():
    """The n-gram index (kept up to date as requests are added, oldest dropped, restored, cleared)
    finds what the numpy search over the whole array finds, on random small-vocabulary histories
    (few and many occurrences: both the plain-Python and the numpy comparison of contexts)."""
    import random

    from rakv.drafts.ngram import history_match, history_match_indexed
    from rakv.prefix_cache import TokenHistory

    rng = random.Random(5)
    for trial in range(60):
        vocab = rng.choice((3, 6, 40))
        h = TokenHistory(max_tokens=rng.choice((50, 400, 5000)))
        snaps = []
        for _ in range(rng.randrange(1, 25)):
            h.add([rng.randrange(vocab) for _ in range(rng.randrange(1, 120))])
            if rng.random() < 0.2:
                snaps.append(h.tokens)
            if snaps and rng.random() < 0.1:
                h.tokens = snaps.pop()                 # what PrefixCache.restore does
            if rng.random() < 0.03:
                h.clear()
            for _ in range(4):
                ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
                k = rng.randrange(1, 20)
                sizes = rng.choice(((3, 2), (2,), (4, 3, 2)))
                assert history_match_indexed(ids, k, sizes, h) == history_match(ids, k, sizes, h.tokens), trial


@pytest.mark.parametrize("granularity", ["request", "round"])
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_an_exact_repeat_is_predicted_as_the_copy_rounds_the_engine_then_runs(draft, granularity):
    """The gate copies an exact repeat's earlier output (with a model draft too): the chosen action
    is priced as that copy (predicted target passes, not model rounds) and the engine then takes
    about those passes, deciding per request or per round (a round's k does not trade the known
    copy for model drafts); exact either way."""
    from rakv.drafts.ngram import NgramDraft
    from rakv.records import Decision
    from tests.unit.test_gate import profile

    target, d = make_pair("llama", "mostly")
    decisions = []
    src = ModelDraft(d) if draft == "model" else NgramDraft()
    eng = Engine(target, src, RakvConfig(policy="adaptive", granularity=granularity),
                 lambda r: decisions.append(r) if isinstance(r, Decision) and r.round < 0 else None, profile())
    p = list(range(5, 45))
    first = eng.generate(p, 40)
    ledger = (eng.planner.copies.n, eng.planner.copies.rounds)
    again = eng.generate(p, 40)
    assert_exact(first, target, p, 40)
    assert_exact(again, target, p, 40)
    assert (eng.planner.copies.n, eng.planner.copies.rounds) == ledger     # a copy teaches the ledger nothing
    dec = decisions[1]
    assert dec.copy and dec.action["reuse"] == 1 and again.exact_repeat
    assert dec.predicted_passes <= 4 < first.rounds                 # 39 tokens after the first, 17 a copy round
    assert abs(again.rounds - dec.predicted_passes) <= 1             # a loose bound: the passes the engine took
    assert again.predicted_ms == dec.candidates[[(c["reuse"], c["k"]) for c in dec.candidates].index(
        (1, dec.action["k"]))]["predicted_ms"]
