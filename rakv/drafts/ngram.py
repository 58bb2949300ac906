"""``--draft ngram``: prompt lookup. Propose what followed the latest earlier occurrence of the last
n tokens (in the request's own ids, and with reuse in earlier requests' outputs); no model at all,
and a token tree of every earlier continuation (``ngram_tree``)."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from ..prefix_cache import TokenHistory
from ..decoding.tree import TokenTree
from .base import DraftSource, Proposal, now


class NgramDraft(DraftSource):
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens."""

    name = "ngram"
    key = "ngram"
    copies = True

    def __init__(self, sizes: tuple[int, ...] = (3, 2)):
        self.sizes = tuple(sizes)
        self.history: TokenHistory | None = None     # earlier requests' tokens, while a request with r = 1 runs

    def begin(self, prompt_ids, store, reuse):
        """Reuse (r = 1) also looks up what earlier requests of this store generated."""
        self.history = store.history if (store is not None and reuse and len(store.history)) else None

    def fork(self) -> "NgramDraft":
        return NgramDraft(self.sizes)

    def end(self) -> None:
        self.history = None

    def match(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """(up to k copied tokens after ``ids``, the match length): the lookup alone, no gate."""
        return ngram_match(ids, k, self.sizes, self.history)

    def propose(self, ids: list[int], k: int, gate=None, match=None) -> Proposal:
        t0 = now()
        toks, m = match if match is not None else ngram_match(ids, k, self.sizes, self.history)
        if gate is not None and toks:
            # token n is judged after n-1 accepted copies: its match is then m + n - 1 tokens long
            n = 1
            while n < len(toks) and gate.keep_going(ngram_confidence(m + n - 1)):
                n += 1
            if n == len(toks) and len(gate.confs) < n:
                gate.keep_going(ngram_confidence(m + n - 1))    # the last token's confidence (the source ran out)
            toks = toks[:n]
        return Proposal(toks, ms=(now() - t0) * 1e3)

    def propose_tree(self, ids: list[int], budget: int, depth: int) -> tuple[TokenTree, float]:
        """(a token tree of at most ``budget`` nodes and ``depth`` levels after ``ids``: every earlier
        occurrence's continuation, grouped by shared prefix; the ms it took)."""
        t0 = now()
        tree = ngram_tree(ids, budget, depth, self.sizes, self.history)
        return tree, (now() - t0) * 1e3


def make(target, config, arg: str = "") -> NgramDraft:
    """The registry's ``ngram``: the n-gram sizes of ``config`` (``RakvConfig.ngram_sizes``)."""
    return NgramDraft(config.ngram_sizes)


def ngram_confidence(match_len: int) -> float:
    """A copy is likelier to continue the longer the context it matched (calibrated online)."""
    return match_len / (match_len + 2.0)


MAX_MATCH = 32


def ngram_lookup(ids, k: int, sizes=(3, 2)) -> list[int]:
    return ngram_match(ids, k, sizes)[0]


def periodic(follow: list[int], k: int) -> list[int]:
    """k tokens of a copy whose source runs into the present: past the end it copies its own
    copy (a match p tokens back predicts a period of p), so a short recent match still proposes k."""
    if len(follow) >= k or not follow:
        return follow[:k]
    return [follow[j % len(follow)] for j in range(k)]


def ngram_match(ids, k: int, sizes=(3, 2), history: TokenHistory | None = None) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier occurrence of the last n tokens, and the
    length of the match, extended backwards up to MAX_MATCH tokens). With a ``history``, an
    earlier request's continuation is taken instead where it matches a longer context."""
    if k <= 0:
        return [], 0
    toks, m = context_match(ids, k, sizes)
    if history is not None and len(history):
        h_toks, h_m = history_match_indexed(ids, k, sizes, history)
        if h_m > m:
            return h_toks, h_m
    return toks, m


HISTORY_CANDIDATES = 256    # the latest occurrences of an n-gram in the history whose context is compared


def history_match(ids, k: int, sizes, h: np.ndarray) -> tuple[list[int], int]:
    """Up to k tokens that followed, in earlier requests (``h``: sequences separated by -1), the
    occurrence of the last n tokens with the longest matching context (the latest among equals)."""
    a = np.asarray(ids[-MAX_MATCH:], dtype=np.int64)
    L, H = len(a), len(h)
    for n in sizes:
        if L < n or H <= n:
            continue
        pat = a[L - n:]
        ends = np.flatnonzero(h[: H - n] == pat[0])          # ends: the first token after the n-gram
        for j in range(1, n):
            ends = ends[h[ends + j] == pat[j]]
        ends = ends + n
        ends = ends[h[ends] != -1][-HISTORY_CANDIDATES:]       # something follows in the same sequence
        if not ends.size:
            continue
        back = np.arange(L)                                   # compare a[L-1-j] with h[end-1-j]
        idx = ends[:, None] - 1 - back[None, :]
        ok = (idx >= 0) & (h[np.maximum(idx, 0)] == a[L - 1 - back][None, :])
        m = np.cumprod(ok, axis=1).sum(axis=1)
        best = len(m) - 1 - int(np.argmax(m[::-1]))
        follow = h[ends[best]: ends[best] + k]
        sep = np.flatnonzero(follow == -1)
        return (follow[: sep[0]] if sep.size else follow).tolist(), int(m[best])
    return [], 0


PY_CANDIDATES = 32         # up to this many occurrences, their contexts are compared in plain Python


