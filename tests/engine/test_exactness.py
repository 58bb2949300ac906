"""The core property: every policy's output ids equal target-only greedy decoding."""

from __future__ import annotations

import pytest

from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.drafts.int8 import int8_copy
from rakv.records import Round
from tests.tiny import EOS_N, EOS_PROMPTS, assert_exact, make_pair, oracle, reference, synthetic_profile

ARCHS = ["gpt2", "llama"]
AGREEMENTS = ["identical", "mostly", "disagree"]
N = 24


@pytest.fixture(scope="module", params=[(a, g) for a in ARCHS for g in AGREEMENTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    return make_pair(*request.param)


def prompts():
    base = list(range(5, 45))
    return [base, base[:30] + [7, 8, 9, 10], base[:12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]]


@pytest.mark.parametrize("policy", ["ar", "kv"] + [f"spec:{k}" for k in range(1, 9)] + ["joint:1", "joint:4", "joint:8"])
def test_policy_matches_oracle(pair, policy):
    target, draft = pair
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy))
    for p in prompts() + prompts():          # the second pass hits the prefix cache (exact repeats)
        assert_exact(eng.generate(p, N), target, p, N, policy)


@pytest.mark.parametrize("policy", ["spec:3", "joint:4", "spec:8"])
def test_ngram_draft_matches_oracle(pair, policy):
    target, _ = pair
    eng = Engine(target, NgramDraft(), RakvConfig(policy=policy))
    for p in prompts():
        assert_exact(eng.generate(p, N), target, p, N, policy)


@pytest.mark.fast
def test_partial_and_exact_hits_stay_exact():
    target, draft = make_pair("llama", "mostly")
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:4"))
    a = list(range(20, 60))
    b = a[:25] + [90, 91, 92]          # partial hit q = 25
    c = a[:40]                          # exact repeat
    d = a[:33]                          # strict prefix of a stored prompt (q = P)
    for p, hit, exact in ((a, 0, False), (b, 25, False), (c, 40, True), (d, 33, False)):
        end = eng.generate(p, N)
        assert_exact(end, target, p, N)
        assert (end.hit_tokens, end.exact_repeat) == (hit, exact)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_eos_mid_round_ends_output(arch, k):
    target, draft = make_pair(arch, "identical")
    p = list(range(30, 50))
    free = oracle(target, p, 30, eos=())
    j = next(i for i in range(5, 30) if free[i] not in free[:i])
    eos = free[j]
    target.eos_ids = frozenset({eos})
    ref = oracle(target, p, 30)
    assert ref[-1] == eos and len(ref) == j + 1
    for src in (ModelDraft(draft), NgramDraft()):
        end = Engine(target, src, RakvConfig(policy=f"spec:{k}")).generate(p, 30)
        assert end.output_ids == ref and end.stopped == "eos"


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_max_new_tokens_never_exceeded(n):
    target, draft = make_pair("gpt2", "identical")
    p = list(range(40, 60))
    end = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:8")).generate(p, n)
    assert_exact(end, target, p, n)
    assert len(end.output_ids) == n and end.stopped == "max_new_tokens"


def test_draft_catches_up_after_ar_rounds():
    """Per-round adaptive switching between k=0 and k>0 exercises the lazy catch-up."""
    from rakv.decide.profile import CostProfile

    target, draft = make_pair("llama", "identical")
    prof = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                       d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive", granularity="round"), profile=prof)
    seen = []
    eng.callback = lambda r: seen.append(r)
    p = list(range(10, 40))
    # force k=0 for the first request via the K set, then allow drafting again
    eng.set_k_set([0])
    assert_exact(eng.generate(p, 10), target, p, 10)
    eng.set_k_set([0, 4])
    q = p + [5, 6]
    end = eng.generate(q, 20)
    assert_exact(end, target, q, 20)
    assert end.drafted > 0


