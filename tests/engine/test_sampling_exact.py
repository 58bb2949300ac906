"""Seed-exact speculation: under sampling every policy, draft, k and cache state gives the ids of
target-only sampling with the same seed (the token at output position i is a function of the
seed, i and the target's filtered distribution there), and temperature 0 stays today's greedy.

The reference is independent of the engine: an untouched deep copy of the target (no fast path,
no lean forward), a full forward over the whole sequence for every token, and ``sampling.sample``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rakv.decoding import sampling as S
from rakv.config import RakvConfig
from rakv.decide.profile import CostProfile
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.drafts.registry import make_draft
from rakv.engine import Engine
from rakv.load.numerics import wrap
from rakv.config import Sampling
from tests.tiny import make_model, perturbed, tiny_tokenizer

N = 20
SETTINGS = [Sampling(temperature=0.8, seed=7), Sampling(temperature=1.0, top_k=40, top_p=0.9, seed=123),
            Sampling(temperature=0.5, min_p=0.05, seed=2**40 + 5)]


def synthetic_profile(alpha0: float = 0.7) -> CostProfile:
    """Costs that make drafting pay (so adaptive drafts) and do not learn this machine's."""
    p = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                    d=[[16, 0.05], [256, 0.05]], V={str(k): 1.0 + 0.02 * k for k in range(1, 9)},
                    alpha0=alpha0)
    p.observe = lambda *a, **kw: None
    return p


def build(arch: str, eos: int | None = None):
    """(target LoadedModel, draft LoadedModel, pristine reference copy of the target)."""
    t = make_model(arch, seed=1, eos=eos)
    ref = copy.deepcopy(t)
    d = perturbed(copy.deepcopy(t), 0.02)
    tok = tiny_tokenizer()
    return wrap(t, tok, name=f"tiny-{arch}"), wrap(d, tok, name=f"tiny-{arch}-d"), ref


@torch.inference_mode()
def reference(model, prompt: list[int], n: int, s: Sampling, eos: set[int]) -> list[int]:
    """Target-only sampling: a full forward per token, the token at position i from (seed, i)."""
    ids, out = list(prompt), []
    for i in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        tok = S.sample(logits, s, i)
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


def prompts():
    base = list(range(5, 45))
    return [base, base[:30] + [7, 8, 9, 10], base[:12], base]    # a miss, a partial hit, short, an exact repeat


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exact_models(request):
    return build(request.param)


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.key())
@pytest.mark.parametrize("policy", ["ar", "kv", "spec:1", "spec:3", "joint:4", "joint:8", "adaptive:nogate",
                                    "adaptive:gate"])
def test_every_policy_gives_target_only_samples(exact_models, policy, s):
    target, draft, ref = exact_models
    prof = synthetic_profile() if policy.startswith("adaptive") else None
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy, sampling=s), profile=prof)
    for i, p in enumerate(prompts()):
        end = eng.generate(p, N)
        want = reference(ref, p, N, s.for_request(i), set(target.eos_ids))
        assert end.output_ids == want, (policy, i)
        assert end.stopped in ("max_new_tokens", "eos")


@pytest.mark.parametrize("draft_spec", ["ngram", "int8", "layers:1"])
@pytest.mark.parametrize("policy", ["spec:4", "joint:2", "adaptive"])
def test_every_draft_gives_target_only_samples(exact_models, draft_spec, policy):
    target, _, ref = exact_models
    s = SETTINGS[0]
    config = RakvConfig(policy=policy, sampling=s)
    eng = Engine(target, make_draft(draft_spec, target, config), config,
                 profile=synthetic_profile() if policy == "adaptive" else None)
    for i, p in enumerate(prompts() + [[3, 4, 5] * 8]):
        assert eng.generate(p, N).output_ids == reference(ref, p, N, s.for_request(i), set(target.eos_ids))


def test_drafts_are_accepted_under_sampling():
    """Coupled drafting: a draft with the target's own weights samples the target's tokens (the
    same noise over the same distribution), so nearly every draft is accepted; a perturbed one
    less often. (Without coupling, independent samples at T = 0.8 would rarely agree.)"""
    target, near, _ = build("llama")
    same = wrap(copy.deepcopy(target.model), target.tokenizer, name="tiny-llama-same")
    rates = []
    for d in (same, near):
        eng = Engine(target, ModelDraft(d), RakvConfig(policy="spec:4", sampling=SETTINGS[0]))
        end = eng.generate(list(range(5, 45)), 40)
        rates.append(end.accepted / end.drafted)
    assert rates[0] > 0.9 and 0.2 < rates[1] <= rates[0]


