"""The RAKV proposer's model draft (rakv/integrations/vllm_draft.py), driven without vLLM.

``serve`` below plays vLLM's part exactly as vLLM 0.32 calls a ``custom_class`` proposer: after
each step, per request row, the tokens the step sampled (the accepted drafts plus one), the
request's length and its token ids; a draft is accepted while it equals the target's greedy
token. The target is the demo model in fp32, the draft its own codes in q8 (what
``RAKV_VLLM_DRAFT=demo`` gives inside vLLM).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rakv import decoding as dec
import rakv.load.hub as LH
from rakv.decide import profile as PF
from rakv.decide.policy import worth_starting
from rakv.integrations import vllm_draft as VD
from rakv.integrations import vllm_proposer as VP

PROFILE = {"t_ms": 60.0, "V_ms": {"1": 62.0, "2": 64.0, "4": 68.0, "8": 76.0}}
WIDTH = 1024


@pytest.fixture(scope="module")
def target():
    return LH.load_model("demo", numerics="fp32")


def greedy(lm, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation (what vLLM without speculation gives)."""
    cache = dec.DynamicCache()
    with torch.no_grad():
        out = [int(dec.prefill(lm.model, prompt, cache).argmax())]
        while len(out) < n:
            out.append(int(dec.decode_one(lm.model, out[-1], cache).argmax()))
    return out


def row(ids):
    a = np.zeros((1, WIDTH), dtype=np.int32)
    a[0, :len(ids)] = ids
    return a


def serve(p: VP.RakvProposer, prompt: list[int], ref: list[int], check=None) -> list[int]:
    """vLLM's side: verify each step's drafts against the target's greedy tokens ``ref``."""
    seq = list(prompt) + [ref[0]]                 # the prefill step samples the first token
    sampled = [ref[0]]
    while len(seq) - len(prompt) < len(ref):
        drafts = p.propose([sampled], np.array([len(seq)]), row(seq))[0]
        if check is not None:
            check(seq, drafts)
        at = len(seq) - len(prompt)
        a = 0
        while a < len(drafts) and at + a < len(ref) and drafts[a] == ref[at + a]:
            a += 1
        sampled = list(drafts[:a]) + ([ref[at + a]] if at + a < len(ref) else [])
        seq += sampled
    return seq[len(prompt):]


def proposer(**kw) -> VP.RakvProposer:
    p = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE, draft=("demo", "q8"), **kw)
    p.load_model()
    return p


def prompt_ids(target, text: str) -> list[int]:
    return target.tokenizer(text)["input_ids"]


def chat(target, text: str) -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def draft_lm():
    return VD.load_draft("demo", "q8")


def fresh_first(draft_lm, seq: list[int]) -> int:
    """The draft's greedy next token after ``seq`` computed from scratch (no carried cache)."""
    cache = dec.DynamicCache()
    with torch.no_grad():
        return int(dec.prefill(draft_lm.model, seq, cache).argmax())


def test_model_draft_rolls_back_to_what_vllm_accepted(target, draft_lm):
    """Every model draft's first token equals the draft computed afresh on the accepted tokens:
    the carried cache is exactly the accepted prefix, step after step."""
    p = proposer()
    prompt = chat(target, "Write a short poem about the sea.")
    ref = greedy(target, prompt, 48)
    seen = []

    def check(seq, drafts):
        rq = next(iter(p._reqs.values()))[0]
        if drafts and rq.pending and rq.pending[2] == "model":
            seen.append((drafts[0], fresh_first(draft_lm, seq[rq.off:])))

    assert serve(p, prompt, ref, check) == ref
    assert len(seen) >= 3 and all(a == b for a, b in seen)
    s = p.stats()
    assert s["model_starts"] == 1 and s["model_rows"] >= 3
    assert s["model_acceptance"] >= 0.8               # the target's own codes in q8: 0.95 measured