def test_per_request_k0_probes_are_recorded_and_exact():
    """A per-request k=0 choice still probes (the draft catches up on the whole context) and each
    probe is recorded as a Decision for its round; the output stays the target's greedy one."""
    from rakv.decide.profile import CostProfile
    from rakv.records import Decision, Round

    target, draft = make_pair("llama", "identical")
    # a cheap draft that could pay, but the prior is low, so k = 0 is chosen per request; a
    # generous exploration share lets the priced probes through
    prof = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                       d=[[16, 0.05], [256, 0.05]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.05)
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive", probe_every=3, explore_share=1.0),
                 profile=prof)
    # the balance is a share of *measured* time, the prices are this synthetic profile's: earn a
    # stream's worth up front and keep the profile from learning this machine's real (tiny-model)
    # costs, so the probe rule is tested on the synthetic profile whatever this machine's speed
    eng.controller.earn(1000.0)
    prof.observe = lambda *a, **kw: None
    seen = []
    eng.callback = seen.append
    p = list(range(10, 40))
    end = eng.generate(p, 20)
    assert_exact(end, target, p, 20)
    assert end.action["k"] == 0
    probes = [r for r in seen if isinstance(r, Decision) and r.reason == "probe"]
    assert probes and all(r.round >= 1 and r.action["k"] > 0 for r in probes)
    spec = {r.index for r in seen if isinstance(r, Round) and r.kind == "spec"}
    assert {r.round for r in probes} <= spec and end.drafted > 0
    # every probe is priced before and measured after; the request sums what they cost
    assert all(r.explore_cost_ms >= 0 and r.explore_balance_ms >= r.explore_cost_ms for r in probes)
    spent = [r.explore_ms for r in seen if isinstance(r, Round) and r.index in {p.round for p in probes}]
    assert end.explore_ms == pytest.approx(sum(spent), abs=1e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_self_draft_is_exact_and_quantized(arch):
    from rakv.drafts.int8 import int8_copy

    target, _ = make_pair(arch, "identical")
    q = int8_copy(target)
    kinds = {type(m).__name__ for m in q.model.modules()}
    assert any("Linear" in k and ("quantized" in type(m).__module__) for m in q.model.modules()
               for k in [type(m).__name__]), kinds
    eng = Engine(target, ModelDraft(q), RakvConfig(policy="joint:4"))
    p = list(range(30, 60))
    for _ in range(2):
        end = eng.generate(p, N)
        assert_exact(end, target, p, N)
    assert end.accepted > 0


@pytest.mark.fast
def test_stop_before_and_during_a_request():
    target, draft = make_pair("llama", "identical")
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:2"))
    p = list(range(30, 60))
    eng.stop()                                   # pressed just before the request starts
    end = eng.generate(p, 20)
    assert end.stopped == "stop" and len(end.output_ids) == 1
    assert end.output_ids == oracle(target, p, 1)
    seen = []

    def cb(r):
        seen.append(r)
        if getattr(r, "type", "") == "round" and r.index == 2:
            eng.stop()
    eng.callback = cb
    end = eng.generate(p, 20)
    assert end.stopped == "stop" and 1 < len(end.output_ids) < 20
    assert end.output_ids == oracle(target, p, 20)[: len(end.output_ids)]     # stopped: a prefix
    eng.callback = seen.append
    assert eng.generate(p, 20).stopped == "max_new_tokens"   # the flag does not leak into the next one


def test_error_after_start_still_ends_the_request():
    target, draft = make_pair("llama", "identical")
    seen = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:2"), callback=seen.append)

    def boom(*a, **k):
        raise RuntimeError("draft exploded")
    eng.draft.propose = boom
    with pytest.raises(RuntimeError):
        eng.generate(list(range(30, 60)), 10)
    assert seen[-1].type == "request_end" and seen[-1].stopped == "error"


def test_budget_change_applies_between_requests():
    target, draft = make_pair("llama", "identical")
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="kv"))
    eng.generate(list(range(30, 60)), 4)
    assert len(eng.store) == 1
    eng.set_budget_mib(0)
    assert len(eng.store) == 0 and eng.store.budget == 0
    end = eng.generate(list(range(30, 60)), 4)
    assert end.hit_tokens == 0 and len(eng.store) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_draft_shares_weights_and_is_exact(arch):
    """--draft layers:L: the target's first L layers + final norm + LM head, weights shared."""
    from rakv.drafts.registry import make_draft
    from rakv.engine import EngineError
    from rakv.load.loaded import ModelError
    from tests.tiny import make_model, tiny_tokenizer, wrap_tiny

    target = wrap_tiny(make_model(arch, layers=4), tiny_tokenizer(), name=f"tiny-{arch}-4")
    src = make_draft("layers:2", target, RakvConfig())
    lm = src.lm
    tp = {id(p) for p in target.model.parameters()}
    assert {id(p) for p in lm.model.parameters()} <= tp                  # no copy
    assert sum(p.numel() for p in lm.model.parameters()) < sum(p.numel() for p in target.model.parameters())
    assert lm.key != target.key and lm.key.endswith(":layers2")
    n_target = getattr(target.model.config, "num_hidden_layers", None) or target.model.config.n_layer
    assert n_target == 4                                                  # the target is untouched
    for policy in ("spec:1", "spec:4", "joint:8"):
        eng = Engine(target, src, RakvConfig(policy=policy))
        for p in prompts() + prompts():
            assert_exact(eng.generate(p, N), target, p, N, policy)
    for bad in ("layers:0", "layers:4", "layers:x"):
        with pytest.raises((EngineError, ModelError)):
            make_draft(bad, target, RakvConfig())


