"""V(k) corrected by round records (rakv.decide.profile.CostProfile.shape_correction): a profile whose
V(k)/t is off (timed on a busy machine) is mended by the rounds the engine measures, once they
disagree by more than the term's noise; the argmin then follows the measured costs."""

from __future__ import annotations

import random

import pytest

from rakv.decide.controller import Controller, Situation
from rakv.decide.profile import SHAPE_MIN_ROUNDS, CostProfile, load_profile, save_profile

T = 5.0
QUIET = {1: 1.0, 2: 1.0, 3: 1.03, 4: 1.0, 5: 1.06, 6: 1.1, 7: 1.26, 8: 1.32}      # the demo's quiet V(k)/t (q8)
BUSY = {1: 1.05, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.6, 6: 2.0, 7: 2.6, 8: 3.6}         # a busy calibration's


def steep_profile(spread: float = 0.05) -> CostProfile:
    """The n-gram pair's profile as a busy calibration left it: d ~ 0, V(8)/t 3.6."""
    return CostProfile(T_pf=[[8, 8.0], [128, 80.0]], D_pf=[], t=[[16, T], [128, T]], d=[[16, 0.02], [1024, 0.05]],
                       V={str(k): T * r for k, r in BUSY.items()}, V_ctx=128, alpha0=0.95,
                       quality={"spread": {f"V{k}": spread for k in BUSY}})


def feed(p: CostProfile, truth: dict, rounds: int, ks=(1, 2, 4, 6, 8), noise=0.05, seed=0) -> None:
    """Rounds as the engine reports them (observe with the current prediction), with plain steps between."""
    rng = random.Random(seed)
    for i in range(rounds):
        k = ks[i % len(ks)]
        p.observe("t", p.step(128), T * rng.uniform(1 - noise, 1 + noise))
        p.observe(f"R{k}", p.verify(k, 128), T * truth[k] * rng.uniform(1 - noise, 1 + noise))


@pytest.mark.fast
def test_round_records_correct_a_steep_v_of_k():
    p = steep_profile()
    assert p.verify(8, 128) / p.step(128) == pytest.approx(3.6)
    feed(p, QUIET, 200)
    for k in (1, 2, 4, 6, 8):
        assert p.verify(k, 128) / p.step(128) == pytest.approx(QUIET[k], rel=0.12), k
    fixes = p.corrections()
    assert set(fixes) >= {"V(6)", "V(8)"} and fixes["V(8)"] == pytest.approx(QUIET[8] / BUSY[8], rel=0.12)
    assert p.step(128) == pytest.approx(T, rel=0.1)          # the machine factor stays with t


def test_within_its_noise_a_term_is_left_alone():
    p = steep_profile()
    feed(p, {k: BUSY[k] * 1.05 for k in BUSY}, 200)          # 5%: inside SHAPE_NOISE
    assert p.corrections() == {}
    p = steep_profile(spread=0.4)                            # a noisy term needs more than twice its spread
    feed(p, {k: BUSY[k] * 0.7 for k in BUSY}, 200)
    assert p.corrections() == {}


def test_a_few_rounds_do_not_correct():
    p = steep_profile()
    feed(p, QUIET, SHAPE_MIN_ROUNDS - 1, ks=(8,))
    assert p.corrections() == {} and p.shape_correction(8) == 1.0


def test_the_argmin_follows_the_corrected_costs_on_a_copy():
    """High acceptance (a copy): the steep profile stops at a short k, the corrected one drafts 8."""
    sit = Situation(P=128, N=128, budget=1 << 30, entry_bytes=1 << 20, draft_entry_bytes=0)
    p = steep_profile()
    before = Controller(p, k_set=(0, 1, 2, 4, 6, 8), alpha_prior=0.95).decide(sit).k
    feed(p, QUIET, 200)
    after = Controller(p, k_set=(0, 1, 2, 4, 6, 8), alpha_prior=0.95).decide(sit).k
    assert before < 8 and after == 8


def test_corrections_survive_a_save(tmp_path):
    p = steep_profile()
    feed(p, QUIET, 200)
    save_profile(p, tmp_path / "p.json")
    q = load_profile(tmp_path / "p.json")
    assert q.corrections() == p.corrections()


def test_the_engine_reports_its_corrections_and_stays_exact():
    """Adaptive with the n-gram draft on copies, from a steep profile: every request's ids equal
    target-only greedy decoding, and each request_end carries the corrections then in force."""
    from rakv.config import RakvConfig
    from rakv.drafts.ngram import NgramDraft
    from rakv.engine import Engine
    from tests.tiny import assert_exact, make_pair

    target, _ = make_pair("llama", "mostly")
    p = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[], t=[[16, 1.0], [256, 1.0]], d=[[16, 0.0], [256, 0.0]],
                    V={str(k): r for k, r in BUSY.items()}, alpha0=0.95)
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive", chat_template=False), profile=p)
    base = [3, 4, 5, 6, 7, 8, 9, 10] * 4
    for i in range(4):
        prompt = base + [11 + i]
        end = eng.generate(prompt, 24)
        assert_exact(end, target, prompt, 24)
        assert end.cost_corrections == p.corrections()


def test_a_longer_length_without_rounds_takes_the_shorter_ones_correction():
    """The argmin stopped short on a steep profile: the lengths it never ran borrow the longest
    corrected shorter length's correction, so they get tried and then measured themselves."""
    p = steep_profile()
    feed(p, QUIET, 200, ks=(1, 2, 4, 6))
    c6 = p.shape_correction(6)
    assert c6 == pytest.approx(QUIET[6] / BUSY[6], rel=0.12)
    assert p.samples.get("S8", 0) == 0 and p.shape_correction(8) == c6
    feed(p, {**QUIET, 8: BUSY[8]}, 200, ks=(8,), seed=1)          # V(8) really is steep: its own rounds say so
    assert p.verify(8, 128) / p.step(128) == pytest.approx(BUSY[8], rel=0.12)
