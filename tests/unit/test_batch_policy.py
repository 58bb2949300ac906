"""The decision priced by the batch (``rakv.decide.policy.batch_k``): alone it is the single request's
rule; beside others it maximises the batch's tokens per ms, so a long shot in a full batch loses its
rows, a pass that costs about the same for more rows keeps free copies paying, and a model draft's
forwards (steps in which its request emits nothing) stop paying once others share the steps."""

from __future__ import annotations

import pytest

from rakv.decide.learned import BatchView
from rakv.decide.policy import E, batch_k, batch_rate, joint_move

pytestmark = pytest.mark.fast
KS = [0, 1, 2, 4, 6, 8]


def _W(per_row: float, t: float = 1.0):
    """A pass of n rows: t, plus per_row of t for each row past the first."""
    return lambda n: t * (1 + per_row * (n - 1))


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("per_row,d", [(0.03, 0.1), (0.25, 0.0), (0.1, 0.3)])
def test_alone_it_is_the_single_request_rule(alpha, per_row, d):
    W = _W(per_row)
    solo = min(KS, key=lambda k: (W(k + 1) + k * d) / E(k, alpha))        # ms per token, the controller's form
    assert batch_k(KS, lambda k: E(k, alpha), W, 0, 0.0, lambda k: k * d, lambda k: k) == solo


def test_a_long_shot_in_a_full_batch_gives_its_rows_to_the_others():
    W = _W(0.25)                                       # a pass costs more with every row (compute-bound)
    E_of = lambda k: E(k, 0.6)                         # noqa: E731
    assert batch_k(KS, E_of, W, 0, 0.0, lambda k: 0.0) > 0          # alone, drafting pays
    assert batch_k(KS, E_of, W, 12, 12.0, lambda k: 0.0) == 0       # beside 12 plain rows it does not


def test_a_flat_pass_keeps_free_copies_paying_in_a_batch():
    W = _W(0.01)                                       # bandwidth-bound: rows nearly free
    E_of = lambda k: E(k, 0.5)                         # noqa: E731
    lookup = lambda k: 0.002                           # noqa: E731 - an n-gram lookup: no forwards of its own
    alone = batch_k(KS, E_of, W, 0, 0.0, lookup)
    shared = batch_k(KS, E_of, W, 3, 3.0, lookup)
    assert alone > 0 and shared > 0
    assert batch_rate(shared, E_of(shared), W, 3, 3.0, 0.002) > batch_rate(0, 1.0, W, 3, 3.0, 0.0)


def test_a_model_draft_stops_paying_once_others_share_the_steps():
    W = _W(0.01)
    E_of = lambda k: E(k, 0.8)                         # noqa: E731
    d = lambda k: 0.15 * k                             # noqa: E731
    assert batch_k(KS, E_of, W, 0, 0.0, d, lambda k: k) > 0          # alone its rounds pay
    assert batch_k(KS, E_of, W, 3, 3.0, d, lambda k: k) == 0         # beside 3 requests: k forwards emit nothing


def test_in_lockstep_a_model_draft_pays_beside_others_and_more_so_beside_drafting_ones():
    """In lockstep (the target's rows wait while a draft's do) a model draft's forwards are no steps
    of their own: beside plain requests its drafting holds them, beside drafting ones it rides their
    passes (the round waits for the longest drafting either way)."""
    W = _W(0.01)
    E_of = lambda k: E(k, 0.8)                         # noqa: E731
    d = lambda k: 0.15 * k                             # noqa: E731
    assert batch_k(KS, E_of, W, 3, 3.0, d) > 0                          # beside 3 plain rows: still pays
    assert batch_k(KS, E_of, _W(0.25), 12, 12.0, d) == 0                # a full batch of dear rows: not
    plain = batch_rate(0, 1.0, W, 3, 3.0, 0.0, 0, d(4))                 # others drafting 4: k = 0 waits too
    assert batch_rate(4, E_of(4), W, 3, 3.0, d(4), 0, d(4)) > plain
    assert batch_k(KS, E_of, W, 3, 3.0, d, drafting_o=d(4)) >= batch_k(KS, E_of, W, 3, 3.0, d)
    v = BatchView(lockstep=True)
    v.told(1, 5, 3.0, 4)
    v.told(2, 1, 1.0, 0)
    assert v.others_drafting(2) == 4 and v.others_drafting(1) == 0
    v.leave(1)
    assert v.others_drafting(2) == 0


