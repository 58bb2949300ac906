"""The confidence gate (rakv.decide.gate): its rules on their own, and the engine with it stays exact."""

from __future__ import annotations

import pytest

from rakv.config import Policy, RakvConfig
from rakv.decide.profile import CostProfile
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.decide.gate import BINS, AcceptMap, RoundGate, conf_bin
from rakv.decide.policy import best_verify_length, worth_more
from rakv.records import Round
from tests.tiny import assert_exact, make_pair, oracle, synthetic_profile

N = 24


def profile(V=None, d=0.3, alpha0=0.7) -> CostProfile:
    """A synthetic profile (``tests.tiny.synthetic_profile``): the rules are tested on the costs
    given here however fast this machine runs the model."""
    return synthetic_profile(V, d, alpha0)


def test_policy_names():
    assert Policy.parse("adaptive:gate").gate and Policy.parse("adaptive:gate").adaptive
    assert not Policy.parse("adaptive:nogate").gate and Policy.parse("adaptive:nogate").adaptive
    assert not Policy.parse("joint:4").gate


def test_accept_map_learns_per_bin_and_reports_reliability():
    m = AcceptMap(alpha=0.5)
    hi, lo = 0.95, 0.15
    for _ in range(200):
        m.observe([hi, hi, lo], [m.p(hi), m.p(hi), m.p(lo)], 2)     # two confident accepted, then a rejection
    assert m.p(hi) > 0.95 and m.p(lo) < 0.05
    rel = {r["bin"][0]: r for r in m.reliability()}
    assert rel[conf_bin(hi) / BINS]["observed"] == 1.0 and rel[conf_bin(lo) / BINS]["observed"] == 0.0
    assert m.counts()["n"][conf_bin(hi)] == 400
    # tokens after the first rejection are never judged
    m2 = AcceptMap()
    m2.observe([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], 0)
    assert sum(m2.obs_n) == 1
    # a calibration's counts become the prior
    m3 = AcceptMap(0.5, m.counts())
    assert m3.p(hi) > 0.8 and m3.p(lo) < 0.2


def test_stop_rules():
    # draft on while some longer draft (next tokens as likely as this one) beats the best rate now
    V = [1.0] + [1.05] * 8
    assert worth_more([0.9], 0.9, 0.3, V, 0.0, 8)
    assert not worth_more([0.1], 0.1, 0.3, V, 0.0, 8)
    assert not worth_more([0.9], 0.9, 0.3, V, 0.0, 1)           # nothing longer allowed
    # V not monotone: one step ahead costs a spike, two steps ahead is cheap again -- look past it
    V = [1.0, 1.1, 1.1, 1.6, 1.15]
    assert worth_more([0.9, 0.8], 0.8, 0.0, V, 0.0, 4)
    assert not worth_more([0.9, 0.8], 0.8, 0.0, V, 0.0, 3)
    # verify length: V not monotone -- verifying 3 can beat 2 when V(2) spikes
    V = [1.0, 1.1, 2.0, 1.15]
    assert best_verify_length([0.9, 0.8, 0.7], V, spent=0.3) == 3
    assert best_verify_length([0.9, 0.8], V, spent=0.3) == 1
    # hopeless drafts: a plain step instead of a verify that costs more
    assert best_verify_length([0.01], [1.0, 1.6], spent=0.3) == 0


def test_round_gate_stops_on_low_confidence_and_at_k_max():
    m = AcceptMap(alpha=0.5)
    g = RoundGate(m, 8, 0.3, [1.0] + [1.05] * 8)
    assert g.keep_going(0.97)
    assert not g.keep_going(0.05) and g.stop == "gate"
    g2 = RoundGate(m, 2, 0.0, [1.0, 1.0, 1.0])
    assert g2.keep_going(0.9) and not g2.keep_going(0.9) and g2.stop == "k_max"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("agreement", ["identical", "mostly", "disagree"])
