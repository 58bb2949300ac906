"""A draft model limited to part of its vocabulary (``ModelDraft(lm, vocab=N)``, ``--draft-vocab``):
its head reads only those rows, in the same arithmetic as the whole head's rows; every other id's
logit is -inf; and every policy still gives target-only decoding's ids, greedy and seeded, fp32
and q8 (the target verifies every drafted token)."""

from __future__ import annotations

import pytest
import torch

from rakv import decoding as dec
from rakv.backends import lean_of
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft, vocab_ids
from rakv.drafts.registry import draft_vocab
from rakv.engine import Engine
from rakv.kernels import blockq
from rakv.load.numerics import set_numerics
from rakv.config import Sampling
from tests.tiny import make_pair, synthetic_profile

N = 40          # of the tiny vocabulary's ids


def prompts():
    base = list(range(5, 45))
    return [base, base[:30] + [7, 8, 9, 10], base[:12], [3, 4, 5] * 6]


def _pair(numerics: str, agreement: str = "mostly"):
    t, d = make_pair("llama", agreement)
    if numerics == "q8":
        if blockq.library() is None:
            pytest.skip(f"no block kernel: {blockq.reason()}")
        t, d = set_numerics(t, "q8"), set_numerics(d, "q8")
    return t, d


@pytest.mark.fast
@pytest.mark.parametrize("numerics", ["fp32", "q8"])
def test_the_limited_head_is_the_whole_heads_rows(numerics):
    _, d = _pair(numerics)
    ids = list(range(5, 30))
    full = dec.prefill(d.model, ids, dec.DynamicCache())
    keep = vocab_ids(d, N)
    assert keep is not None and keep[:N].tolist() == list(range(N))
    lean_of(d.model).limit_head(keep)
    try:
        part = dec.prefill(d.model, ids, dec.DynamicCache())
    finally:
        lean_of(d.model).limit_head(None)
    assert torch.equal(part[..., keep], full[..., keep])
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[keep] = False
    assert torch.isneginf(part[..., rest]).all()


@pytest.mark.parametrize("numerics", ["fp32", "q8"])
def test_every_policy_is_exact_with_a_limited_draft(numerics):
    target, d = _pair(numerics)
    ar = Engine(target, None, RakvConfig(policy="ar"))
    want = {tuple(p): ar.generate(p, 20).output_ids for p in prompts()}
    draft = ModelDraft(d, vocab=N)
    assert draft.vocab == N and draft.key.endswith(f"+v{N}")
    for policy in ("spec:1", "spec:4", "joint:3", "adaptive"):
        prof = synthetic_profile() if policy == "adaptive" else None
        eng = Engine(target, draft, RakvConfig(policy=policy), profile=prof)
        for p in prompts() + prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], (policy, p[:4])
    lean_of(d.model).limit_head(None)


def test_seeded_sampling_is_exact_with_a_limited_draft():
    target, d = _pair("fp32")
    s = Sampling(temperature=0.8, top_p=0.95, seed=11)
    ar = Engine(target, None, RakvConfig(policy="ar", sampling=s))      # a request's samples: the engine's
    want = {tuple(p): ar.generate(p, 20).output_ids for p in prompts()}   # seed and its request count
    draft = ModelDraft(d, vocab=N)
    for policy in ("spec:3", "joint:4"):
        eng = Engine(target, draft, RakvConfig(policy=policy, sampling=s))
        for p in prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], policy
    lean_of(d.model).limit_head(None)


@pytest.mark.fast
def test_only_a_large_vocabulary_is_limited():
    t, d = _pair("fp32")
    assert draft_vocab(d, d.vocab_size // 2 + 1) == 0 and draft_vocab(d, d.vocab_size // 2) == d.vocab_size // 2
    assert vocab_ids(d, 0) is None and vocab_ids(d, d.vocab_size) is None
    assert ModelDraft(d, vocab=0).vocab == 0


def test_a_negative_draft_vocab_is_one_line(capsys):
    from rakv.cli import main

    assert main(["generate", "--target", "demo", "--draft", "ngram", "--draft-vocab", "-3", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-vocab" in err[0]