def test_the_joint_move_escapes_the_plain_equilibrium_of_best_answers():
    """Two requests in lockstep, each at k = 0: each one's best answer is k = 0 (drafting alone
    holds the other for its passes), yet both drafting together emits more per ms; the joint move
    (``joint_move``) finds it: one K for both."""
    W = _W(0.03)
    d = lambda K, m=1: 0.35 * K * W(m)                 # noqa: E731 - K draft passes of m rows
    a = {1: 0.7, 2: 0.7}
    assert batch_k(KS, lambda k: E(k, 0.7), W, 1, 1.0, d) == 0           # the best answer to k = 0
    K, drafting, rate, T = joint_move(KS, a, W, 0, 0.0, d)
    assert K > 0 and drafting == {1, 2} and T == pytest.approx(d(K, 2) + W(2 * (K + 1)))
    assert rate > 2.0 / W(2) * 1.1                     # more than both plain (2 tokens a pass of 2)
    assert rate == pytest.approx(2 * E(K, 0.7) / (d(K, 2) + W(2 * (K + 1))))


def test_the_joint_move_drafts_the_likely_requests_only_and_none_when_nothing_pays():
    W = _W(0.03)
    d = lambda K, m=1: 0.27 * K * W(m)                 # noqa: E731
    K, drafting, _, _ = joint_move(KS, {1: 0.9, 2: 0.05, 3: 0.85}, W, 0, 0.0, d)
    assert K > 0 and drafting == {1, 3}                # the unlikely one stays plain; the others draft together
    assert joint_move(KS, {1: 0.1, 2: 0.15}, W, 0, 0.0, d)[:2] == (0, frozenset())
    dear = _W(0.25)                                    # rows that cost: beside 12 plain rows nobody drafts
    assert joint_move(KS, {1: 0.6, 2: 0.6}, dear, 12, 12.0, lambda K, m=1: 0.27 * K * dear(m))[0] == 0


def test_the_joint_move_holds_its_k_against_a_near_equal_one():
    W = _W(0.03)
    d = lambda K, m=1: 0.35 * K * W(m)                 # noqa: E731
    a = {1: 0.7, 2: 0.7}
    K, _, rate, _ = joint_move(KS, a, W, 0, 0.0, d)
    rates = {j: joint_move([j], a, W, 0, 0.0, d)[2] for j in KS if j}
    near = max((j for j in rates if j != K), key=lambda j: rates[j])
    assert rates[near] * 1.05 >= rate                  # a runner-up within the margin ...
    assert joint_move(KS, a, W, 0, 0.0, d, keep=near)[0] == near          # ... is kept while in force
    assert joint_move(KS, a, W, 0, 0.0, d, keep=near, margin=0.0)[0] == K


def test_the_view_keeps_the_joint_requests_and_the_rest_apart():
    v = BatchView(lockstep=True)
    for q in (1, 2, 3):
        v.told(q, 1, 1.0)
    v.joins(1, 0.8)
    v.joins(3, 0.7)
    assert v.apart(None) == (1, 1.0) and v.alpha == {1: 0.8, 3: 0.7}
    v.leave(3)
    assert v.alpha == {1: 0.8} and v.apart(None) == (1, 1.0)
    s = v.steps
    v.tick()
    assert v.steps == s + 1


def test_the_view_counts_the_others_only():
    v = BatchView()
    v.told(1, 5, 3.0)
    v.told(2, 1, 1.0)
    v.told(3, 3, 2.5)
    assert v.others(2) == (8, 5.5, 2)
    v.leave(1)
    assert v.others(2) == (3, 2.5, 1) and v.others(9) == (4, 3.5, 2)


def test_a_starting_request_counts_as_one_plain_row_until_its_first_round():
    v = BatchView()
    v.join(1)
    v.join(2)
    assert v.others(1) == (1, 1.0, 1)              # request 2 is in its prompt: priced as a plain row
    v.told(2, 5, 3.0)
    v.join(2)                                      # (joining again changes nothing it told)
    assert v.others(1) == (5, 3.0, 1)


def test_the_batch_learns_a_pass_of_n_rows_from_its_steps():
    from rakv.decide.learned import BATCH_COST_BOUND, BatchCosts, rows_bucket

    c = BatchCosts()
    assert c.factor(8) == 1.0                      # before any step: the profile's W(n)
    for _ in range(40):
        c.observe(8, 10.0, 15.0)                   # 8 rows of 8 requests: 1.5x one request's 8-row verify
    assert c.factor(8) == pytest.approx(1.5, rel=0.02)
    assert c.factor(40) == c.factor(2) == c.factor(8)      # one bucket measured: its scale everywhere
    c.observe(1, 4.0, 4.0)
    assert c.factor(1) == pytest.approx(1.0) and c.factor(64) == c.factor(12)
    xs = [c.factor(n) for n in range(1, 12)]
    assert xs == sorted(xs) and 1.0 < c.factor(4) < c.factor(8)    # between buckets: no step at an edge
    assert len({rows_bucket(n) for n in range(1, 17)}) == 16          # each count to 16 its own
    assert rows_bucket(17) == rows_bucket(31) != rows_bucket(32) == rows_bucket(63)
    for _ in range(200):
        c.observe(64, 1.0, 1000.0)                 # a wild step moves it by a clipped factor, within bounds
    assert c.scale[rows_bucket(64)] == pytest.approx(BATCH_COST_BOUND)
    c.observe(8, 10.0, float("nan"))
    c.observe(8, 0.0, 5.0)
    assert c.scale[rows_bucket(8)] == pytest.approx(1.5, rel=0.02)   # (bad measurements: ignored)