def test_zero_copy_store_never_sees_its_entries_written():
    """Entries are stored and handed out without copies; runs over them must leave them intact."""
    import torch

    target, draft = make_pair("llama", "mostly")
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:4"))
    a = list(range(20, 60))
    eng.generate(a, N)
    snap = {id(e): [(k.clone(), v.clone()) for k, v in e.kv] for e in eng.store.entries()}
    for p in (a[:25] + [90, 91], a, a[:33], a + [5, 6, 7]):       # partial, exact, prefix, extension
        assert_exact(eng.generate(p, N), target, p, N)
    for e in eng.store.entries():
        if id(e) in snap:
            for (k, v), (k0, v0) in zip(e.kv, snap[id(e)]):
                assert torch.equal(k, k0) and torch.equal(v, v0)
    used = sum(sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in e.kv)
               for e in eng.store.entries())
    assert used <= eng.store.bytes_used      # byte accounting counts every stored byte


def test_no_pay_regime_runs_never_probe_and_repeat_their_decisions():
    """Every k costs more than plain steps even at alpha = 1: k = 0 on every request, no probe,
    and what one run saves into the profile does not change the next run's decisions."""
    from rakv.decide.profile import CostProfile
    from rakv.records import Decision

    target, draft = make_pair("llama", "identical")
    # (in ms far above the tiny models' real ones: online refinement only lowers t, so k stays
    # dearer than plain steps)
    prof = CostProfile(T_pf=[[8, 100.0], [64, 400.0]], D_pf=[[8, 50.0], [64, 100.0]], t=[[16, 100.0], [256, 100.0]],
                       d=[[16, 80.0], [256, 80.0]], V={str(k): 100.0 * (1 + 0.9 * k) for k in range(1, 9)},
                       alpha0=0.9)
    stream = [list(range(10, 40)), list(range(10, 30)) + [7, 8], list(range(50, 70)), list(range(10, 40))]
    runs = []
    for _ in range(3):
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive", explore_share=1.0), profile=prof)
        seen = []
        eng.callback = seen.append
        for p in stream:
            end = eng.generate(p, N)
            assert_exact(end, target, p, N)
            assert end.explore_ms == 0.0
        runs.append([(r.action["reuse"], r.action["k"], r.reason) for r in seen if isinstance(r, Decision)])
    assert runs[0] == runs[1] == runs[2]
    assert all(k == 0 and why == "argmin" for _, k, why in runs[0])


# ----------------------------------------------------------------------------- EOS on every path
def eos_stream(target) -> list[list[int]]:
    """Prompts that take every EOS path: A stops on EOS mid-output; B runs to the end; a partial hit
    of A; A again (an exact repeat, and with reuse an n-gram copy of its output up to EOS); C = A and
    its output before EOS, whose first token is EOS (computed, then from the stored logits of an
    exact repeat); D holds A's whole output, EOS inside, and more (so a later copy of A's output runs
    past EOS); A after D; A and its output but the last two tokens (a copy of two, EOS the last)."""
    A, B = EOS_PROMPTS[0], EOS_PROMPTS[1]
    ref, stopped = reference(target, A, EOS_N)
    assert stopped == "eos" and 5 <= len(ref) - 1 <= 15           # the fixture's EOS is mid-output
    j = len(ref) - 1
    C = A + ref[:j]
    D = A + ref + EOS_PROMPTS[2][:6]
    return [A, B, A[:18] + [7, 8], A, C, C, D, A, A + ref[:j - 2]]


EOS_ARCHS = ["gpt2", "llama"]
DRAFTED = ["spec:1", "spec:3", "spec:8", "joint:2", "joint:4", "joint:8", "adaptive", "adaptive:gate"]
DRAFTS = ["model", "int8", "ngram"]


@pytest.fixture(scope="module")
def eos_pairs():
    """(target, draft, int8 draft) per (arch, forward), built once: the EOS id is one each target emits."""
    built = {}

    def get(arch, forward="lean", seed=0):
        key = (arch, forward, seed)
        if key not in built:
            t, d = make_pair(arch, "mostly", eos="emitted", seed=seed, forward=forward)
            built[key] = (t, d, int8_copy(t))
        return built[key]
    return get