def test_a_long_prompt_is_drafted_from_its_last_tokens(target, draft_lm):
    """The draft reads at most DRAFT_WINDOW tokens: a long prompt's draft starts from its tail, and
    its drafts stay what the draft computes afresh on that tail."""
    p = proposer()
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(40))
    prompt = chat(target, text + " Now write a short story about these boxes.")
    assert len(prompt) > VP.DRAFT_WINDOW
    ref = greedy(target, prompt, 32)
    seen = []

    def check(seq, drafts):
        rq = next(iter(p._reqs.values()))[0]
        if drafts and rq.pending and rq.pending[2] == "model":
            assert rq.off == len(prompt) + 1 - VP.DRAFT_WINDOW or rq.off > 0
            seen.append((drafts[0], fresh_first(draft_lm, seq[rq.off:])))

    p.dcost.prefill_ms_tok = 0.01                     # (cheap: the long prompt's draft starts at once)
    assert serve(p, prompt, ref, check) == ref
    assert seen and all(a == b for a, b in seen)


def test_two_requests_side_by_side_keep_their_own_drafts(target):
    """Two rows in one batch, swapping places between steps: each request keeps its draft state."""
    p = proposer()
    prompts = [chat(target, "Name three colours."), chat(target, "What is 2 + 2? Explain.")]
    refs = [greedy(target, pr, 32) for pr in prompts]
    seqs = [list(pr) + [rf[0]] for pr, rf in zip(prompts, refs)]
    sampled = [[rf[0]] for rf in refs]
    order = [0, 1]
    while any(len(s) - len(pr) < len(rf) for s, pr, rf in zip(seqs, prompts, refs)):
        live = [i for i in order if len(seqs[i]) - len(prompts[i]) < len(refs[i])]
        rows = np.zeros((len(live), WIDTH), dtype=np.int32)
        for r, i in enumerate(live):
            rows[r, :len(seqs[i])] = seqs[i]
        drafts = p.propose([sampled[i] for i in live], np.array([len(seqs[i]) for i in live]), rows)
        for r, i in enumerate(live):
            at = len(seqs[i]) - len(prompts[i])
            a = 0
            while a < len(drafts[r]) and at + a < len(refs[i]) and drafts[r][a] == refs[i][at + a]:
                a += 1
            sampled[i] = list(drafts[r][:a]) + ([refs[i][at + a]] if at + a < len(refs[i]) else [])
            seqs[i] += sampled[i]
        order.reverse()                               # vLLM condenses its batch: rows move
    assert [s[len(pr):] for s, pr in zip(seqs, prompts)] == refs
    s = p.stats()
    assert s["requests"] == 2 and s["model_starts"] == 2 and s["model_acceptance"] >= 0.8


def test_an_expensive_prefill_keeps_the_model_draft_off(target):
    """The first model round pays for the prompt's prefill: where that costs more than the draft
    can save over the tokens the request is expected to run, the request stays with copies / plain."""
    p = proposer()
    p.dcost.prefill_ms_tok = 1e3                      # a prompt token's prefill: a second
    prompt = chat(target, "Write a short poem about the sea.")
    ref = greedy(target, prompt, 24)
    assert serve(p, prompt, ref) == ref
    assert p.stats()["model_starts"] == 0


def test_fixed_k_drafts_exactly_k_and_vocab_ends_a_draft(target):
    p = proposer(copies=False, fixed_k=3)
    prompt = chat(target, "Name three colours.")
    ref = greedy(target, prompt, 16)
    ks = []
    serve(p, prompt, ref, lambda seq, d: ks.append(len(d)))
    assert ks and all(k == 3 for k in ks)
    # an id the target does not have ends the draft there
    q = proposer(copies=False, fixed_k=4)
    q.vocab = 1                                       # every id >= 1: nothing survives
    seq = list(prompt) + [ref[0]]
    assert q.propose([[ref[0]]], np.array([len(seq)]), row(seq)) == [[]]


def test_the_profile_names_the_draft_and_its_acceptance(monkeypatch):
    monkeypatch.delenv(VD.DRAFT_ENV, raising=False)
    prof = dict(PROFILE, draft={"spec": "demo", "numerics": "q8", "alpha": 0.9})
    p = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=prof)
    assert p.draft_spec == ("demo", "q8")
    assert p.m_pool[0] / p.m_pool[1] == pytest.approx(0.9)
    assert VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE).draft_spec is None
    monkeypatch.setenv(VD.DRAFT_ENV, "demo")
    monkeypatch.setenv(VD.NUMERICS_ENV, "fp32")
    assert VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=prof).draft_spec == ("demo", "fp32")


