"""The lean forward's KV: grown in place in buffers with room (``_append``), one allocation for all
layers in the C layers (``_Views``), the buffers of gone caches kept for the next (``KvPool``)."""

from __future__ import annotations

import threading
import weakref

import torch

# What the lean forward keeps of a cache and of its layers lives here, keyed by the objects (weakly:
# an entry goes with its cache or layer), never as attributes pinned on transformers' objects.
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # cache -> its C layers' _Views
_BUFS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()      # cache layer -> its (k, v) buffers


def views_of(cache) -> "_Views | None":
    """The buffers the C layers wrote ``cache`` into last (None: they never did)."""
    return _VIEWS.get(cache)


def crop(cache, n_remove: int) -> None:
    """Drop the last ``n_remove`` positions of ``cache``: by the views the C layers left where they
    wrote it last (``_Views.crop``: made for all layers at once from its buffers), else by
    transformers' crop (5.x: a negative crop). The cache, not a model, says which: a prefix-cache
    clone has no model."""
    if n_remove > 0:
        views = _VIEWS.get(cache)
        if views is None or not views.crop(cache, n_remove):
            cache.crop(-n_remove)


KV_MIN_CAPACITY = 256
KV_POOL_KEEP = 2          # free KV buffers kept for later caches (KvPool)
KV_POOL_BYTES = 1 << 30   # and their bytes at most


def kv_capacity(length: int) -> int:
    """A new KV buffer's positions for ``length`` held: at least twice that, a power of two
    (capacity doubling: a growing sequence copies its KV O(log n) times)."""
    return max(KV_MIN_CAPACITY, 1 << (2 * length - 1).bit_length())


class _Views:
    """The C forward's KV buffers of one cache: one allocation for all its layers, K and V
    [layers, 1, Hk, cap, D], and the views of them it last put in the layers (``ks``, ``vs``)."""

    __slots__ = ("K", "V", "cap", "ks", "vs")

    def __init__(self, K: torch.Tensor, V: torch.Tensor):
        self.K, self.V, self.cap = K, V, int(K.shape[-2])
        self.ks = self.vs = ()

    def crop(self, cache, n_remove: int) -> bool:
        """Drop the last ``n_remove`` positions of ``cache`` when every layer still holds the views
        these buffers' last C forward left: new views of the same buffers for all layers in two
        slices. That is what ``DynamicCache.crop`` makes (each layer's K and V sliced to the shorter
        length), without its slice a layer and without the next step looking at every layer again
        (``buffers_hold`` fails after a crop; the costs: docs/fastpath.md). False, and nothing done,
        in any other state (``crop`` then crops)."""
        from transformers.cache_utils import DynamicLayer

        layers, ks, vs = cache.layers, self.ks, self.vs
        if n_remove <= 0 or len(ks) != len(layers) or not all(
                type(L) is DynamicLayer and L.keys is ks[i] and L.values is vs[i] for i, L in enumerate(layers)):
            return False
        n = int(ks[0].shape[-2]) - n_remove
        if n < 0:
            return False
        self.ks, self.vs = self.K[:, :, :, :n].unbind(0), self.V[:, :, :, :n].unbind(0)
        for L, k, v in zip(layers, self.ks, self.vs):
            L.keys, L.values = k, v
        return True


def buffers_hold(views: "_Views | None", layers, length: int) -> bool:
    """Can the C forward write up to ``length`` positions into the buffers it used last time,
    without looking at each layer again: every layer still holds the very views it left (nothing
    cropped or replaced them) and the buffers have room (a look at each layer is what this saves,
    cold after a forward)."""
    if views is None or length > views.cap or len(views.ks) != len(layers):
        return False
    ks, vs = views.ks, views.vs
    return all(L.keys is ks[i] and L.values is vs[i] for i, L in enumerate(layers))


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (itself and its views; None: torch cannot say)."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1   # (less the wrapper asked)
    except (AttributeError, RuntimeError):
        return None


class KvPool:
    """The C forward's KV buffers of caches that are gone, kept for the next caches: a buffer's
    first touch costs page faults (far more than filling warm pages: docs/fastpath.md, "The KV
    pool"), so a request reuses the last one's pages.

    A buffer is free when the cache it served is gone and no other tensor shares its storage (a
    view of it kept by anyone keeps it from reuse); at most ``keep`` free ones are kept."""

    def __init__(self, keep: int = KV_POOL_KEEP):
        self.keep = keep
        self.entries: list[tuple[_Views, weakref.ref]] = []
        self.lock = threading.Lock()          # (engines may run in several threads)

    @staticmethod
    def free(views: "_Views", owner: weakref.ref) -> bool:
        if owner() is not None:
            return False
        views.ks = views.vs = ()      # the gone cache's views: now only a holder elsewhere keeps one
        return _storage_refs(views.K) == 1 and _storage_refs(views.V) == 1

    def take(self, shape: tuple, dtype, device, cache) -> "_Views | None":
        """The smallest free buffer of ``shape`` but for at least its capacity, now ``cache``'s."""
        with self.lock:
            return self._take(shape, dtype, device, cache)

    def _take(self, shape, dtype, device, cache):
        best = None
        for i, (vw, owner) in enumerate(self.entries):
            K = vw.K
            if (K.dtype == dtype and K.device == device and K.shape[:3] == shape[:3]
                    and K.shape[4] == shape[4] and vw.cap >= shape[3] and self.free(vw, owner)
                    and (best is None or vw.cap < self.entries[best][0].cap)):
                best = i
        if best is None:
            return None
        vw = self.entries[best][0]
        self.entries[best] = (vw, weakref.ref(cache))
        return vw

    def add(self, views: "_Views", cache) -> None:
        """A new buffer serving ``cache``; free buffers beyond ``keep`` are let go (oldest first)."""
        with self.lock:
            self.entries.append((views, weakref.ref(cache)))
            self._trim()

    def _trim(self) -> None:
        """Keep the newest free buffers, at most ``keep`` of them and KV_POOL_BYTES in all."""
        kept, total, drop = 0, 0, set()
        for i in reversed(range(len(self.entries))):
            vw, owner = self.entries[i]
            if self.free(vw, owner):
                nbytes = 2 * vw.K.numel() * vw.K.element_size()
                if kept < self.keep and total + nbytes <= KV_POOL_BYTES:
                    kept, total = kept + 1, total + nbytes
                else:
                    drop.add(i)
        if drop:
            self.entries = [e for i, e in enumerate(self.entries) if i not in drop]