def draft_source(kind: str, pair):
    target, draft, q = pair
    return {"none": None, "model": lambda: ModelDraft(draft), "int8": lambda: ModelDraft(q),
            "ngram": NgramDraft}[kind]() if kind != "none" else None


def engine_for(policy: str, target, src, recs=None) -> Engine:
    """adaptive: drafting pays (a cheap model draft); adaptive:gate: the model draft does not (k = 0,
    n-gram lookups in its rounds)."""
    prof = None
    if policy == "adaptive":
        prof = synthetic_profile(d=0.3, alpha0=0.7)
    elif policy == "adaptive:gate":
        prof = synthetic_profile(d=5.0, alpha0=0.2)
    return Engine(target, src, RakvConfig(policy=policy), callback=(recs.append if recs is not None else None),
                  profile=prof)


def run_eos_stream(pair, policy: str, draft: str):
    target = pair[0]
    recs: list = []
    eng = engine_for(policy, target, draft_source(draft, pair), recs)
    stream = eos_stream(target)
    eos = next(iter(target.eos_ids))
    ends = []
    for i, p in enumerate(stream):
        end = eng.generate(p, EOS_N)
        assert_exact(end, target, p, EOS_N, (policy, draft, i))
        ends.append(end)
    assert ends[0].stopped == "eos" and ends[1].stopped == "max_new_tokens"
    assert ends[4].output_ids == ends[5].output_ids == [eos] and ends[5].stopped == "eos"
    reuse = eng.policy.reuse or (eng.controller is not None and ends[5].action["reuse"])
    if eng.policy.reuse:                             # the fixed reuse policies: the designed hits
        assert ends[2].hit_tokens == 18 and not ends[2].exact_repeat
        assert ends[3].exact_repeat and ends[5].exact_repeat
    if reuse and ends[5].exact_repeat:               # EOS as the first token, from the stored logits
        first = [r for r in recs if isinstance(r, Round) and r.request_id == ends[5].request_id]
        assert [(r.kind, r.emitted, r.provenance) for r in first] == [("prefill", [eos], ["stored"])]
    return recs, ends, eos


@pytest.mark.parametrize("arch", EOS_ARCHS)
@pytest.mark.parametrize("policy, draft", [("ar", "none"), ("kv", "none")]
                         + [(p, d) for p in DRAFTED for d in DRAFTS])
def test_eos_stream_every_policy_and_draft(eos_pairs, arch, policy, draft):
    recs, ends, eos = run_eos_stream(eos_pairs(arch), policy, draft)
    if (policy, draft) == ("joint:8", "ngram"):
        # a copy of an earlier output ended on EOS: EOS accepted as a draft token ends the output
        copied = [r for r in recs if isinstance(r, Round) and r.emitted and r.emitted[-1] == eos
                  and r.provenance[-1] == "draft"]
        assert {r.request_id for r in copied} >= {ends[7].request_id, ends[8].request_id}


# HF's own forward (packed linears without the lean forward; no fast path at all) and the other
# families the lean forward runs (Mistral, Qwen2): the EOS stream under the main policies
FAMILY_FORWARDS = [("gpt2", "hf"), ("gpt2", "plain"), ("llama", "hf"), ("llama", "plain"),
                   ("mistral", "lean"), ("mistral", "plain"), ("qwen2", "lean"), ("qwen2", "plain")]
FAMILY_SEEDS = {"gpt2": 0, "llama": 0, "mistral": 2, "qwen2": 3}


@pytest.mark.parametrize("arch, forward", FAMILY_FORWARDS, ids=[f"{a}-{f}" for a, f in FAMILY_FORWARDS])
@pytest.mark.parametrize("policy, draft", [("ar", "none"), ("kv", "none"), ("spec:3", "model"),
                                           ("joint:4", "model"), ("joint:4", "int8"), ("joint:8", "ngram"),
                                           ("adaptive", "model"), ("adaptive:gate", "model")])
def test_eos_stream_on_hf_forward_and_other_families(eos_pairs, arch, forward, policy, draft):
    pair = eos_pairs(arch, forward, FAMILY_SEEDS[arch])
    target = pair[0]
    assert target.fast == (forward != "plain")
    assert target.lean == ("" if forward != "lean" else "llama")      # Mistral and Qwen2: the Llama one
    run_eos_stream(pair, policy, draft)