def test_gated_adaptive_matches_oracle(arch, agreement):
    target, draft = make_pair(arch, agreement)
    base = list(range(5, 45))
    prompts = [base, base[:30] + [7, 8, 9, 10], base[:12], [3, 4, 5] * 6, base]   # partial and exact hits
    for src in (ModelDraft(draft), NgramDraft()):
        recs = []
        eng = Engine(target, src, RakvConfig(policy="adaptive:gate"), callback=recs.append, profile=profile())
        for p in prompts:
            assert_exact(eng.generate(p, N), target, p, N, (arch, agreement, src.name))
        spec = [r for r in recs if isinstance(r, Round) and r.kind == "spec"]
        assert spec, "the gate profile makes drafting pay: some rounds must draft"
        for r in spec:
            assert r.draft_stop in ("k_max", "gate", "cut", "source")
            assert len(r.draft_pred) == len(r.draft_conf) >= r.drafted
            assert all(0.0 <= c <= 1.0 for c in r.draft_conf + r.draft_pred)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gate_eos_mid_round(arch):
    target, draft = make_pair(arch, "identical")
    p = list(range(30, 50))
    free = oracle(target, p, 30, eos=())
    j = next(i for i in range(5, 30) if free[i] not in free[:i])
    target.eos_ids = frozenset({free[j]})
    ref = oracle(target, p, 30)
    assert len(ref) == j + 1 and ref[-1] == free[j]
    end = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive:gate"), profile=profile()).generate(p, 30)
    assert end.output_ids == ref and end.stopped == "eos"


def test_gate_cuts_a_disagreeing_draft_short():
    """A draft that is nearly always rejected: after a few rounds the calibrated map makes the gate
    stop early, so drafted tokens per drafting round fall well below k_max."""
    target, draft = make_pair("llama", "disagree")
    target.eos_ids = frozenset()          # the tokenizer's <eos> (id 0) is not the model's EOS here
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive:gate", k_set=(0, 8)),
                 callback=recs.append, profile=profile(alpha0=0.95))
    eng.set_force((1, 8))
    for s in range(6):
        p = list(range(10 + s, 40 + s))
        assert_exact(eng.generate(p, N), target, p, N)
    spec = [r for r in recs if isinstance(r, Round) and r.kind == "spec"]
    late = spec[len(spec) // 2:]
    assert sum(r.drafted for r in late) / len(late) < 4


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lookup_in_k0_rounds_gains_where_no_model_draft_pays(arch):
    """The model draft costs 5 steps a token (k = 0 on every request), a verify about one step: the
    gate verifies the n-gram continuation in k = 0 rounds (here a repeated request copies its earlier
    output from the history), so the same output takes fewer target forwards than without the gate;
    the controller's alpha is left alone, and the output stays the target's own greedy decoding."""
    target, draft = make_pair(arch, "mostly")
    target.eos_ids = frozenset()
    prompts = [[3, 4, 5, 6] * 6, list(range(5, 30)) * 2, [9, 8, 7] * 8]
    prompts += prompts[:2]                       # repeats: the history holds what to copy
    rounds = {}
    for policy in ("adaptive:gate", "adaptive:nogate"):
        recs = []
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy, k_set=(0, 2, 4)), callback=recs.append,
                     profile=profile(d=5.0, alpha0=0.2))
        alpha0 = eng.alpha.value
        ends = []
        for p in prompts:
            end = eng.generate(p, 40)
            assert_exact(end, target, p, 40, policy)
            assert end.action["k"] == 0 and end.drafted == 0
            ends.append(end)
        rounds[policy] = [e.rounds for e in ends]
        looked = [r for r in recs if isinstance(r, Round) and r.draft_source == "lookup"]
        if policy == "adaptive:nogate":
            assert not looked and rounds[policy] == [39] * len(prompts)      # one target step a token
            continue
        assert sum(r.accepted for r in looked) > 0 and sum(eng.lookup_map.obs_n) > 0
        assert all(r.kind == "spec" and r.k == 0 and r.draft_stop for r in looked if r.drafted)
        assert eng.alpha.value == alpha0            # lookups are not the model draft's acceptance
    gate, plain = rounds["adaptive:gate"], rounds["adaptive:nogate"]
    assert all(g <= n for g, n in zip(gate, plain))
    assert gate[3] < plain[3] // 2 and gate[4] < plain[4] // 2     # the repeats copy: far fewer forwards


@pytest.mark.fast
def test_lookup_is_not_verified_when_a_verify_costs_three_steps():
    target, draft = make_pair("llama", "mostly")
    target.eos_ids = frozenset()
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive:gate", k_set=(0, 2, 4)), callback=recs.append,
                 profile=profile(V={str(k): 3.0 for k in range(1, 9)}, d=5.0, alpha0=0.2))
    p = [3, 4, 5, 6] * 6
    for _ in range(2):                       # the repeat could copy its earlier output: still not worth it
        assert_exact(eng.generate(p, 30), target, p, 30)
    assert not any(r.drafted for r in recs if isinstance(r, Round))


