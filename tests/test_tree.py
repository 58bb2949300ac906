"""Token trees: one forward verifies a tree of candidates; the output stays target-only decoding's.

On block-coded weights (the block kernel and its own tree attention) a tree row equals the same
token's decode step bit for bit, logits and KV; the KV after a tree round equals the KV of decoding
the accepted path one token at a time. The engine's ``tree:N`` policy is exact for every node
budget 1..16, greedy and seeded sampling, on GPT-2 and Llama, with EOS inside the accepted path,
partial hits and exact repeats; on HF's own forward it verifies the tree's first path as a chain.
"""

from __future__ import annotations

import pytest
import torch

from rakv import decoding as dec
from rakv.kernels import blockq
from rakv.kernels.lean import TreeLayout
from rakv.tree import TokenTree, walk

from .test_blockq import kernel, needs_onednn  # noqa: F401  (the kernel fixture)
from .tiny import make_model, snap_to_blocks, tiny_tokenizer, wrap_tiny

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
    assert not blockq.attend_ok(c.layers[0].keys, c.layers[0].values, 9, 4, 2, 16)
    rows = [-1] + [p + 1 for p in BRANCHY_PARENTS]
    tree_logits = dec.verify_tree(m, [ids[30]] + BRANCHY_TOKENS, rows, c)
    for node in range(len(BRANCHY_TOKENS)):
        path = _path_of(BRANCHY_PARENTS, node)
        steps, _ = _decode_path(m, ids, 30, [ids[30]] + [BRANCHY_TOKENS[j] for j in path])
        torch.testing.assert_close(steps[-1], tree_logits[node + 1], rtol=1e-4, atol=1e-4)
