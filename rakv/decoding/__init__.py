"""Greedy decoding primitives over model forward + ``DynamicCache`` (no ``generate()``).

Invariant used throughout: the target cache holds KV for every committed token except the
last one, which is *pending* (emitted, not yet fed). So
  * an AR step feeds the pending token and emits argmax;
  * a speculative round feeds [pending, d_1..d_k] (k+1 tokens) in one verify forward, accepts
    the longest prefix of drafts that matches the target's argmax, plus one target token, and
    crops the k - a rejected positions.

``model`` in every primitive is what runs the forward: a backend (``rakv.backends.Backend``), or
a transformers module, whose backend ``rakv.backends.backend_of`` finds (the one chosen at load;
a bare module gets the torch path, or its lean forward where one is attached).

Shapes: ids [1, n]; logits [n, V] (batch 1 squeezed); KV per layer [1, heads, n, head_dim].
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from transformers import DynamicCache

from ..backends import backend_of
from ..kernels.lean import crop
from ..util.device import clock
from ..prefix_cache import KV
from .sampling import accept_rejection, accept_seeded, first_max, sample_rows

now = clock          # perf_counter, after synchronizing an asynchronous device (CUDA / MPS) in use


def forward(model, tokens, cache: DynamicCache, keep: int = 0, tree=None) -> torch.Tensor:
    """Feed ``tokens`` ([n]) after what ``cache`` holds; returns logits [keep or n, V] (float32).

    Runs ``model``'s backend (``backend_of``: ``model`` itself when it is one, else the module's,
    chosen once at load). ``tree`` (a ``TreeLayout``, lean backends
    only): the tokens form a token tree. ``prefill``, ``decode_one`` and ``verify`` come through
    here (the backend's own ``prefill`` / ``step`` / ``verify`` are these same calls of its
    ``forward``), so this is the one place every chain forward of the engine passes."""
    return backend_of(model).forward(tokens, cache, keep, tree)


def prefill(model, ids, cache: DynamicCache) -> torch.Tensor:
    """Prompt (or prompt suffix) forward; logits of the last position only: [V]."""
    return forward(model, ids, cache, keep=1)[-1]             # = backend_of(model).prefill(ids, cache)


def decode_one(model, token: int, cache: DynamicCache) -> torch.Tensor:
    """One AR step: feed one token, return next-token logits [V]."""
    return forward(model, [token], cache, keep=1)[-1]         # = backend_of(model).step(token, cache)


def verify(model, tokens: list[int], cache: DynamicCache) -> torch.Tensor:
    """Target forward over [pending, d_1..d_k]: logits [k+1, V]."""
    return forward(model, tokens, cache, keep=0)              # = backend_of(model).verify(tokens, cache)


def tree_forward_ok(model) -> bool:
    """Whether ``model`` verifies a token tree in one forward (a lean backend; the torch path
    verifies chains)."""
    return backend_of(model).tree_ok


def verify_tree(model, tokens: list[int], parents: list[int], cache: DynamicCache) -> torch.Tensor | None:
    """Target forward over a token tree: row i is tokens[i], its parent row parents[i] (-1: after
    the cache); logits [n, V], or None when the model's backend has no tree forward (``tree_forward_ok``)."""
    return backend_of(model).tree(tokens, parents, cache)


@torch.inference_mode()
def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """After a tree verify from position ``start``: keep the rows ``rows`` (increasing: an accepted
    path) at positions start, start + 1, ... of every layer, and drop every other row."""
    if rows != list(range(len(rows))):
        idx = torch.tensor(rows, dtype=torch.long) + start
        for layer in cache.layers:
            for t in (layer.keys, layer.values):            # [1, H, start + n, D] (the indexed read is a copy)
                t[:, :, start:start + len(rows)] = t[:, :, idx]
    crop_to(cache, start + len(rows))


def accept(drafts: list[int], pred: list[int]) -> int:
    """Longest a with drafts[:a] == pred[:a] (pred = target argmax at each of the k+1 positions)."""
    return accept_seeded(drafts, pred)