def test_a_confident_lookup_replaces_the_model_draft_in_a_drafting_round():
    from rakv.decide.planner import use_lookup

    m = AcceptMap(alpha=0.5)
    model = RoundGate(m, 4, 0.5, [1.0, 1.05, 1.1, 1.15, 1.2])       # a model draft at half a step a token
    lk = RoundGate(AcceptMap(alpha=0.5), 4, 0.0, [1.0, 1.05, 1.1, 1.15, 1.2])
    for _ in range(3):
        lk.keep_going(0.95)
    assert use_lookup([1, 2, 3], lk, model, alpha=0.6)     # free and confident beats paying for drafts
    assert not use_lookup([], lk, model, alpha=0.6)
    weak = RoundGate(AcceptMap(alpha=0.0), 4, 0.0, [1.0, 1.05, 1.1, 1.15, 1.2])
    weak.keep_going(0.05)
    assert not use_lookup([1], weak, model, alpha=0.95)   # a confident model draft beats a doubtful copy


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_ngram_lookup_may_verify_past_the_largest_k(arch):
    """An n-gram draft drafts for free: a gated round may verify up to lookup_k tokens (past max K)
    where the measured V says a long verify pays, and the output stays exact. A repeated request
    copies its earlier output from the history: every round that has 13 tokens left verifies 12."""
    target, _ = make_pair(arch, "mostly")
    target.eos_ids = frozenset()
    V = {str(k): 1.0 + 0.01 * k for k in range(1, 17)}
    p = list(range(5, 40))
    recs = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:gate", k_set=(0, 2, 4), lookup_k=12),
                 callback=recs.append, profile=profile(V=V, d=0.0, alpha0=0.95))
    eng.lookup_map = eng.accept_map = AcceptMap(alpha=1.0)     # every copy trusted: rounds run to the cap
    for _ in range(2):
        end = eng.generate(p, 40)
        assert_exact(end, target, p, 40)
    rounds = [r for r in recs if isinstance(r, Round) and r.request_id == end.request_id and r.kind != "prefill"]
    assert all(r.drafted <= 12 for r in recs if isinstance(r, Round))             # never past lookup_k
    assert [r.drafted for r in rounds] == [12, 12, 12]          # 39 after the first token: 3 rounds of 12 + 1
    assert all(r.accepted == r.drafted for r in rounds) and end.accepted == 36


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_lookup_verifies_no_longer_than_lookup_steps_of_cost(arch):
    """``lookup_top``: lookup_k where every verify up to it costs at most LOOKUP_STEPS steps; where
    long verifies cost more (V(j)/t 1 + 0.5 j: V(6) = 4 t), the longest lookup is cut to the last
    length within them, never below max(K); and a gated n-gram round then drafts no further."""
    from rakv.decide.planner import LOOKUP_STEPS, lookup_top

    cheap = profile(V={str(k): 1.0 + 0.01 * k for k in range(1, 17)})
    dear = profile(V={str(k): 1.0 + 0.5 * k for k in range(1, 17)})
    assert LOOKUP_STEPS == 4.0
    assert lookup_top(cheap, 16, 8) == 16 and lookup_top(None, 16, 8) == 16
    assert lookup_top(dear, 16, 4) == 6 and lookup_top(dear, 16, 8) == 8 and lookup_top(dear, 5, 2) == 5
    target, _ = make_pair(arch, "mostly")
    target.eos_ids = frozenset()
    p = list(range(5, 40))
    recs = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:gate", k_set=(0, 2, 4), lookup_k=16),
                 callback=recs.append, profile=dear)
    eng.lookup_map = eng.accept_map = AcceptMap(alpha=1.0)
    for _ in range(2):
        assert_exact(eng.generate(p, 40), target, p, 40)
    assert max(r.drafted for r in recs if isinstance(r, Round)) == 6