def history_match_indexed(ids, k: int, sizes, history: TokenHistory) -> tuple[list[int], int]:
    """``history_match`` through the history's n-gram index: the same tokens and match length,
    without numpy when few occurrences are compared (most rounds)."""
    ix = history.grams()
    seq, base = ix.seq, ix.base
    a = list(ids[-MAX_MATCH:])
    L, H = len(a), len(seq)
    for n in sizes:
        if L < n or H <= n:
            continue
        ends = ix.table(n).get(tuple(a[L - n:]))
        if not ends:
            continue
        lo = max(bisect_left(ends, base + n), len(ends) - HISTORY_CANDIDATES)   # live, the latest
        if lo >= len(ends):
            continue
        if len(ends) - lo > PY_CANDIDATES:
            return history_match(ids, k, sizes, history.tokens)
        best_m, best = -1, 0
        for e in ends[lo:]:
            p, m = e - base - 1, 0
            while m < L and p - m >= 0 and seq[p - m] == a[L - 1 - m]:
                m += 1
            if m >= best_m:                       # the latest among equals
                best_m, best = m, e - base
        follow = seq[best: best + k]
        if -1 in follow:
            follow = follow[: follow.index(-1)]
        return follow, best_m
    return [], 0


def context_match(ids, k: int, sizes=(3, 2)) -> tuple[list[int], int]:
    """ngram_match within ``ids`` alone (prompt lookup). Plain list work, no numpy: the earlier
    positions of the last token come latest first from ``list.index`` on the reversed sequence
    (a round's first numpy call after a forward costs tens of microseconds on a cold core)."""
    a = ids if isinstance(ids, list) else [int(x) for x in ids]
    L = len(a)
    if L < 2:
        return [], 0
    r = a[::-1]                                           # r[j] = a[L - 1 - j]
    last = r[0]
    for n in sizes:
        if L <= n:
            continue
        tail = r[1:n]                                     # the n-gram's tokens before the last, backwards
        j = 0
        while True:
            try:
                j = r.index(last, j + 1)                  # an earlier occurrence of the last token, latest first
            except ValueError:
                break
            e = L - 1 - j                                 # where the candidate n-gram ends
            if e < n - 1:
                break
            if r[j + 1: j + n] == tail:
                i = e + 1                                 # what followed it
                m = n
                while m < MAX_MATCH and i - m - 1 >= 0 and a[i - m - 1] == a[L - m - 1]:
                    m += 1
                return periodic(a[i:L], k), m
    return [], 0


TREE_OCCURRENCES = 64       # the latest occurrences of the suffix (prompt and output) a tree groups


def occurrences(ids, depth: int, sizes=(3, 2), history: TokenHistory | None = None) -> list[list[int]]:
    """The continuations (up to ``depth`` tokens) of every earlier occurrence of the last n tokens
    of ``ids`` (the longest n of ``sizes`` that occurs), latest first: in ``ids`` itself (one that
    runs into the present repeats with its period) and in the history of earlier requests."""
    a = np.asarray(ids, dtype=np.int64)
    L = len(a)
    h = history.tokens if history is not None and len(history) else None
    for n in sizes:
        if L <= n:
            continue
        pat = a[L - n:]
        out: list[list[int]] = []
        win = np.lib.stride_tricks.sliding_window_view(a[: L - 1], n) if L - 1 >= n else None
        if win is not None:
            starts = np.flatnonzero((win == pat).all(axis=1))
            for i in starts[starts < L - n][::-1][:TREE_OCCURRENCES]:
                out.append(periodic(a[i + n: L].tolist(), depth))
        if h is not None and len(h) > n:
            ends = np.flatnonzero(h[: len(h) - n] == pat[0])
            for j in range(1, n):
                ends = ends[h[ends + j] == pat[j]]
            ends = ends + n
            for e in ends[h[ends] != -1][::-1][:TREE_OCCURRENCES]:
                follow = h[e: e + depth]
                sep = np.flatnonzero(follow == -1)
                out.append((follow[: sep[0]] if sep.size else follow).tolist())
        out = [c for c in out if c]
        if out:
            return out
    return []


def ngram_tree(ids, budget: int, depth: int, sizes=(3, 2), history: TokenHistory | None = None) -> TokenTree:
    """The n-gram source's token tree: the continuations of every earlier occurrence of the current
    suffix in a trie (a shared prefix is one branch), each node weighted by how many continuations
    pass through it, plus one for the chain ``ngram_match`` proposes (the longest matching context);
    the ``budget`` heaviest nodes (a node never outweighs its parent, so they form a tree), children
    heaviest first (the first path is the likeliest chain); each node's ``conf`` is its share of
    its parent's weight (a root child's: of all continuations)."""
    depth = min(depth, budget)
    if budget <= 0 or depth <= 0:
        return TokenTree()
    conts = occurrences(ids, depth, sizes, history)
    best = ngram_match(ids, depth, sizes, history)[0]
    if best:
        conts.append(best)
    total = len(conts)
    token, parent, weight, kids = [], [], [], {}     # the trie; kids: (parent, token) -> node
    for cont in conts:
        at = -1
        for tok in cont[:depth]:
            node = kids.get((at, tok))
            if node is None:
                node = kids[(at, tok)] = len(token)
                token.append(int(tok))
                parent.append(at)
                weight.append(0)
            weight[node] += 1
            at = node
    keep = set(sorted(range(len(token)), key=lambda i: (-weight[i], i))[:budget])    # i: parents first
    children: dict[int, list[int]] = {}
    for i in sorted(keep):
        children.setdefault(parent[i], []).append(i)
    tree = TokenTree()

    def add(node: int, at: int) -> None:           # preorder, heaviest child first
        for c in sorted(children.get(node, []), key=lambda i: (-weight[i], i)):
            tree.tokens.append(token[c])
            tree.parents.append(at)
            tree.conf.append(weight[c] / (weight[node] if node >= 0 else total))  # the share of its parent's
            add(c, len(tree.tokens) - 1)

    add(-1, -1)
    return tree
