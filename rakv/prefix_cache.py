"""Cross-request prefix KV cache with the paper's rules.

* Bucket: BLAKE2b (12-byte digest) over the first 16 token ids (int32 little-endian bytes),
  namespaced by the model key, so target and draft entries live side by side.
* Short-prompt rule: a prompt with fewer than 16 tokens is bucketed by the digest of *all* its
  tokens. It can therefore only meet entries with exactly those first tokens that are themselves
  that short: short prompts reuse on exact repeat only (documented, tested).
* Validation: exact longest common prefix (LCP) of token ids inside the bucket.
* A partial hit of q tokens hands out a copy of the first q-1 positions; the caller recomputes
  from the boundary token (so the next-token logits are fresh). An exact repeat hands out all P
  positions plus the stored next-token logits: no forward pass at all.
* Bytes are counted for real (K, V and logits tensors) against a budget (default 512 MiB) with
  LRU eviction; an entry larger than the budget is not stored; the budget is never exceeded.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from .config import HISTORY_TOKENS

BUCKET_TOKENS = 16
DIGEST_BYTES = 12

KV = list[tuple[torch.Tensor, torch.Tensor]]   # per layer: K, V of shape [1, heads, n, head_dim]


def bucket_digest(ids, n: int = BUCKET_TOKENS) -> bytes:
    """BLAKE2b-96 of the first ``n`` token ids (all of them if the prompt is shorter)."""
    head = np.asarray(ids[:n], dtype="<i4")
    return hashlib.blake2b(head.tobytes(), digest_size=DIGEST_BYTES).digest()


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(eq=False)
class Entry:
    key: str
    ids: np.ndarray              # [P] int32 prompt ids
    kv: KV                       # per layer (K, V) of P positions
    logits: torch.Tensor | None  # [V] next-token logits after the prompt
    nbytes: int
    bucket: bytes
    hits: int = 0


@dataclass
class Hit:
    """What a lookup found. ``q`` is the LCP length; ``usable`` positions can be cloned."""

    q: int = 0
    exact: bool = False
    entry: Entry | None = None
    bucket: str = ""

    @property
    def usable(self) -> int:
        """Positions the caller may clone: all P on exact repeat, else q-1 (boundary recomputed)."""
        if self.entry is None or self.q == 0:
            return 0
        return self.q if self.exact else self.q - 1


@dataclass
class CacheStats:
    bytes_used: int = 0
    budget: int = 0
    entries: int = 0
    evictions: int = 0
    lookups: int = 0
    hits: int = 0
    stores: int = 0
    rejected: int = 0   # entries larger than the budget


@dataclass
class CacheSnapshot:
    budget: int
    buckets: dict
    lru: OrderedDict
    mats: dict
    hits: dict
    stats: CacheStats
    history: np.ndarray | None = None


class TokenHistory:
    """Earlier requests' tokens (prompt + output), oldest first, for n-gram lookup across requests
    (a repeated or related request copies what an earlier one generated): one flat array with -1
    between sequences (never a token id), the oldest sequences dropped past ``max_tokens``.
    The array is replaced, never written in place, so a snapshot can share it. ``grams()`` is an
    index of its n-grams kept up to date as sequences are added (a lookup without numpy)."""

    def __init__(self, max_tokens: int = HISTORY_TOKENS):
        self.max_tokens = max(0, int(max_tokens))
        self.tokens = np.empty(0, dtype=np.int64)
        self._ix: GramIndex | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, ids) -> None:
        a = np.asarray(ids, dtype=np.int64)
        if self.max_tokens <= 0 or len(a) == 0:
            return
        a = a[-(self.max_tokens - 1):]
        t = np.concatenate([self.tokens, np.array([-1], dtype=np.int64), a])
        whole = len(t)
        if len(t) > self.max_tokens:
            t = t[len(t) - self.max_tokens:]
            seps = np.flatnonzero(t == -1)
            t = t[seps[0]:] if seps.size else t      # drop the cut sequence's remains
        ix = self._ix
        if ix is not None and ix.of is self.tokens:
            ix.advance(t, a.tolist(), whole - len(t))
        self.tokens = t

    def clear(self) -> None:
        self.tokens = np.empty(0, dtype=np.int64)

    def grams(self) -> "GramIndex":
        """The n-gram index of ``tokens`` as they are now (rebuilt after a ``clear`` or a restore)."""
        ix = self._ix
        if ix is None or ix.of is not self.tokens:
            ix = self._ix = GramIndex(self.tokens)
        return ix


class GramIndex:
    """Where each n-gram of a history occurs: n -> {gram: [end, ...]} with ``end`` the absolute
    position of the token that follows it (never a separator), ascending. Positions are absolute
    (``base`` is seq[0]'s), so dropping the oldest sequences only leaves stale ends at the front
    of each list; the tables are rebuilt once the stale ones outnumber the live tokens."""

    def __init__(self, tokens: np.ndarray):
        self.of = tokens                  # the array this indexes (TokenHistory replaces, never writes)
        self.seq: list[int] = tokens.tolist()
        self.base = 0
        self.stale = 0
        self._tables: dict[int, dict[tuple, list[int]]] = {}

    def table(self, n: int) -> dict[tuple, list[int]]:
        t = self._tables.get(n)
        if t is None:
            t = self._tables[n] = {}
            self._index(t, n, 0)
        return t

    def _index(self, t: dict, n: int, first: int) -> None:
        """Add the n-grams whose follower sits at seq[e], e >= first + n (none holds a separator)."""
        seq, base = self.seq, self.base
        for e in range(first + n, len(seq)):
            if seq[e] < 0:
                continue
            g = tuple(seq[e - n: e])
            if -1 in g:
                continue
            t.setdefault(g, []).append(base + e)

    def advance(self, tokens: np.ndarray, added: list[int], cut: int) -> None:
        """The history became ``tokens``: ``added`` after a separator, then ``cut`` oldest dropped."""
        first = len(self.seq) + 1                 # seq index of the added sequence's first token
        self.seq.append(-1)
        self.seq.extend(added)
        for n, t in self._tables.items():
            self._index(t, n, first)
        if cut:
            del self.seq[:cut]
            self.base += cut
            self.stale += cut
            if self.stale > len(self.seq):        # rebuild on next use
                self._tables.clear()
                self.stale = 0
        self.of = tokens


class PrefixCache:
    def __init__(self, budget_bytes: int, bucket_tokens: int = BUCKET_TOKENS, history_tokens: int = HISTORY_TOKENS):
        if budget_bytes < 0:
            raise ValueError("budget must be >= 0")
        self.budget = int(budget_bytes)
        self.history = TokenHistory(history_tokens)     # token ids only: not counted against the KV budget
        self.bucket_tokens = bucket_tokens
        self._buckets: dict[tuple[str, bytes], list[Entry]] = {}
        self._lru: OrderedDict[int, Entry] = OrderedDict()   # id(entry) -> entry, oldest first
        self._mats: dict[tuple[str, bytes], np.ndarray] = {}  # bucket -> padded ids matrix
        self.stats = CacheStats(budget=self.budget)

    # ------------------------------------------------------------------ queries
    @property
    def bytes_used(self) -> int:
        return self.stats.bytes_used

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self) -> list[Entry]:
        """Entries from least to most recently used."""
        return list(self._lru.values())

    def lookup(self, key: str, ids) -> Hit:
        """Find the stored prompt (same model key, same bucket) with the longest common prefix."""
        self.stats.lookups += 1
        best = self.peek(key, ids)
        if best.entry is not None and best.usable > 0:
            self._lru.move_to_end(id(best.entry))
            best.entry.hits += 1
            self.stats.hits += 1
        return best

    def peek(self, key: str, ids) -> Hit:
        """Like lookup, but touches neither the LRU order nor the statistics (for decisions)."""
        a = np.asarray(ids, dtype=np.int32)
        digest = bucket_digest(a, self.bucket_tokens)
        best = Hit(bucket=digest.hex())
        bucket = self._buckets.get((key, digest))
        if not bucket:
            return best
        qs = self._lcps(key, digest, bucket, a)
        for e, q in zip(bucket, qs):
            q = int(q)
            exact = q == len(a) == len(e.ids) and e.logits is not None
            if q > best.q or (q == best.q and exact and not best.exact):
                best = Hit(q=q, exact=exact, entry=e, bucket=best.bucket)
        return best

    def _lcps(self, key, digest, bucket: list[Entry], a: np.ndarray) -> np.ndarray:
        """LCP of ``a`` with every entry of a bucket in one vectorised comparison.

        The bucket's ids are kept as a padded matrix (-1 pads never match a token id),
        rebuilt only when the bucket changes."""
        if len(bucket) < 8:
            return np.array([lcp(a, e.ids) for e in bucket])
        mat = self._mats.get((key, digest))
        if mat is None:
            width = max(len(e.ids) for e in bucket)
            mat = np.full((len(bucket), width), -1, dtype=np.int32)
            for i, e in enumerate(bucket):
                mat[i, : len(e.ids)] = e.ids
            self._mats[(key, digest)] = mat
        n = min(len(a), mat.shape[1])
        neq = mat[:, :n] != a[:n]
        first = neq.argmax(axis=1)
        return np.where(neq[np.arange(len(bucket)), first], first, n)

    def clone_kv(self, hit: Hit) -> KV:
        """The usable positions of a hit (q-1, or P on exact repeat), as views: a DynamicCache
        built on them only reads them (it appends by concatenating into new tensors and crops by
        slicing), so the entry is never written and no copy is needed."""
        n = hit.usable
        assert hit.entry is not None and n > 0
        return [(k[:, :, :n], v[:, :, :n]) for k, v in hit.entry.kv]

    # ------------------------------------------------------------------ mutation
    def entry_bytes(self, kv: KV, logits: torch.Tensor | None) -> int:
        return sum(tensor_bytes(k) + tensor_bytes(v) for k, v in kv) + tensor_bytes(logits)

    def store(self, key: str, ids, kv: KV, logits: torch.Tensor | None) -> bool:
        """Store a prompt's KV (tensors are taken as they are: pass copies). False if it cannot fit."""
        a = np.asarray(ids, dtype=np.int32).copy()
        nbytes = self.entry_bytes(kv, logits)
        if len(a) == 0 or nbytes > self.budget:
            self.stats.rejected += 1
            return False
        digest = bucket_digest(a, self.bucket_tokens)
        bucket = self._buckets.setdefault((key, digest), [])
        for old in list(bucket):                      # same prompt stored again: replace it
            if len(old.ids) == len(a) and lcp(old.ids, a) == len(a):
                self._remove(old)
        self._evict_until(self.budget - nbytes)
        e = Entry(key=key, ids=a, kv=kv, logits=logits, nbytes=nbytes, bucket=digest)
        self._mats.pop((key, digest), None)
        self._buckets.setdefault((key, digest), []).append(e)
        self._lru[id(e)] = e
        self.stats.bytes_used += nbytes
        self.stats.stores += 1
        self.stats.entries = len(self._lru)
        return True

    def set_budget(self, budget_bytes: int) -> int:
        """Change the budget; evicts LRU entries to fit. Returns how many were evicted."""
        if budget_bytes < 0:
            raise ValueError("budget must be >= 0")
        before = self.stats.evictions
        self.budget = int(budget_bytes)
        self.stats.budget = self.budget
        self._evict_until(self.budget)
        return self.stats.evictions - before

    def snapshot(self) -> "CacheSnapshot":
        """The store's state (entries, LRU order, per-entry hits, statistics, budget), to
        ``restore`` later. Entries are shared, not copied: their tensors are never written in place."""
        return CacheSnapshot(budget=self.budget,
                             buckets={b: list(es) for b, es in self._buckets.items()},
                             lru=OrderedDict(self._lru), mats=dict(self._mats),
                             hits={id(e): e.hits for e in self._lru.values()},
                             stats=replace(self.stats), history=self.history.tokens)

    def restore(self, snap: "CacheSnapshot") -> None:
        """Put the store back exactly as it was at ``snapshot`` (entries stored since are dropped)."""
        self.budget = snap.budget
        self._buckets = {b: list(es) for b, es in snap.buckets.items()}
        self._lru = OrderedDict(snap.lru)
        self._mats = dict(snap.mats)
        for e in self._lru.values():
            e.hits = snap.hits.get(id(e), e.hits)
        self.stats = replace(snap.stats)
        if snap.history is not None:
            self.history.tokens = snap.history

    def clear(self) -> None:
        for e in list(self._lru.values()):
            self._remove(e)
        self.history.clear()

    def _evict_until(self, limit: int) -> None:
        while self._lru and self.stats.bytes_used > limit:
            _, e = next(iter(self._lru.items()))
            self._remove(e)
            self.stats.evictions += 1

    def _remove(self, e: Entry) -> None:
        self._lru.pop(id(e), None)
        b = self._buckets.get((e.key, e.bucket))
        self._mats.pop((e.key, e.bucket), None)
        if b is not None:
            b[:] = [x for x in b if x is not e]
            if not b:
                del self._buckets[(e.key, e.bucket)]
        self.stats.bytes_used -= e.nbytes
        self.stats.entries = len(self._lru)