def test_copy_rounds_stop_where_copies_do_not_pay():
    """``copies_pay``: look up while a copy round is expected to gain, else only every COPY_RETRY-th
    round; ``CopyLedger``: a verified round's saved steps less its verify's extra cost and its
    planning, how often rounds verify, what a dry round's planning costs."""
    from rakv.decide.planner import COPY_RETRY, CopyLedger, copies_pay

    assert copies_pay(0.0, 0) and copies_pay(3.0, 0)
    assert not copies_pay(-0.01, 0) and not copies_pay(-0.01, COPY_RETRY - 2) and copies_pay(-0.01, COPY_RETRY - 1)
    led = CopyLedger()
    assert led.expected() == 0.0 and copies_pay(led.expected(), 0)      # untried: look up
    led.observe(2, 2, 4.0, 1.0, 0.1)                                     # the first verified round: its own gain
    assert led.gain == pytest.approx(8.0 - 1.0 - 0.1) and led.expected() > 0
    rejected = CopyLedger()
    for _ in range(40):                        # rejected copies: each verify costs 1 ms more than a step
        rejected.observe(1, 0, 4.0, 1.0, 0.05)
    assert rejected.expected() < 0 and not copies_pay(rejected.expected(), 0)
    for _ in range(3):                         # copies that pay again bring the lookups back
        rejected.observe(1, 3, 4.0, 1.0, 0.05)
    assert copies_pay(rejected.expected(), 0)


def test_a_dry_stretch_does_not_stop_lookups_where_copies_pay():
    """Copies that pay (accepted more than the verify's extra cost), then 60 copy rounds with no
    match (planning only) and one miss: the lookups go on; a stretch with nothing to verify at all
    (no verified gain to weigh the planning against) does not stop them before COPY_EVIDENCE
    verified rounds (the start of a stream: a skipped round may be the first copy worth a step),
    and stops them after."""
    from rakv.decide.planner import COPY_EVIDENCE, CopyLedger, copies_pay

    led = CopyLedger()
    for _ in range(10):
        led.observe(2, 1, 4.0, 1.2, 0.08)                                # +2.7 ms a verified round
    for _ in range(60):
        led.observe(0, 0, 4.0, 0.0, 0.05)
    led.observe(2, 0, 4.0, 1.2, 0.08)
    assert copies_pay(led.expected(), 0)
    dry = CopyLedger()
    for _ in range(5):
        dry.observe(0, 0, 4.0, 0.0, 0.05)
    assert dry.expected() < 0 and copies_pay(dry.expected(), 0, dry.n)          # untried: look up
    assert not copies_pay(dry.expected(), 0, COPY_EVIDENCE)


def test_a_copy_is_priced_at_the_batch_rate_beside_other_requests():
    """``copy_prices``: beside 7 plain requests a copy's accepted token saves the batch's ms per
    token (W(8) / 8), not a lone step, and its rows cost W(8 + m) - W(8): copies that pay alone
    (1 of 3 held, a dear step) stop paying in a full batch, and the ledger's measurements (how
    often, how many, how many held, the planning) are what it reprices."""
    from rakv.decide.planner import COPY_EVIDENCE, COPY_RETRY, CopyLedger, copies_pay, copy_prices

    t = 50.0
    W = lambda n: t * (1.0 + 0.07 * (n - 1))            # noqa: E731 - V(7)/t about 1.5 (bandwidth-bound)
    led = CopyLedger()
    for i in range(100):
        if i % 10 == 0:
            led.observe(3, 1, t, W(4) - t, 0.4)         # a verified round: 3 copies, 1 held
        else:
            led.observe(0, 0, t, 0.0, 0.3)              # a lookup that found nothing
    assert led.n >= COPY_EVIDENCE and led.expected_at(t, lambda m: W(1 + m) - t) == pytest.approx(led.expected())
    assert copies_pay(led.expected(), 0, led.n)                           # alone: they pay
    token_ms, extra = copy_prices(W, 7, 7.0)
    assert token_ms == pytest.approx(W(8) / 8) and extra(3) == pytest.approx(W(11) - W(8))
    assert not copies_pay(led.expected_at(token_ms, extra), 0, led.n)     # beside 7 plain requests: not
    token_ms, extra = copy_prices(W, 1, 1.0)
    assert copies_pay(led.expected_at(token_ms, extra), 0, led.n)         # beside one: still
    # where they do not pay, 8 requests sharing the steps try each 8 times more rarely (one ledger)
    assert not copies_pay(-1.0, COPY_RETRY - 1, led.n, 8) and copies_pay(-1.0, 8 * COPY_RETRY - 1, led.n, 8)


def test_ngram_copy_runs_past_the_present_as_a_period():
    from rakv.drafts.ngram import ngram_match

    toks, m = ngram_match([7, 1, 2, 3, 1, 2, 3, 1, 2], 7)      # last seen "1 2" 3 tokens back: period 3
    assert toks == [3, 1, 2, 3, 1, 2, 3] and m >= 2
    assert ngram_match([5, 6, 7, 8, 9, 5, 6], 2)[0] == [7, 8]   # a long source: a plain copy