KV_POOL = KvPool()


def _reserve_layers(layers, n: int, old: "_Views | None", cache=None) -> "_Views":
    """Buffers for the C forward with room for n more positions after what the layers hold: the
    old ones when every layer's KV still starts them (a crop keeps them) and they have room, else
    a free pooled buffer or one new allocation for all layers (capacity doubling) holding each
    layer's positions. Each layer's buffers (``_BUFS``) are its part (``_append``, the Python layers,
    writes into the same). One allocation lets a step make every layer's new views in two ops
    instead of two a layer."""
    n0 = int(layers[0].keys.shape[-2])
    if old is not None and n0 + n <= old.cap and len(old.K) == len(layers) and all(
            L.keys.shape[-2] == n0 and L.keys.data_ptr() == old.K[i].data_ptr()
            and L.values.data_ptr() == old.V[i].data_ptr() for i, L in enumerate(layers)):
        return old
    cap = kv_capacity(n0 + n)
    k0 = layers[0].keys
    shape = (len(layers), *k0.shape[:-2], cap, k0.shape[-1])
    views = KV_POOL.take(shape, k0.dtype, k0.device, cache) if cache is not None else None
    if views is None:
        views = _Views(k0.new_empty(shape), layers[0].values.new_empty(shape))
        if cache is not None:
            KV_POOL.add(views, cache)
    K, V = views.K, views.V
    for i, L in enumerate(layers):
        m = L.keys.shape[-2]
        K[i, ..., :m, :] = L.keys
        V[i, ..., :m, :] = L.values
        _BUFS[L] = (K[i], V[i])
    return views


def _append(cache, i: int, k: torch.Tensor, v: torch.Tensor):
    """``cache.update(k, v, i)`` without copying the whole layer every step: from the second forward
    on, a layer's KV lives in a buffer with room to grow (capacity doubling), the layer's ``keys`` /
    ``values`` are views of its first positions, and new positions are written in place. A crop
    (a view) keeps the buffer; anything else put in the layer (a fresh tensor) starts a new one.
    The first forward's KV is HF's own (a contiguous tensor of exactly the prompt), so the prefix
    cache stores it without a copy; a buffer view it would copy (``decoding.kv_of``)."""
    if i >= len(cache.layers) or not cache.layers[i].is_initialized or cache.layers[i].keys.numel() == 0:
        return cache.update(k, v, i)
    L = cache.layers[i]
    n0, n = L.keys.shape[-2], k.shape[-2]
    bk, bv = _reserve(L, n)
    bk[..., n0:n0 + n, :] = k
    bv[..., n0:n0 + n, :] = v
    L.keys, L.values = bk[..., :n0 + n, :], bv[..., :n0 + n, :]
    return L.keys, L.values


def _reserve(L, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's growing KV buffers (k, v [1, Hk, capacity, D], contiguous) with room for n more
    positions after what ``L`` holds; a new pair (holding L's positions) when L's KV is not a view
    of them or they are full."""
    n0 = L.keys.shape[-2]
    buf = _BUFS.get(L)
    if buf is None or L.keys.data_ptr() != buf[0].data_ptr() or n0 + n > buf[0].shape[-2]:
        cap = kv_capacity(n0 + n)
        shape = (*L.keys.shape[:-2], cap, L.keys.shape[-1])
        bk, bv = L.keys.new_empty(shape), L.values.new_empty(shape)
        bk[..., :n0, :] = L.keys
        bv[..., :n0, :] = L.values
        _BUFS[L] = buf = (bk, bv)
    return buf


def c_buffers(cache, layers, length: int, n: int) -> "_Views":
    """The buffers a C forward writes ``cache``'s next n positions into (``length`` held after it):
    the ones it used last time where they still hold, else reserved anew."""
    views = _VIEWS.get(cache)
    if not buffers_hold(views, layers, length):
        views = _reserve_layers(layers, n, views, cache)
    return views


def c_written(cache, layers, views: "_Views", length: int) -> None:
    """After a C forward: every layer's KV is its buffer's first ``length`` positions (two ops for
    all layers), and the cache remembers the buffers."""
    ks = views.K[:, :, :, :length].unbind(0)
    vs = views.V[:, :, :, :length].unbind(0)
    for L, k, v in zip(layers, ks, vs):
        L.keys, L.values = k, v
    views.ks, views.vs = ks, vs
    _VIEWS[cache] = views