def test_the_batch_price_uses_the_measured_pass():
    """W(n) is the profile's V(n - 1) times the learned scale: a batch whose passes grow dear with
    rows (what the steps measured) gives a long shot's rows back where the profile alone would not."""
    from rakv.decide.learned import BatchCosts
    from rakv.decide.planner import batch_pass
    from tests.tiny import synthetic_profile

    p = synthetic_profile(V={str(k): 1.0 + 0.01 * k for k in range(1, 64)}, d=0.0)
    costs = BatchCosts()
    W = batch_pass(p, costs, 32)
    assert W(1) == pytest.approx(p.step(32)) and W(5) == pytest.approx(p.verify(4, 32))
    E_of = lambda k: E(k, 0.5)                     # noqa: E731
    free = lambda k: 0.0                           # noqa: E731 - copies: nothing to draft
    assert batch_k(KS, E_of, W, 6, 6.0, free) > 0                  # the profile: rows nearly free
    for _ in range(40):
        for n in (8, 16):                          # the steps: a pass past 7 rows costs twice as much
            costs.observe(n, p.verify(n - 1, 32), 2.0 * p.verify(n - 1, 32))
        costs.observe(4, p.verify(3, 32), p.verify(3, 32))
    assert batch_k(KS, E_of, W, 6, 6.0, free) > 0                  # (W prices each n once: a round's snapshot)
    W = batch_pass(p, costs, 32)
    assert batch_k(KS, E_of, W, 6, 6.0, free) == 0                 # 6 others + 1 plain row: 7


def test_a_draft_that_has_not_read_its_prompt_pays_that_to_draft():
    """The catch-up a model draft owes (its prompt, read only once a round drafts) is priced into
    the rounds that would draft: a one-off spread over the request's rounds, steps of its own."""
    W = _W(0.02)
    E_of = lambda k: E(k, 0.8)                     # noqa: E731
    d = lambda k: 0.05 * k                         # noqa: E731
    assert batch_k(KS, E_of, W, 1, 1.0, d, lambda k: 0.2 * k) > 0            # a cheap draft beside one other
    owe, steps, remaining = 30.0, 3, 16                                       # its prompt: 30 ms, 3 chunks
    once = lambda k: E_of(k) / remaining           # noqa: E731
    assert batch_k(KS, E_of, W, 1, 1.0, lambda k: d(k) + owe * once(k),
                   lambda k: 0.2 * k + steps * once(k)) == 0


def test_a_copy_in_a_batch_must_earn_the_batch_s_rate():
    """The lookup gate beside others (RoundGate base = 1 + their tokens, V = the whole step's
    passes): copies a lone step would verify are cut where each row must earn what the batch's rows
    earn; alone (base 1) the same copies are verified."""
    from rakv.decide.gate import RoundGate
    from rakv.decide.planner import BatchVerifies

    class Map:
        def p(self, conf):
            return conf

    W = lambda n: 10.0 * (1.0 + 0.1 * (n - 1))          # noqa: E731 - each row 10% of a step
    alone = RoundGate(Map(), 4, 0.0, [W(1 + j) for j in range(5)])
    batch = RoundGate(Map(), 4, 0.0, BatchVerifies(W, 3, 4), base=4.0)
    for g in (alone, batch):
        for _ in range(4):
            if not g.keep_going(0.3):
                break
    assert alone.verify_length(len(alone.S)) >= 1        # 1.3 tokens for 1.1 steps: worth it alone
    assert batch.verify_length(len(batch.S)) == 0        # 4.3 for 1.077x the pass of 4: not in the batch
    assert list(BatchVerifies(W, 3, 2)) == [W(4), W(5), W(6)] and len(BatchVerifies(W, 3, 2)) == 3


def test_a_move_s_round_is_cut_short_only_when_it_drafts_alone():
    """Beside the move's other drafting requests the passes run anyway: no gate cuts the round."""
    from rakv.decide.planner import cut_beside_drafting

    assert not cut_beside_drafting(frozenset({2}))
    assert cut_beside_drafting(frozenset())