def test_temperature_zero_is_greedy_bit_for_bit(exact_models):
    target, draft, _ = exact_models
    outs = []
    for s in (None, Sampling(), Sampling(temperature=0.0, top_k=5, seed=3)):
        cfg = RakvConfig(policy="joint:4") if s is None else RakvConfig(policy="joint:4", sampling=s)
        eng = Engine(target, ModelDraft(draft), cfg)
        outs.append([eng.generate(p, N).output_ids for p in prompts()])
    assert outs[0] == outs[1] == outs[2]


def test_request_i_samples_with_seed_plus_i(exact_models):
    target, draft, ref = exact_models
    s = SETTINGS[1]
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:2", sampling=s))
    p = list(range(5, 30))
    a, b = eng.generate(p, N).output_ids, eng.generate(p, N).output_ids
    assert a == reference(ref, p, N, s, set(target.eos_ids))
    assert b == reference(ref, p, N, Sampling(**{**s.to_dict(), "seed": s.seed + 1}), set(target.eos_ids))
    assert a != b          # two requests, two seeds (this prompt's samples differ at these seeds)


def test_eos_inside_a_round_under_sampling():
    """An EOS the target samples mid-round ends the output there, for every policy alike."""
    probe, _, ref0 = build("llama")
    s = SETTINGS[0]
    p = list(range(5, 45))
    free = reference(ref0, p, N, s, set())
    eos = free[6]                          # a token this prompt samples at position 6
    target, draft, ref = build("llama", eos=eos)
    want = reference(ref, p, N, s, {eos})
    assert want[-1] == eos and len(want) <= 7
    for policy in ("ar", "spec:4", "joint:8", "spec:2"):
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy, sampling=s))
        end = eng.generate(p, N)
        assert (end.output_ids, end.stopped) == (want, "eos"), policy


def test_a_drawn_seed_is_recorded_and_reproduces(exact_models):
    target, draft, _ = exact_models
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="spec:2", sampling=Sampling(temperature=0.9)),
                 callback=recs.append)
    eng.header()
    p = list(range(5, 30))
    first = eng.generate(p, N).output_ids
    seed = recs[0].settings["sampling"]["seed"]
    start = next(r for r in recs if r.type == "request_start")
    assert seed is not None and start.sampling["seed"] == seed and start.sampling["temperature"] == 0.9
    again = Engine(target, ModelDraft(draft), RakvConfig(policy="ar", sampling=Sampling(temperature=0.9, seed=seed)))
    assert again.generate(p, N).output_ids == first


def test_rejection_mode_runs_and_records_it(exact_models):
    """Standard speculative sampling: exact in distribution (tests/unit/test_sampling_stats.py), not in
    tokens; here: it runs every policy, ends cleanly and says which verification ran."""
    target, draft, _ = exact_models
    recs = []
    s = Sampling(temperature=0.8, seed=11, verify="rejection")
    for policy, src in (("spec:4", ModelDraft(draft)), ("joint:4", NgramDraft())):
        eng = Engine(target, src, RakvConfig(policy=policy, sampling=s), callback=recs.append)
        for p in prompts():
            end = eng.generate(p, N)
            assert len(end.output_ids) == N or end.stopped == "eos"
    assert {r.verify for r in recs if r.type == "round" and r.kind == "spec"} == {"rejection"}


def test_acceptance_is_learned_per_sampling_setting():
    """Each setting keeps its own acceptance; switching back finds the earlier estimate intact."""
    from rakv.decide.controller import Controller

    prof = synthetic_profile(alpha0=0.9)
    ctl = Controller(prof, (0, 2, 4))
    greedy = ctl.alpha_req
    ctl.use_setting("T1/k0/p1/m0/seeded", 0.2)
    assert ctl.alpha_req == pytest.approx(0.2) and ctl.alpha.value == pytest.approx(0.2)
    for _ in range(5):
        ctl.observe_round(4, 0)
    ctl.end_request(10, 10, "max_new_tokens")
    hot = ctl.alpha_req
    assert hot < 0.2 and prof.alpha_by_setting["T1/k0/p1/m0/seeded"]["alpha_learned"] < 0.2
    ctl.use_setting("greedy", 0.9)
    assert ctl.alpha_req == pytest.approx(greedy) and prof.alpha_learned is None
    ctl.use_setting("T1/k0/p1/m0/seeded", 0.2)
    assert ctl.alpha_req == pytest.approx(hot)


