"""Token trees: one forward verifies a tree of candidates; the output stays target-only decoding's.

On block-coded weights (the block kernel and its own tree attention) a tree row equals the same
token's decode step bit for bit, logits and KV; the KV after a tree round equals the KV of decoding
the accepted path one token at a time. The engine's ``tree:N`` policy is exact for every node
budget 1..16, greedy and seeded sampling, on GPT-2 and Llama, with EOS inside the accepted path,
partial hits and exact repeats; on HF's own forward it verifies the tree's first path as a chain.
"""

from __future__ import annotations

import json

import pytest
import torch

from rakv import decoding as dec
from rakv.decoding import sampling as S
from rakv.config import Policy, RakvConfig
from rakv.drafts.ngram import ngram_tree, NgramDraft
from rakv.engine import Engine
from rakv.kernels import blockq
from rakv.kernels.lean import TreeLayout
from rakv.prefix_cache import TokenHistory
from rakv.config import Sampling
from rakv.decoding.tree import TokenTree, verify_tree, walk

from tests.unit.test_blockq import kernel, needs_onednn  # noqa: F401  (the kernel fixture)
from tests.engine.test_sampling_exact import reference as sampled_reference
from tests.tiny import (EOS_N, EOS_PROMPTS, assert_exact, make_model, make_pair, oracle, save_tiny, snap_to_blocks,
                   tiny_tokenizer, wrap_tiny)

# a branchy tree: node parents (-1: a child of the pending token)
BRANCHY_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
BRANCHY_PARENTS = [-1, 0, 0, -1, 1, 3, 4, 4]


def _coded(arch: str):
    t = snap_to_blocks(make_model(arch))
    return wrap_tiny(t, tiny_tokenizer(), name=f"tiny-{arch}-tree-q4")


def _path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _decode_path(m, ids, at, tokens) -> tuple[list[torch.Tensor], object]:
    """Prefill ids[:at], then feed ``tokens`` one at a time: (each step's logits, the cache)."""
    c = dec.DynamicCache()
    dec.prefill(m, ids[:at], c)
    return [dec.forward(m, [t], c)[-1] for t in tokens], c


# ----------------------------------------------------------------------------- the mask
@pytest.mark.fast
def test_the_tree_mask_on_a_branchy_tree():
    lay = TreeLayout([-1] + [p + 1 for p in BRANCHY_PARENTS])       # row 0: the pending token
    past = 5
    m = lay.mask(past)
    assert m.shape == (9, past + 9)
    assert lay.depths == [0, 1, 2, 2, 1, 3, 2, 4, 4]
    for i in range(9):
        anc = {0} | {r + 1 for r in _path_of(BRANCHY_PARENTS, i - 1)} if i else {0}
        assert m[i, :past].all()
        assert {r for r in range(9) if m[i, past + r]} == anc, i
    # a window of 3 positions: row 7 (node 6, depth 4, position past + 4) sees positions past + 2..4
    w = lay.mask(past, 3)
    assert not w[7, :past].any()
    assert {r for r in range(9) if w[7, past + r]} == {2, 5, 7}
    assert w[0, past - 2: past].all() and not w[0, : past - 2].any() and w[0, past]
    with pytest.raises(ValueError):
        TreeLayout([-1, 2, 0])


@pytest.mark.fast
def test_walk_accepts_the_target_path_and_stops_at_the_first_miss():
    tree = TokenTree(BRANCHY_TOKENS, BRANCHY_PARENTS)
    want = {0: 11, 1: 12, 2: 15, 5: 18}        # row -> the target's token after it
    path, bonus = walk(tree, lambda row, depth: want.get(row, 99))
    assert path == [0, 1, 4, 7] and bonus == 99
    path, bonus = walk(tree, lambda row, depth: {0: 14, 4: 16}.get(row, 17))
    assert path == [3, 5] and bonus == 17
    path, bonus = walk(tree, lambda row, depth: 42)
    assert path == [] and bonus == 42
    assert tree.first_path() == [0, 1, 4, 6]