def argmax(logits: torch.Tensor) -> int:
    """The argmax of [V] logits (``first_max``: the same index, faster)."""
    return first_max(logits.reshape(-1))


_scratch = threading.local()         # top_prob's buffer, one a thread


def top_prob(logits: torch.Tensor) -> float:
    """Softmax probability of the argmax token ([V] logits): the draft's confidence, 1 / sum exp(x - max).
    On the CPU in numpy, into a buffer kept per thread: the torch form, two fresh vocabulary-sized
    tensors a call, cost up to 0.5 ms a drafted token inside a server's round (0.04 ms alone)."""
    if logits.device.type != "cpu":
        return float(torch.exp(logits.max() - torch.logsumexp(logits.float(), dim=-1)))
    x = logits.detach().reshape(-1).float().numpy()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[0] < x.shape[0]:
        buf = _scratch.buf = np.empty(x.shape[0], np.float32)
    y = buf[: x.shape[0]]                 # (no new vocabulary-sized array a call: those are fresh pages)
    np.subtract(x, x.max(), out=y)
    np.exp(y, out=y)
    return float(1.0 / y.sum())


# ----------------------------------------------------------------------------- cache helpers
def cache_len(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def rollback(cache: DynamicCache, n_remove: int) -> None:
    """Remove the last ``n_remove`` positions, as every backend does (``Backend.rollback``): a cache
    the lean backend's C layers wrote last keeps the same views, made for all layers at once by its
    buffers (``rakv.kernels.lean.crop``); any other is cropped (transformers 5.x: a negative crop).
    The cache, not a model, names it: a prefix-cache clone has no model."""
    crop(cache, n_remove)


def crop_to(cache: DynamicCache, length: int) -> None:
    rollback(cache, cache_len(cache) - length)


def kv_of(cache: DynamicCache, n: int) -> KV:
    """The first ``n`` positions of every layer, for storing in the prefix cache: the tensors
    themselves when they hold exactly n positions (zero copy: DynamicCache never writes in place,
    it concatenates into new tensors and crops by slicing), else copies."""
    return [(_own(layer.keys, n), _own(layer.values, n)) for layer in cache.layers]


def _own(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:, :, :n]`` as a tensor whose bytes are all its own (so byte accounting is exact)."""
    v = t[:, :, :n]
    whole = v.is_contiguous() and v.untyped_storage().nbytes() == v.numel() * v.element_size()
    return v if whole else v.clone()


def kv_nbytes(cache: DynamicCache, n: int) -> int:
    total = 0
    for layer in cache.layers:
        k = layer.keys
        per_pos = k.numel() // max(1, k.shape[-2]) * k.element_size()
        total += 2 * per_pos * n
    return total


def cache_from(kv: KV) -> DynamicCache:
    """A fresh DynamicCache holding ``kv`` (tensors are used as given: pass copies)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def verify_accept(model, cache, pending: int, drafts: list[int], s=None,
                  position: int = 0, q_logits=None) -> tuple[list[int], int]:
    """Verify [pending, d_1..d_k] in one forward; accept a drafts + one target token; roll back.

    Greedy: drafts equal to the argmax. Seeded sampling: drafts equal to the target's own sample at
    their output position (``position`` is d_1's), so the tokens are target-only sampling's.
    Rejection: accept with min(1, p/q), resample from the residual (exact in distribution)."""
    logits = verify(model, [pending] + drafts, cache)      # [k+1, V]
    if s is None or s.greedy:
        pred = first_max(logits)
        a = accept(drafts, pred)
        nxt = pred[a]
    elif s.verify == "seeded":
        pred = sample_rows(logits, s, list(range(position, position + len(drafts) + 1)), drafts)
        a = accept_seeded(drafts, pred)
        nxt = pred[a]
    else:
        a, nxt = accept_rejection(logits, q_logits, drafts, s, position)
    rollback(cache, len(drafts) - a)
    return drafts[:a] + [nxt], a