def test_the_prior_is_measured_at_the_setting_in_use(exact_models):
    """A sampled request's decision starts from acceptance measured at its own setting (once)."""
    target, draft, _ = exact_models
    prof = synthetic_profile(alpha0=0.99)
    recs = []
    s = Sampling(temperature=1.0, seed=1)
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive:nogate", sampling=s),
                 callback=recs.append, profile=prof)
    eng.generate(list(range(5, 30)), 8)
    a0 = prof.alpha_by_setting[s.key()]["alpha0"]
    decision = next(r for r in recs if r.type == "decision")
    assert decision.alpha == pytest.approx(a0, abs=1e-4) and a0 < 0.99
    assert eng.planner.setting == eng.controller.setting == s.key()


def test_a_new_settings_prior_is_measured_before_any_request(exact_models, monkeypatch):
    """The CLI and the bench measure a new setting's prior when the profile loads, so no request's
    latency pays for it; the engine then finds it and measures nothing."""
    import rakv.decide.calibration as C
    from rakv.session import prior_at_setting

    target, draft, _ = exact_models
    prof = synthetic_profile(alpha0=0.99)
    s = Sampling(temperature=1.0, seed=1)
    prior_at_setting(prof, target, ModelDraft(draft), s)
    a0 = prof.alpha_by_setting[s.key()]["alpha0"]
    measured = []
    monkeypatch.setattr(C, "measure_alpha", lambda *a, **kw: measured.append(1) or 0.5)
    prior_at_setting(prof, target, ModelDraft(draft), s)          # known: nothing measured
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="adaptive:nogate", sampling=s),
                 callback=recs.append, profile=prof)
    eng.generate(list(range(5, 30)), 8)
    assert not measured
    assert next(r for r in recs if r.type == "decision").alpha == pytest.approx(a0, abs=1e-4)


def test_the_model_draft_leaves_the_pending_token_unfed(exact_models):
    """A round whose emitted token equals the draft's first proposal but ends there (a resample that
    happens to equal it) leaves that token pending; the draft cache held it already and must give it
    back, so the next proposal has a token to feed (it used to feed none and fail)."""
    target, draft, _ = exact_models
    d = ModelDraft(draft)
    prompt = list(range(5, 30))
    d.begin(prompt, None, False)
    ids = prompt + [7]                        # the target's first token, pending
    toks = d.propose(ids, 3).tokens
    d.commit(ids + toks[:1])
    assert d.propose(ids + toks[:1], 2).tokens == toks[1:3]


def test_cli_samples_seed_exactly_and_refuses_bad_values(tmp_path, capsys):
    import json

    from rakv.cli import main
    from tests.tiny import save_tiny

    d = tmp_path / "m"
    save_tiny(d, arch="llama", seed=4)
    capsys.readouterr()
    for bad in (["--temperature", "-0.5"], ["--top-p", "0"], ["--min-p", "1.2"], ["--top-k", "-1"],
                ["--seed", "-3"], ["--verify", "maybe"]):
        assert main(["generate", "--target", str(d), "--draft", "ngram", "--prompt", "x", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0]
    outs = {}
    for policy, draft in (("ar", "none"), ("spec:4", "ngram"), ("joint:2", "int8")):
        assert main(["generate", "--target", str(d), "--draft", draft, "--policy", policy, "--raw", "--json",
                     "--temperature", "0.9", "--top-k", "50", "--seed", "42", "--max-new-tokens", "16",
                     "--prompt", "The quick brown fox", "--prompt", "The quick brown fox"]) == 0
        objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [o["sampling"]["seed"] for o in objs] == [42, 43]
        outs[policy] = [o["output_ids"] for o in objs]
    assert outs["ar"] == outs["spec:4"] == outs["joint:2"]
