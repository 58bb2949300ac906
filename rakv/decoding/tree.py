"""Token trees: verify several candidate continuations in one target forward, accept the longest
path the target would have produced, keep exactly that path's KV.

A tree holds proposed tokens, each with a parent: -1 for a child of the pending token (the last
committed token, emitted but not yet fed), else an earlier node's index, so parents come before
their children. The verify forward feeds the pending token as row 0 and node i as row i + 1, each
row at position past + depth (the pending token's depth is 0) and seeing the committed tokens, its
ancestors and itself (``rakv.kernels.lean.TreeLayout``). On the lean forward with the block
kernel's own attention a row equals the same token's decode step bit for bit.

Acceptance walks from the root: the target's token at an accepted row (its argmax, or its seeded
sample at that output position) is accepted when a child carries it, and the walk goes on from
that child; else the target's token there is the round's bonus token. So the emitted tokens are
target-only decoding's, greedy or seeded. The accepted rows' KV is moved to consecutive positions
and the rest dropped: the cache then equals that of decoding the accepted path one token at a time.

Where no tree forward exists (HF's forward, a model off the CPU) or verification is by rejection
sampling, the round verifies the tree's first path (each node's first child: the heaviest
continuation) as an ordinary chain, exact in the same way chains are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import decoding as dec
from . import sampling as S
from ..config import Sampling


@dataclass
class TokenTree:
    """Proposed tokens with parents (-1: a child of the pending token); children in preference
    order (a node's first child is its likeliest continuation)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)     # the source's chance of a node given its parent (optional)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self) -> list[int]:
        """The verify rows' parents: row 0 the pending token (-1), row i + 1 node i."""
        return [-1] + [p + 1 for p in self.parents]

    def depths(self) -> list[int]:
        """Node i's depth (a child of the pending token: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self) -> dict[int, list[int]]:
        """{node or -1: its children's node indices, in order}."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out

    def first_path(self) -> list[int]:
        """The nodes of the chain that follows each node's first child from the root."""
        kids, path, at = self.children(), [], -1
        while kids.get(at):
            at = kids[at][0]
            path.append(at)
        return path

    def subtree(self, keep) -> "TokenTree":
        """The nodes in ``keep`` (closed under parents), in their order, parents renumbered."""
        new: dict[int, int] = {-1: -1}
        out = TokenTree()
        for i in sorted(keep):
            new[i] = len(out.tokens)
            out.tokens.append(self.tokens[i])
            out.parents.append(new[self.parents[i]])
            if self.conf:
                out.conf.append(self.conf[i])
        return out

    def check(self) -> None:
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"tree node {i}: parent {p} must be -1 or an earlier node")
        if len(self.parents) != len(self.tokens):
            raise ValueError("a tree needs one parent per token")


def reach(tree: TokenTree, p) -> list[float]:
    """Each node's chance of being accepted: the product of p(conf) over it and its ancestors
    (``p``: a node's chance of acceptance given its parent was, from its confidence)."""
    r: list[float] = []
    for i, par in enumerate(tree.parents):
        r.append(p(tree.conf[i]) * (1.0 if par < 0 else r[par]))
    return r


def priced(tree: TokenTree, p, V: list[float]) -> tuple[TokenTree, float, float]:
    """The subtree with the most expected tokens per ms: its n likeliest nodes (likelier nodes
    first, a parent before its children) for the n that maximizes (1 + E(n)) / V(n), E(n) the sum
    of their chances of acceptance and V(n) the measured cost of verifying n tokens after the
    pending one (V[0]: a plain step). Returns (the subtree, E(n), V(n))."""
    r = reach(tree, p)
    order = sorted(range(len(tree)), key=lambda i: (-r[i], i))[: len(V) - 1]
    best, best_n, E, best_E = 1.0 / V[0], 0, 0.0, 0.0
    for n, i in enumerate(order, start=1):
        E += r[i]
        if (1.0 + E) / V[n] > best:
            best, best_n, best_E = (1.0 + E) / V[n], n, E
    return tree.subtree(order[:best_n]), best_E, V[best_n]


def walk(tree: TokenTree, target_at) -> tuple[list[int], int]:
    """(the accepted nodes, root first; the bonus token): from the root, accept the child that
    carries ``target_at(row, depth)`` (the target's token after that row), until none does."""
    kids = tree.children()
    at, depth, path = -1, 0, []
    while True:
        tok = target_at(at + 1, depth)
        nxt = next((c for c in kids.get(at, []) if tree.tokens[c] == tok), None)
        if nxt is None:
            return path, tok
        path.append(nxt)
        at, depth = nxt, depth + 1


def target_tokens(logits, s: Sampling | None, position: int):
    """(row, depth) -> the target's token after that row: its argmax, or its seeded sample at
    output position ``position + depth`` (``position``: the output position after the pending token)."""
    if s is None or s.greedy:
        pred = S.first_max(logits)
        return lambda row, depth: pred[row]
    return lambda row, depth: S.sample(logits[row], s, position + depth)


def verify_tree(model, cache, pending: int, tree: TokenTree, s: Sampling | None = None,
                position: int = 0) -> tuple[list[int], list[int], str]:
    """Verify [pending] + the tree in one forward; (emitted tokens, accepted nodes, how: "tree" or
    "chain"). The cache keeps the pending token's and the accepted nodes' KV, in order."""
    tree.check()
    if not tree.tokens:
        raise ValueError("an empty tree: a plain step")
    past = dec.cache_len(cache)
    logits = None
    if s is None or s.greedy or s.verify == "seeded":
        logits = dec.verify_tree(model, [pending] + tree.tokens, tree.rows(), cache)    # [n + 1, V]
    if logits is None:
        return _verify_chain(model, cache, pending, tree, s, position)
    path, bonus = walk(tree, target_tokens(logits, s, position))
    dec.keep_rows(cache, past, [0] + [i + 1 for i in path])
    return [tree.tokens[i] for i in path] + [bonus], path, "tree"


def _verify_chain(model, cache, pending, tree, s, position) -> tuple[list[int], list[int], str]:
    """The tree's first path verified as a chain (no tree forward, or rejection verification)."""
    chain = tree.first_path()
    drafts = [tree.tokens[i] for i in chain]
    emitted, a = dec.verify_accept(model, cache, pending, drafts, s, position)
    return emitted, chain[:a], "chain"