@pytest.mark.fast
def test_worth_starting_and_remaining():
    assert VD.remaining(1) == VD.REMAINING_MIN and VD.remaining(100) == 100
    assert worth_starting(100.0, 20.0, 60.0, 16)          # 16 x 40 ms saved > 100 ms
    assert not worth_starting(1000.0, 20.0, 60.0, 16)
    assert not worth_starting(0.0, 60.0, 20.0, 100)       # slower than the other choice


def test_switch_arms_share_one_draft(target, tmp_path, monkeypatch):
    """The measuring switch: ``draft:K`` (the model at a fixed K), ``rakvcopy`` (copies only) and
    ``rakv`` (both, gated) on one engine, one loaded draft between them."""
    ctl = tmp_path / "ctl"
    monkeypatch.setenv(VP.CONTROL_ENV, str(ctl))
    monkeypatch.setenv(VD.DRAFT_ENV, "demo")
    monkeypatch.delenv(VP.PROFILE_ENV, raising=False)
    sw = VP.SwitchProposer(None)
    sw.load_model()
    prompt = chat(target, "Name three colours.")
    ref = greedy(target, prompt, 12)
    seq = list(prompt) + [ref[0]]
    ctl.write_text("draft:3")
    assert len(sw.propose([[ref[0]]], np.array([len(seq)]), row(seq))[0]) == 3
    assert sw.arms["draft:3"].dlm is sw.rakv.dlm
    import os
    os.utime(ctl, ns=(1, 1))                          # (a new mtime: the switch re-reads it)
    ctl.write_text("rakvcopy")
    sw.propose([[ref[0]]], np.array([len(seq)]), row(seq))
    assert sw.arms["rakvcopy"].dlm is None and sw.arms["rakvcopy"].counts["rows"] == 1
    assert set(sw.stats()) == {"rakv", "rakvcopy", "draft:3"}


@pytest.mark.fast
def test_a_rows_costs_follow_the_batch_size():
    """At batch B a row's share of a step is V_B(k) / B (the nearest measured B); batch 1 as measured."""
    prof = dict(PROFILE, by_batch={"4": {"t_ms": 100.0, "V_ms": {"1": 110.0, "2": 120.0, "4": 140.0, "8": 200.0}}})
    p = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=prof, draft=None)
    assert p.row_costs(1) == PF.verify_costs(prof, 8)
    v4 = p.row_costs(4)
    assert v4[0] == pytest.approx(25.0) and v4[8] == pytest.approx(50.0) and p.row_costs(5) == v4
    assert VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE, draft=None).row_costs(4) == \
        PF.verify_costs(PROFILE, 8)                   # only batch 1 measured: its costs


def test_a_draft_that_cannot_load_leaves_copies(caplog):
    """A bad draft name must not take vLLM's engine down: one error line, copies only."""
    p = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE, draft=("/no/such/model", "q8"))
    with caplog.at_level("ERROR", logger="rakv.vllm"):
        p.load_model()
    assert p.dlm is None and "could not be loaded" in caplog.text and p.counts["draft_error"]
    block = list(range(10, 40))
    ids = block + [5] + block[:6]
    assert p.propose([[ids[-1]]], np.array([len(ids)]), row(ids))[0]          # copies still proposed


def test_a_draft_with_another_tokenizer_is_refused(target, caplog):
    """The draft's ids must mean the target's text: a tokenizer that splits text otherwise (the
    tiny test tokenizer here) is refused at load with one error line; copies go on."""
    from tests.tiny import tiny_tokenizer

    p = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE, draft=("demo", "q8"),
                        tokenizer=tiny_tokenizer())
    with caplog.at_level("ERROR", logger="rakv.vllm"):
        p.load_model()
    assert p.dlm is None and "tokenizer is not the target's" in caplog.text
    q = VP.RakvProposer(k_max=8, max_model_len=WIDTH, profile=PROFILE, draft=("demo", "q8"),
                        tokenizer=target.tokenizer)
    q.load_model()
    assert q.dlm is not None