def test_ngram_confidence_grows_along_the_copy():
    """Token n of a copy is judged after n - 1 accepted copies: its match is longer, so its
    confidence is higher than the first token's."""
    gate = RoundGate(AcceptMap(alpha=1.0), 6, 0.0, [1.0] * 7)
    NgramDraft().propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], 6, gate)
    assert len(gate.confs) == 6 and gate.confs == sorted(gate.confs) and gate.confs[-1] > gate.confs[0]


def test_calibration_measures_verify_lengths_for_lookups():
    """A gated lookup may verify up to LOOKUP_K tokens, past max(K): calibration measures V there
    (and one length between), so the gate never reads a V extrapolated past the measured ones."""
    from rakv.config import LOOKUP_K
    from rakv.decide.calibration import calibrate

    target, _ = make_pair("llama", "mostly")
    prof = calibrate(target, NgramDraft(), k_max=2, quick=True)
    from rakv.decide.policy import batch_vs

    measured = sorted(int(k) for k in prof.V if int(k) not in batch_vs(2))   # (and a batch's passes: W(32), W(64))
    assert measured[:2] == [1, 2] and measured[-1] == LOOKUP_K and len(measured) == 4
    assert 2 < measured[2] < LOOKUP_K and all(v > 0 for v in prof.V.values())
    assert {str(k) for k in batch_vs(2)} <= set(prof.V)


def test_a_requests_failed_lookups_lower_its_trust():
    """A request whose copies keep failing verifies fewer of them: its own outcomes scale the pooled
    map (a list copies the layout of the last item, not its words); no evidence leaves it alone."""
    from rakv.decide.gate import Trusted, request_trust

    assert request_trust(0, 0) == 1.0
    assert request_trust(0, 6.0) == pytest.approx(0.25)            # 6 predicted, none accepted
    assert request_trust(5, 5.0) == 1.0 and request_trust(4, 2.0) > 1.0
    m = AcceptMap(alpha=0.8)
    assert Trusted(m, 0.25).p(0.9) == pytest.approx(m.p(0.9) * 0.25) and Trusted(m, 9.0).p(0.9) == 1.0


def test_an_ngram_drafts_failed_copies_lower_its_trust_in_later_rounds():
    """With the n-gram draft itself under the gate, its judged copies scale the pooled map for the
    rest of the request as the side lookup's do (in replay of recorded streams: +4-11% on repetitive)."""
    from rakv.decide.gate import Trusted

    target, draft = make_pair("llama", "mostly")
    p = list(range(5, 25)) * 2
    for source, scaled in ((NgramDraft(), True), (ModelDraft(draft), False)):
        eng = Engine(target, source, RakvConfig(policy="adaptive:gate"), profile=profile(d=0.0, alpha0=0.95))
        rq = eng._start(p, 24, None)
        eng._decide(rq)
        rq.lk_hits, rq.lk_pred = 0.0, 6.0                  # six copies predicted, none accepted
        g = eng.planner._gate(rq, p, 4)
        assert isinstance(g.amap, Trusted) == scaled
        if scaled:
            assert g.amap.p(0.9) == pytest.approx(eng.accept_map.p(0.9) * 0.25)


def test_a_lookup_verify_learns_its_own_cost_and_the_gate_reads_it():
    """A lookup's verify runs a path the plain steps around it do not: its measured / predicted
    ms is learned (a log-space average, each round clipped) and scales V(j >= 1) in the lookup
    gate, so a copy worth verifying at the profile's V(1) is not once verifies cost 1.6x that."""
    from rakv.decide.planner import LOOKUP_COST_CLIP, lookup_cost_scale

    s = 1.0
    for _ in range(40):
        s = lookup_cost_scale(s, 13.0, 10.0)
    assert s == pytest.approx(1.3, rel=1e-3)
    assert lookup_cost_scale(1.0, 1e6, 1.0) < LOOKUP_COST_CLIP ** 0.21       # one round: clipped
    assert lookup_cost_scale(1.2, 0.0, 1.0) == 1.2                            # nothing measured
    p = profile(V={str(k): 1.0 + 0.1 * k for k in range(1, 9)})
    amap = AcceptMap(0.5)
    conf = 0.45                                          # the map's chance for it: ~0.4 (E_1 = 1.4)
    for over, verified in ((1.0, 1), (1.6, 0)):
        g = RoundGate(amap, 1, 0.0, p.verifies(1, 64, over))
        g.keep_going(conf)
        assert g.verify_length(1) == verified, over
        assert g.V[1] == pytest.approx(p.verify(1, 64) * over)
