"""A draft model's codes made narrower (``--draft-codes q4``, ``rakv.drafts.registry.narrow_draft``): every layer
wider than 4 bits requantized to Q4_1 once (and read back from the cache dir after); the draft
changes, and every policy still gives target-only decoding's ids, greedy and seeded (the target
verifies every drafted token); fp32 numerics refuse it in one line."""

from __future__ import annotations

import pytest
import torch

from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.drafts.registry import draft_codes
from rakv.engine import Engine
from rakv.kernels import blockq
from rakv.kernels.fastpath import FastLinear
from rakv.drafts.registry import narrow_draft
from rakv.load.loaded import ModelError
from rakv.load.numerics import set_numerics
from rakv.config import Sampling
from tests.tiny import make_pair, synthetic_profile

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

kernel = pytest.mark.skipif(blockq.library() is None, reason=f"no block kernel: {blockq.reason()}")


def prompts():
    base = list(range(5, 45))
    return [base, base[:30] + [7, 8, 9, 10], base[:12], [3, 4, 5] * 6]


def test_q4_1_codes_rebuild_the_weights_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * 0.3
    w[3, :32] = 0.25                                       # a constant block: d = 0, every code 0
    b = blockq.quantize_q4_1(w)
    assert b.kind == "q4" and b.qs.dtype == torch.uint8 and b.qs.shape == (37, 3, 16)
    d, m = b.d.unsqueeze(-1), b.m.unsqueeze(-1)
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())       # float16 values
    err = (b.dequantize() - w).reshape(37, 3, 32).abs()
    assert (err <= d / 2 + 1e-3 * w.abs().max()).all()
    assert torch.equal(b.dequantize()[3, :32], torch.full((32,), float(torch.tensor(0.25).half())))


def test_narrower_codes_keep_4_bit_codes_and_cut_wider_ones():
    w = torch.randn(50, 64)
    q8 = blockq.quantize_q8_0(w).with_numerics("q8")
    n = blockq.narrower_q4(q8, rows=16)                    # rows at a time: the same as all at once
    assert n.kind == "q4" and n.numerics == "q8"
    whole = blockq.quantize_q4_1(q8.dequantize())
    assert torch.equal(n.qs, whole.qs) and torch.equal(n.d, whole.d) and torch.equal(n.m, whole.m)
    assert blockq.narrower_q4(n) is n


def _pair(agreement="mostly"):
    t, d = make_pair("llama", agreement)
    return set_numerics(t, "q8"), set_numerics(d, "q8")


@kernel
def test_every_policy_is_exact_with_a_narrowed_draft():
    target, d = _pair()
    ar = Engine(target, None, RakvConfig(policy="ar"))
    want = {tuple(p): ar.generate(p, 20).output_ids for p in prompts()}
    key = d.key
    narrow_draft(d, "q4")
    assert d.key == key + "+n4" and d.narrow == "q4"
    blocks = [m.block for m in d.model.modules() if isinstance(m, FastLinear) and m.block is not None]
    assert blocks and all(b.kind == "q4" and b.numerics == "q8" for b in blocks)
    draft = ModelDraft(d)
    for policy in ("spec:1", "spec:4", "joint:3", "tree:6", "adaptive"):
        prof = synthetic_profile() if policy == "adaptive" else None
        eng = Engine(target, draft, RakvConfig(policy=policy), profile=prof)
        for p in prompts() + prompts():                    # the second pass: exact and partial hits
            assert eng.generate(p, 20).output_ids == want[tuple(p)], (policy, p[:4])


@kernel
def test_seeded_sampling_is_exact_with_a_narrowed_draft():
    target, d = _pair()
    s = Sampling(temperature=0.8, top_p=0.95, seed=11)
    ar = Engine(target, None, RakvConfig(policy="ar", sampling=s))
    want = {tuple(p): ar.generate(p, 20).output_ids for p in prompts()}
    draft = ModelDraft(narrow_draft(d, "q4"))
    for policy in ("spec:3", "joint:4"):
        eng = Engine(target, draft, RakvConfig(policy=policy, sampling=s))
        for p in prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], policy


@kernel
def test_narrowed_codes_are_read_back_the_second_time():
    _, d1 = _pair()
    narrow_draft(d1, "q4")
    first = {n: m.block for n, m in d1.model.named_modules() if isinstance(m, FastLinear) and m.block is not None}
    _, d2 = _pair()
    called = []
    orig = blockq.narrower_q4
    blockq.narrower_q4 = lambda b, rows=8192: called.append(b) or orig(b, rows)
    try:
        narrow_draft(d2, "q4")
    finally:
        blockq.narrower_q4 = orig
    assert not called                                      # every layer from the saved copy
    again = {n: m.block for n, m in d2.model.named_modules() if isinstance(m, FastLinear) and m.block is not None}
    assert again.keys() == first.keys()
    assert all(torch.equal(again[n].qs, first[n].qs) and torch.equal(again[n].d, first[n].d) for n in first)


def test_auto_narrows_only_under_q8():
    t, d = make_pair("llama", "mostly")
    assert draft_codes(d, "auto") == "file" and draft_codes(d, "q4") == "q4"
    with pytest.raises(ModelError, match="q8 numerics"):
        narrow_draft(d, "q4")
    with pytest.raises(ModelError, match="--draft-codes"):
        narrow_draft(d, "q3")


def test_a_bad_draft_codes_value_is_one_line(capsys):
    from rakv.cli import main

    assert main(["generate", "--target", "demo", "--draft", "ngram", "--draft-codes", "q2", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-codes" in err[0]
