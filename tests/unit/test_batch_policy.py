"""The decision priced by the batch (``rakv.decide.policy.batch_k``): alone it is the single request's
rule; beside others it maximises the batch's tokens per ms, so a long shot in a full batch loses its
rows, a pass that costs about the same for more rows keeps free copies paying, and a model draft's
forwards (steps in which its request emits nothing) stop paying once others share the steps."""

from __future__ import annotations

import pytest

from rakv.decide.learned import BatchView
from rakv.decide.policy import E, batch_k, batch_rate

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


def test_the_view_counts_the_others_only():
    v = BatchView()
    v.told(1, 5, 3.0)
    v.told(2, 1, 1.0)
    v.told(3, 3, 2.5)
    assert v.others(2) == (8, 5.5, 2)
    v.leave(1)
    assert v.others(2) == (3, 2.5, 1) and v.others(9) == (4, 3.5, 2)