# ----------------------------------------------------------------------------- bit for bit
@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_a_tree_row_equals_the_decode_step_bit_for_bit(kernel, arch):
    """Every node's logits equal its token's decode step after its ancestors, bit for bit, and the
    KV after keeping a path equals decoding that path one token at a time (Mistral: a window of 16
    positions, shorter than the context)."""
    lm = _coded(arch)
    m = lm.model
    ids = [(7 * i + 3) % 300 for i in range(40)]
    at = 30
    c = dec.DynamicCache()
    dec.prefill(m, ids[:at], c)
    rows = [-1] + [p + 1 for p in BRANCHY_PARENTS]
    with torch.inference_mode():
        tree_logits = dec.verify_tree(m, [ids[at]] + BRANCHY_TOKENS, rows, c)      # [9, V]
    for node in range(len(BRANCHY_TOKENS)):
        path = _path_of(BRANCHY_PARENTS, node)
        steps, _ = _decode_path(m, ids, at, [ids[at]] + [BRANCHY_TOKENS[j] for j in path])
        assert torch.equal(steps[0], tree_logits[0])
        assert torch.equal(steps[-1], tree_logits[node + 1]), node
    path = [0, 1, 4, 6]
    dec.keep_rows(c, at, [0] + [j + 1 for j in path])
    _, c2 = _decode_path(m, ids, at, [ids[at]] + [BRANCHY_TOKENS[j] for j in path])
    assert dec.cache_len(c) == at + 1 + len(path)
    for a, b in zip(c.layers, c2.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@needs_onednn
def test_without_own_attention_the_tree_mask_gives_the_decode_steps_logits(monkeypatch):
    """Torch's attention with the tree mask (no block kernel): each row as its decode step, up to
    rounding."""
    monkeypatch.setenv("RAKV_BLOCKQ", "0")
    lm = wrap_tiny(make_model("llama"), tiny_tokenizer(), name="tiny-llama-tree-sdpa")
    m = lm.model
    ids = [(5 * i + 2) % 300 for i in range(36)]
    c = dec.DynamicCache()
    dec.prefill(m, ids[:30], c)
    assert not blockq.attend_ok(c.layers[0].keys, c.layers[0].values, 9, 4, 2, 16, enabled=lm.backend.switches.blockq)
    rows = [-1] + [p + 1 for p in BRANCHY_PARENTS]
    tree_logits = dec.verify_tree(m, [ids[30]] + BRANCHY_TOKENS, rows, c)
    for node in range(len(BRANCHY_TOKENS)):
        path = _path_of(BRANCHY_PARENTS, node)
        steps, _ = _decode_path(m, ids, 30, [ids[30]] + [BRANCHY_TOKENS[j] for j in path])
        torch.testing.assert_close(steps[-1], tree_logits[node + 1], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the n-gram trees
def test_ngram_tree_groups_every_occurrence_by_shared_prefix_and_keeps_the_heaviest_nodes():
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 8, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    tree = ngram_tree(ids, 8, 4)
    # after "1 2 3": "4 5 7 1" (latest, also the longest matching context: weight 2), "4 6 8 1", "4 5 9 1"
    assert tree.tokens[0] == 4 and tree.parents[0] == -1                 # one shared first token
    assert [tree.tokens[i] for i in tree.first_path()] == [4, 5, 7, 1]   # the heaviest chain first
    kids = tree.children()
    assert sorted(tree.tokens[c] for c in kids[0]) == [5, 6]            # two branches after "4"
    assert len(tree) == 8
    for budget in range(1, 9):
        small = ngram_tree(ids, budget, 4)
        small.check()
        assert len(small) == budget and small.first_path()[0] == 0
    assert ngram_tree(ids, 8, 2).depths() and max(ngram_tree(ids, 8, 2).depths()) == 2
    assert len(ngram_tree([5, 6, 7], 8, 4)) == 0
    # a history of earlier requests adds their continuations
    h = TokenHistory(1000)
    h.add([2, 3, 42, 43])
    t2 = ngram_tree([9, 2, 3], 4, 3, history=h)
    assert t2.tokens[:2] == [42, 43]


@pytest.mark.fast
def test_tree_policy_parses():
    p = Policy.parse("tree:8")
    assert (p.tree, p.reuse, p.k) == (True, True, 8)
    for bad in ("tree:0", "tree:17", "tree:x"):
        with pytest.raises(ValueError):
            Policy.parse(bad)


# ----------------------------------------------------------------------------- the engine, exact
PROMPTS = [list(range(5, 45)), list(range(5, 45)), list(range(5, 35)) + [7, 8, 9], [3, 4, 5] * 6]
N_OUT = 20


class OracleTree:
    """A tree source that hides the target's true continuation among decoys: at every level the
    true token is the last child, after decoys, so accepting it needs the walk through branches.
    ``truth(seq)``: the target's tokens after ``seq`` (the reference's)."""

    def __init__(self, truth, lie_at: int | None = None):
        self.truth, self.lie_at = truth, lie_at
        self.sizes = (3, 2)

    def begin(self, *a):
        pass

    def end(self):
        pass

    def propose_tree(self, seq, budget, depth):
        true = self.truth(seq)[:depth]
        if self.lie_at is not None and len(true) > self.lie_at:
            true = true[: self.lie_at] + [(true[self.lie_at] + 1) % 300]
        tree, at = TokenTree(), -1
        for tok in true:
            if len(tree) + 2 > budget:
                break
            tree.tokens += [(tok + 7) % 300, tok]                  # a decoy, then the true token
            tree.parents += [at, at]
            at = len(tree) - 1
            if len(tree) < budget:                                  # the decoy's own child
                tree.tokens.append(tok)
                tree.parents.append(at - 1)
        if not tree.tokens and true and budget >= 1:
            tree.tokens, tree.parents = [true[0]], [-1]
        while len(tree) < budget:                                   # more decoys at the root
            tok = (len(tree) * 13 + 1) % 300
            if not true or tok != true[0]:
                tree.tokens.append(tok)
                tree.parents.append(-1)
            else:
                budget -= 1
        tree.check()
        return tree, 0.0


def _greedy_truth(target, prompt):
    full = prompt + oracle(target, prompt, N_OUT)
    return lambda seq: full[len(seq):] if seq == full[: len(seq)] else []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_node_count_is_exact_with_the_ngram_tree(arch):
    """tree:1 .. tree:16 with the n-gram source: a miss, an exact repeat (the history's earlier
    output proposed and accepted), a partial hit, a repetitive prompt."""
    target, _ = make_pair(arch)
    for n in range(1, 17):
        rounds = []
        eng = Engine(target, NgramDraft(), RakvConfig(policy=f"tree:{n}"), callback=rounds.append)
        for p in PROMPTS:
            assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, (arch, n))
        trees = [r for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
        assert trees and all(len(r.tree_tokens) <= n and r.tree_verify == "tree" for r in trees)
        assert sum(r.accepted for r in trees) > 0, n                  # the exact repeat at least


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_walk_finds_the_true_path_among_branches(arch):
    """Trees whose true continuation is never the first child: accepted through the branches, and
    a wrong token inside the path stops the walk there; the output is target-only decoding's."""
    target, _ = make_pair(arch)
    for lie_at in (None, 2):
        for n in (2, 5, 9, 16):
            rounds = []
            eng = Engine(target, NgramDraft(), RakvConfig(policy=f"tree:{n}"), callback=rounds.append)
            for p in PROMPTS[2:]:
                eng.planner.lookup = OracleTree(_greedy_truth(target, p), lie_at)
                assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, (arch, n, lie_at))
            acc = [r.accepted for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
            assert max(acc) >= (1 if n < 5 else 2), (n, acc)
            if lie_at is not None:
                assert max(acc) <= lie_at


def test_eos_inside_the_accepted_path_ends_the_output_there():
    target, _ = make_pair("llama", eos="emitted")
    eos = next(iter(target.eos_ids))
    p = EOS_PROMPTS[0]
    want = oracle(target, p, EOS_N)
    assert want[-1] == eos
    cuts = []
    for n in (4, 8, 12, 16):
        rounds = []
        eng = Engine(target, NgramDraft(), RakvConfig(policy=f"tree:{n}"), callback=rounds.append)

        def truth(seq, full=p + want + [5, 6, 7, 8, 9, 10]):          # the path goes on past the EOS
            return full[len(seq):] if seq == full[: len(seq)] else []
        eng.planner.lookup = OracleTree(truth)
        end = eng.generate(p, EOS_N)
        assert (end.output_ids, end.stopped) == (want, "eos"), n
        last = [r for r in rounds if getattr(r, "type", "") == "round"][-1]
        path_tokens = [last.tree_tokens[i] for i in last.tree_path]
        cuts.append(eos in path_tokens and last.emitted[-1] == eos)     # EOS inside the accepted path
        for q in EOS_PROMPTS[1:]:
            eng.planner.lookup = NgramDraft()
            assert_exact(eng.generate(q, EOS_N), target, q, EOS_N, n)
    assert any(cuts), cuts


SETTINGS = [Sampling(temperature=0.7, seed=3), Sampling(temperature=1.0, seed=11, top_k=40),
            Sampling(temperature=1.3, seed=123, top_p=0.9)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.key())
def test_seeded_sampling_with_trees_gives_target_only_samples(arch, s):
    target, _ = make_pair(arch)
    eos = set(target.eos_ids)
    from tests.tiny import reference_model
    ref = reference_model(target)
    for n in (3, 8, 16):
        rounds = []
        eng = Engine(target, NgramDraft(), RakvConfig(policy=f"tree:{n}", sampling=s), callback=rounds.append)
        for i, p in enumerate(PROMPTS):
            want = sampled_reference(ref, p, N_OUT, s.for_request(i), eos)
            full = p + want

            def truth(seq, full=full):
                return full[len(seq):] if seq == full[: len(seq)] else []
            eng.planner.lookup = OracleTree(truth) if i % 2 else NgramDraft()
            assert eng.generate(p, N_OUT).output_ids == want, (n, i)
        assert any(r.accepted for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("s", [Sampling(), SETTINGS[0]], ids=lambda s: s.key())
def test_the_kv_after_a_tree_round_is_the_kv_of_decoding_the_accepted_path(kernel, arch, s):
    """A tree round (its true path hidden behind decoys) leaves exactly the cache that decoding the
    accepted path one token at a time leaves, bit for bit, and emits what those steps give."""
    lm = _coded(arch)
    m = lm.model
    ids = [(11 * i + 5) % 300 for i in range(34)]
    at = 30
    c = dec.DynamicCache()
    dec.prefill(m, ids[:at], c)
    logits, truth = dec.forward(m, ids[at:at + 1], c)[-1], []
    for j in range(6):                    # the target's own continuation, one decode step at a time
        tok = int(logits.argmax()) if s.greedy else S.sample(logits, s, j)
        truth.append(tok)
        logits = dec.forward(m, [tok], c)[-1]
    src = OracleTree(lambda seq: truth)
    tree, _ = src.propose_tree(ids[:at + 1], 16, 6)
    c = dec.DynamicCache()
    dec.prefill(m, ids[:at], c)
    emitted, path, how = verify_tree(m, c, ids[at], tree, s, 0)
    assert how == "tree" and len(path) >= 3 and emitted == truth[: len(path) + 1]
    _, c2 = _decode_path(m, ids, at, [ids[at]] + [tree.tokens[i] for i in path])
    assert dec.cache_len(c) == dec.cache_len(c2) == at + 1 + len(path)
    for a, b in zip(c.layers, c2.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_hf_forward_verifies_the_first_path_as_a_chain():
    target, _ = make_pair("llama", forward="hf")
    assert not dec.tree_forward_ok(target.model)
    rounds = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="tree:8"), callback=rounds.append)
    for p in PROMPTS:
        assert_exact(eng.generate(p, N_OUT), target, p, N_OUT)
    trees = [r for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
    assert trees and {r.tree_verify for r in trees} == {"chain"} and sum(r.accepted for r in trees) > 0


def test_cli_generate_with_a_tree_policy(tmp_path, capsys):
    from rakv.cli import main
    from rakv.records import read_recording

    t = save_tiny(tmp_path / "target", "llama")
    rec = tmp_path / "run.jsonl"
    prompt = "alpha beta gamma delta alpha beta gamma"
    for _ in range(2):
        code = main(["generate", "--target", str(tmp_path / "target"), "--draft", "ngram", "--policy", "tree:8",
                     "--prompt", prompt, "--prompt", prompt, "--max-new-tokens", "10", "--json", "--raw",
                     "--record", str(rec)])
        out, err = capsys.readouterr()
        assert code == 0, err
    ids = tiny_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
    outs = [json.loads(x) for x in out.splitlines()]
    assert [o["output_ids"] for o in outs] == [oracle(t, ids, 10)] * 2
    rounds = [r for r in read_recording(rec) if r.type == "round" and r.tree_tokens]
    assert rounds and all(len(r.tree_parents) == len(r.tree_tokens) for r in rounds)


def test_bench_runs_a_tree_arm_without_mismatches(tmp_path):
    import csv

    from rakv.cli import main

    out = tmp_path / "b"
    rc = main(["bench", "--tiny", "--workload", "repetitive", "--draft", "ngram", "--policies", "joint:4", "tree:8",
               "--out", str(out), "--repeats", "1", "--n-prompts", "4"])
    assert rc == 0
    with open(out / "executions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert "tree:8" in {r["policy"] for r in rows}
    assert all(r["match"] == "1" for r in rows)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_trees_are_exact_with_sliding_windows_and_biases(arch):
    """Mistral's window (16 positions, shorter than the prompts) and Qwen2's q / k / v biases."""
    target, _ = make_pair(arch)
    rounds = []
    eng = Engine(target, NgramDraft(), RakvConfig(policy="tree:8"), callback=rounds.append)
    for p in PROMPTS:
        assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, arch)
    for p in PROMPTS[2:]:
        eng.planner.lookup = OracleTree(_greedy_truth(target, p))
        assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, arch)
    trees = [r for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
    assert {r.tree_verify for r in trees} == {"tree"} and max(r.accepted for r in trees) >= 2


def test_trees_are_exact_on_torch_attention_with_the_tree_mask(monkeypatch):
    """Without the block kernel (RAKV_BLOCKQ=0) the lean forward runs torch's attention with the
    tree mask: still target-only decoding's tokens."""
    monkeypatch.setenv("RAKV_BLOCKQ", "0")
    for arch in ("llama", "gpt2"):
        target, _ = make_pair(arch)
        rounds = []
        eng = Engine(target, NgramDraft(), RakvConfig(policy="tree:12"), callback=rounds.append)
        for p in PROMPTS:
            assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, arch)
        for p in PROMPTS[2:]:
            eng.planner.lookup = OracleTree(_greedy_truth(target, p))
            assert_exact(eng.generate(p, N_OUT), target, p, N_OUT, arch)
        trees = [r for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
        assert {r.tree_verify for r in trees} == {"tree"} and max(r.accepted for r in trees) >= 2


# ----------------------------------------------------------------------------- trees priced by measured cost
def test_priced_keeps_the_likeliest_nodes_while_they_pay():
    from rakv.decoding.tree import priced, reach

    tree = TokenTree([1, 2, 3, 4], [-1, 0, -1, 1], conf=[0.9, 0.8, 0.1, 0.5])
    r = reach(tree, lambda c: c)
    assert r == pytest.approx([0.9, 0.72, 0.1, 0.36])
    flat = [1.0, 1.0, 1.0, 1.0, 1.0]                 # verify as cheap as a step: every node pays
    sub, E, V = priced(tree, lambda c: c, flat)
    assert len(sub) == 4 and E == pytest.approx(2.08)
    steep = [1.0, 1.5, 2.5, 3.5, 4.5]                # only the first node pays: (1 + 0.9) / 1.5 the best
    sub, E, V = priced(tree, lambda c: c, steep)
    assert (sub.tokens, sub.parents, V) == ([1], [-1], 1.5)
    sub, E, V = priced(tree, lambda c: c, [1.0, 4.0, 4.0, 4.0, 4.0])    # nothing pays: a plain step
    assert len(sub) == 0 and (E, V) == (0.0, 1.0)
    sub, _, _ = priced(tree, lambda c: c, [1.0, 1.2, 1.4, 1.5, 9.0])     # the likeliest three
    assert sub.tokens == [1, 2, 4] and sub.parents == [-1, 0, 1]


class ConfidentOracle(OracleTree):
    """An oracle tree with the source's confidences adaptive:tree prices by: every proposal holds
    the true continuation, so a round always has a tree to price, whatever the sampled text repeats."""

    def propose_tree(self, seq, budget, depth):
        tree, ms = super().propose_tree(seq, budget, depth)
        true = self.truth(seq)
        tree.conf = [0.9 if true and t == true[0] else 0.3 for t in tree.tokens]
        return tree, ms


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("s", [Sampling(), SETTINGS[0]], ids=lambda s: s.key())
def test_adaptive_tree_is_exact_and_prices_each_round(arch, s):
    """adaptive:tree with the n-gram source (exact whatever it finds), then with a source that always
    proposes (every round priced: verified where a verify is nearly as cheap as a step, a plain step
    where it is steep). The n-gram source alone need not propose at all: whether a tiny random model's
    sampled text repeats itself is chance."""
    from tests.tiny import reference_model, synthetic_profile

    target, _ = make_pair(arch)
    ref, eos = reference_model(target), set(target.eos_ids)
    for V, pays in (({str(k): 1.0 + 0.02 * k for k in range(1, 17)}, True),
                    ({str(k): 1.0 + 2.0 * k for k in range(1, 17)}, False)):
        for source in ("ngram", "oracle"):
            rounds = []
            eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:tree", sampling=s),
                         profile=synthetic_profile(V=V), callback=rounds.append)
            for i, p in enumerate(PROMPTS):
                want = (oracle(target, p, N_OUT) if s.greedy
                        else sampled_reference(ref, p, N_OUT, s.for_request(i), eos))
                full = p + want
                if source == "oracle":
                    eng.planner.lookup = ConfidentOracle(
                        lambda seq, full=full: full[len(seq):] if seq == full[: len(seq)] else [])
                assert eng.generate(p, N_OUT).output_ids == want, (source, i)
            if source == "ngram":
                continue
            spec = [r for r in rounds if getattr(r, "type", "") == "round" and r.index > 0
                    and r.context - len(PROMPTS[r.request_id]) < N_OUT - 1]    # > 1 token left: a tree
            priced_rounds = [r for r in spec if r.tree_expected is not None]
            assert priced_rounds and len(priced_rounds) == len(spec)
            verified = [r for r in priced_rounds if r.tree_tokens]
            if pays:
                assert verified and any(r.accepted for r in verified)
            else:                                         # a steep verify: every round a plain step
                assert not verified and all(r.tree_predicted_ms == 1.0 for r in priced_rounds)


def test_adaptive_tree_on_hf_forward_learns_only_from_the_chain_it_verified():
    from tests.tiny import synthetic_profile

    target, _ = make_pair("llama", forward="hf")
    eng = Engine(target, NgramDraft(), RakvConfig(policy="adaptive:tree"), profile=synthetic_profile(
        V={str(k): 1.0 + 0.02 * k for k in range(1, 17)}))
    trials = []
    real = eng.tree_map.observe
    eng.tree_map.observe = lambda c, p, a: trials.append(a) or real(c, p, a)
    rounds = []
    eng.callback = rounds.append
    for p in PROMPTS:
        assert_exact(eng.generate(p, N_OUT), target, p, N_OUT)
    chains = [r for r in rounds if getattr(r, "type", "") == "round" and r.tree_tokens]
    assert chains and {r.tree_verify for r in chains} == {"chain"}
    # one trial per accepted node plus at most one rejected: never a sibling the chain did not judge
    assert len(trials) <= sum(r.accepted + 1 for r in chains)


def test_context_match_is_the_latest_earlier_occurrence():
    """ngram's in-context lookup against a brute-force search, on random short-alphabet sequences
    (many repeats, overlaps, a match running into the present)."""
    import random

    from rakv.drafts.ngram import MAX_MATCH, context_match, periodic

    def brute(ids, k, sizes):
        L = len(ids)
        for n in sizes:
            if L <= n:
                continue
            pat = ids[L - n:]
            for i in range(L - n - 1, -1, -1):
                if ids[i:i + n] == pat:
                    j, m = i + n, n
                    while m < MAX_MATCH and j - m - 1 >= 0 and ids[j - m - 1] == ids[L - m - 1]:
                        m += 1
                    return periodic(ids[j:L], k), m
        return [], 0

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.choice((2, 4, 30))) for _ in range(rng.randrange(0, 60))]
        for sizes in ((3, 2), (2,), (4, 3, 2)):
            assert context_match(ids, 5, sizes) == brute(ids, 5, sizes), (ids, sizes)
