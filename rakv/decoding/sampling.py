"""Sampling: turn logits into tokens that depend only on (seed, position) and the filtered distribution.

This module's one job is the arithmetic of sampled decoding, with no model and no engine state:
for the settings (``rakv.config.Sampling``), the filtered distribution (``logprobs``), the seeded Gumbel noise
(``noise``), the sampler (``sample`` / ``sample_rows`` / ``propose``) and the two ways a verify
judges drafted tokens (``accept_seeded``, ``accept_rejection``).

Seed-exact sampling
-------------------
The token at output position i is ``argmax_x (z_x / T + G_x)`` over the tokens the filters keep
(Gumbel-max), where z are the logits, T the temperature and G = ``noise(seed, i, V)``: standard
Gumbel noise from a counter-based generator keyed by (seed, position, stream) alone. Any caller that
holds the same filtered distribution at position i gets the same token, whatever ran before: target
only, any draft, any k, cache reuse or not. (``z / T + G`` differs from ``logprobs + G`` by the
log-normaliser, a constant per row, so the argmax is the same token except where two tokens' scores
tie to the last float bit.) A draft that proposes with the same noise over its own distribution q
(a *coupled* draft) proposes the target's sample with probability at least (1 - TV) / (1 + TV)
(Daliri et al. 2024, drafter-invariant speculative decoding); a proposal is accepted iff it equals
the target's sample, so accepted tokens are the target's samples.

The noise, exactly: for (seed, position, stream) a 64-bit key K is derived with splitmix64 in Python
integers, and value j of that key's stream is ``splitmix64(K + (j + 1) * 0x9E3779B97F4A7C15)``
computed vectorised in torch int64 (wrap-around arithmetic, logical shifts by masking), checked
against a pure-Python reference in the tests. A 64-bit value h (as signed int64, arithmetic shift)
gives the uniform ``((h >> 12) + 2**51 + 0.5) * 2**-52`` in (0, 1), exact in float64. The vocabulary is cut into blocks of
``BLOCK`` = 64 slots, and a block's Gumbels are built top-down (the joint law of 64 independent
standard Gumbels): the block maximum M ~ Gumbel(log 64) = log 64 - log(E_b) with E_b = -log(u_b),
its slot J = (h_b mod 64), both from the block-level stream; every other slot i gets the Gumbel
truncated below M, ``-log(E_b / 64 + E_i)`` with E_i = -log(u_i) from the slot-level stream,
clamped to M in float32 (so M bounds the block exactly). ``sample`` uses this to compute noise only
for the blocks that can hold the winner: a block whose max logit plus M is below the best score
already attained is skipped. The result is bit-identical to the argmax over the full ``noise``
vector (same elementwise operations per slot; ties go to the lowest token id, as torch.argmax).
On CPU the whole sampler is one call of the kernel library (``rakv_gumbel_argmax`` in
rakv/kernels/blockq.c: the same words and float operations, log from the C library, the
block with the largest bound scored first), ~0.1 ms a token where torch's ~40 small ops took
0.3 ms warm and 0.8-1.0 ms right after a forward (2-core Zen 5 VM); the tests check that it gives
the torch ops' token, and ``RAKV_C_SAMPLER=0`` keeps the ops. Nothing is cached but the table of
(j + 1) * golden constants. Value j does not depend on V, the
thread count or the call history; the integer part is exact on every machine and device, the float
part is IEEE float64 log (bit-identical across calls and thread counts here; another libm or device
may differ in the last bit of a float64 log, which moves a float32 Gumbel with probability ~2**-29).

Filters (the distribution both verification modes use)
------------------------------------------------------
Order, as transformers' ``generate`` applies its warpers: temperature (z / T, as
TemperatureLogitsWarper), then top-k, then top-p on what top-k kept (renormalised), then min-p.
Every filter keeps the tokens whose scaled logit is >= a threshold, so the kept set is one
threshold t and the removed tokens get -inf:

- top-k (TopKLogitsWarper): t = the k-th largest scaled logit; ties with it are all kept (so more
  than k tokens may survive, as in transformers). top_k >= V keeps everything.
- top-p (TopPLogitsWarper): keep the most likely tokens until the mass of the tokens strictly ahead
  reaches top_p (the token that crosses top_p is kept; at least one token). Differences: a tie
  straddling the boundary is kept whole (transformers keeps whichever tied tokens its unstable sort
  puts last), and the cumulative mass is summed in float64 from the top (transformers: float32 from
  the bottom), so the two can differ when the boundary falls within float32 rounding of top_p.
- min-p (MinPLogitsWarper): keep p(x) >= min_p * max p, computed as z/T >= max(z/T) + log(min_p)
  in float32 (no underflow; transformers compares float32 probabilities, so the two can differ
  when a token sits within float32 rounding of the boundary). The top token always survives.

Temperature 0 is greedy: exactly ``argmax`` of the logits, the filters ignored, no seed needed.

Rejection verification (``--verify rejection``)
-----------------------------------------------
Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over the filtered p
(target) and q (draft): draft j is accepted when u_j < min(1, p(x)/q(x)) with u_j the uniform keyed
by (seed, position, "accept"); on the first rejection the token comes from norm(max(0, p - q)) by
Gumbel-max with the "residual" stream; after k acceptances the bonus token is ``sample`` of p's last
row. A model draft proposes from q with the "draft" stream (independent of the accept uniforms).
Exact in distribution, not in tokens.
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch
from torch import Tensor

from ..config import VERIFY_MODES, Sampling
from ..util.ids import lcp
from ..util.paths import env_on


def first_max(logits: Tensor) -> list[int]:
    """Each row's argmax (its first maximum) of [n, V] logits. torch's max(-1) finds the same index
    as argmax, about 3x faster over a 150k vocabulary (a lane's greedy step, alone on its thread)."""
    return logits.max(-1).indices.tolist()

BLOCK = 64                        # noise block size: part of the noise's definition (changing it changes every sample)
_LOG_BLOCK = math.log(BLOCK)
_FIRST_BLOCKS = 16                # blocks (largest logits first) whose noise the sampler's first stage computes
_TOP_START = 64                   # top-p first looks at this many top tokens, then 8x more each time
_STREAMS = {"sample": 1, "draft": 2, "residual": 3, "accept": 4}
_SLOT, _BLOCK_LEVEL = 0, 1

# splitmix64 (Steele, Lea, Flood 2014; the finaliser of Stafford's "Mix13")
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


# ---------------------------------------------------------------------------------------------
# the counter-based generator
# ---------------------------------------------------------------------------------------------

def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (taken mod 2**64): a bijection of 64-bit words."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _MIX1) & _M64
    x = ((x ^ (x >> 27)) * _MIX2) & _M64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """A 64-bit word as torch's int64 holds it."""
    return x - (1 << 64) if x >> 63 else x


def stream_key(seed: int, position: int, stream: str = "sample", level: int = _SLOT) -> int:
    """The 64-bit key of the noise for (seed, position, stream) at one level (slots or blocks)."""
    code = 2 * _STREAMS[stream] + level
    return _mix64(_mix64(_mix64(seed) + position) + code)


def stream_value(key: int, j: int) -> int:
    """Value j of a key's stream, in Python integers (the reference the torch code matches)."""
    return _mix64(key + (j + 1) * _GOLDEN)


def _uniform_of(h: int) -> float:
    """The uniform in (0, 1) a 64-bit value stands for (the same arithmetic as ``_exp1``)."""
    return ((_signed(h) >> 12) + 2.0**51 + 0.5) * 2.0**-52


def uniform(seed: int, position: int, stream: str = "accept") -> float:
    """One uniform in (0, 1) keyed by (seed, position, stream): value 0 of its slot stream."""
    return _uniform_of(stream_value(stream_key(seed, position, stream), 0))


_weyl_lock = threading.Lock()
_weyl_cache: dict[str, Tensor] = {}


def _weyl(m: int, device: torch.device) -> Tensor:
    """[m] int64: (j + 1) * golden mod 2**64 for j < m (constants; grown by doubling, never changed)."""
    name = str(device)
    table = _weyl_cache.get(name)
    if table is None or table.numel() < m:
        with _weyl_lock:
            table = _weyl_cache.get(name)
            if table is None or table.numel() < m:
                size = max(m, 2 * (0 if table is None else table.numel()), 4096)
                values = [_signed(((j + 1) * _GOLDEN) & _M64) for j in range(size)]
                table = torch.tensor(values, dtype=torch.int64, device=device)
                _weyl_cache[name] = table
    return table[:m]


def _finalize_(x: Tensor) -> Tensor:
    """splitmix64's finaliser, in place on int64 words (wrap-around multiply, logical shifts)."""
    t = torch.bitwise_right_shift(x, 30).bitwise_and_((1 << 34) - 1)
    x.bitwise_xor_(t).mul_(_signed(_MIX1))
    torch.bitwise_right_shift(x, 27, out=t).bitwise_and_((1 << 37) - 1)
    x.bitwise_xor_(t).mul_(_signed(_MIX2))
    torch.bitwise_right_shift(x, 31, out=t).bitwise_and_((1 << 33) - 1)
    return x.bitwise_xor_(t)


def _exp1(h: Tensor) -> Tensor:
    """int64 words -> float64 Exp(1) variates -log(u), u = ((h >> 12) + 2**51 + 0.5) * 2**-52 in
    (0, 1) (arithmetic shift of the signed word; every step exact)."""
    return (h >> 12).double().add_(2.0**51 + 0.5).mul_(2.0**-52).log_().neg_()


def _block_values(e: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Block level, from its stream's words h and their Exp(1) variates e [...]: (E_b / BLOCK f64,
    the block's maximum Gumbel M = log BLOCK - log E_b f32, the slot J that holds it i64)."""
    m = torch.rsub(e.log(), _LOG_BLOCK).float()
    return e * (1.0 / BLOCK), m, h & (BLOCK - 1)


def _slot_values(e: Tensor, e_over_b: Tensor, m: Tensor, slot_of_max: Tensor) -> Tensor:
    """Slot level: Exp(1) variates e [c, B] of c blocks with their block values [c] -> the blocks'
    Gumbels [c, B] f32: -log(E_b / B + E_i) (a Gumbel truncated below M), clamped to M, M at J."""
    g = (e + e_over_b[:, None]).log_().neg_().float()
    g = torch.minimum(g, m[:, None])
    return g.scatter_(1, slot_of_max[:, None], m[:, None])


def _words(key: Tensor, counters: Tensor) -> Tensor:
    """Stream values: key [n, 1] int64 and counters [n, m] -> splitmix64(key + (counter + 1) * golden)."""
    weyl = _weyl(int(counters.max()) + 1, counters.device)
    return _finalize_(torch.take(weyl, counters).add_(key))


def _keys(seed: int, positions: list[int], stream: str, level: int, device) -> Tensor:
    """[n, 1] int64 keys of (seed, position, stream) at one level."""
    return torch.tensor([[_signed(stream_key(seed, p, stream, level))] for p in positions], device=device)


def _key_words(seed: int, positions: list[int], stream: str) -> tuple[list[int], list[int]]:
    """The block-level and the slot-level 64-bit keys of (seed, position, stream), per position."""
    return ([stream_key(seed, p, stream, _BLOCK_LEVEL) for p in positions],
            [stream_key(seed, p, stream, _SLOT) for p in positions])


def _key_pairs(seed: int, positions: list[int], stream: str, device) -> tuple[Tensor, Tensor]:
    """([n, 1], [n, 1]) int64 block-level and slot-level keys of (seed, position, stream)."""
    kb, ks = _key_words(seed, positions, stream)
    both = torch.tensor([[_signed(b), _signed(s)] for b, s in zip(kb, ks)], device=device)
    return both[:, :1], both[:, 1:]


def noise(seed: int, position: int, V: int, stream: str = "sample", device: str | torch.device = "cpu") -> Tensor:
    """[V] float32 standard Gumbel noise keyed by (seed, position, stream) only (module docstring).
    Token j's value does not depend on V. Streams: "sample" (target and coupled draft), "draft"
    (a rejection-mode proposal), "residual" (rejection-mode resampling)."""
    device = torch.device(device)
    nb = -(-V // BLOCK)
    hb = _words(_keys(seed, [position], stream, _BLOCK_LEVEL, device),
                torch.arange(nb, device=device)[None])                        # [1, nb]
    e_over_b, m, slot_of_max = _block_values(_exp1(hb), hb)                   # [1, nb] each
    slots = torch.arange(nb * BLOCK, device=device).view(nb, BLOCK)           # [nb, B]
    ks = _keys(seed, [position], stream, _SLOT, device).expand(nb, 1)
    g = _slot_values(_exp1(_words(ks, slots)), e_over_b[0], m[0], slot_of_max[0])   # [nb, B]
    return g.reshape(-1)[:V]


# ---------------------------------------------------------------------------------------------
# filters
# ---------------------------------------------------------------------------------------------

def _block_max(z: Tensor, nb: int) -> Tensor:
    """[n, V] -> [n, nb]: the largest value in each block of BLOCK tokens (the last may be short)."""
    n, V = z.shape
    full = V // BLOCK
    parts = []
    if full:
        parts.append(z[:, : full * BLOCK].unflatten(1, (full, BLOCK)).amax(2))
    if full < nb:
        parts.append(z[:, full * BLOCK:].amax(1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _top_values(x: Tensor, m: int) -> Tensor:
    """[n, V] -> [n, m] the m largest values of each row, descending (exact): read from the m
    blocks with the largest maxima, which hold every one of the top m (with a tie at the m-th
    block maximum, whichever tied blocks are read, the m-th value comes out the same)."""
    n, V = x.shape
    nb = -(-V // BLOCK)
    if 4 * m >= nb:
        return torch.topk(x, m, 1).values
    blocks = torch.topk(_block_max(x, nb), m, 1, sorted=False).indices          # [n, m]
    index = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=x.device)).view(n, m * BLOCK)
    vals = x.gather(1, index.clamp_max(V - 1))
    if V % BLOCK:
        vals = vals.masked_fill(index >= V, -math.inf)
    return torch.topk(vals, m, 1).values


def _top_p_threshold(scaled: Tensor, top_p: float) -> float:
    """The smallest scaled logit top-p keeps (scaled [V] f32, -inf where removed before)."""
    V = scaled.numel()
    mx = scaled.max()
    total = torch.exp(scaled - mx).double().sum()                         # Z e^-max, summed in float64
    m = min(_TOP_START, V)
    while True:
        vals = _top_values(scaled[None], m)[0]                            # [m] descending
        p = torch.exp(vals - mx).double() / total                         # [m] the same terms / total
        before = torch.cumsum(p, 0) - p                                   # [m] mass strictly ahead
        hit = (before >= top_p).nonzero()
        if hit.numel():
            return float(vals[int(hit[0, 0]) - 1])
        if m == V or vals[-1] == -math.inf:
            return -math.inf
        m = min(8 * m, V)


def _thresholds(z: Tensor, s: Sampling) -> Tensor:
    """[n, V] f32 logits -> [n, 1] f32: each row's smallest scaled logit (z / T) the filters keep
    (-inf: all). Kept set of row r = {x : z[r, x] / T >= t[r]}."""
    n, V = z.shape
    T = s.temperature
    t = None
    if 0 < s.top_k < V:
        t = _top_values(z, s.top_k)[:, -1:] / T                          # k-th largest z / T, exactly
    if s.top_p < 1:
        scaled = z / T
        out = []
        for r in range(n):
            row, before = scaled[r], -math.inf if t is None else float(t[r, 0])
            if before > -math.inf:
                row = row.masked_fill(row < before, -math.inf)
            out.append(max(before, _top_p_threshold(row, s.top_p)))
        t = torch.tensor(out, dtype=torch.float32, device=z.device)[:, None]
    if s.min_p > 0:
        t_min = z.amax(1, keepdim=True) / T + math.log(s.min_p)          # max z / T + log min_p (f32)
        t = t_min if t is None else torch.maximum(t, t_min)
    return t if t is not None else torch.full((n, 1), -math.inf, device=z.device)


def threshold(logits: Tensor, s: Sampling) -> float:
    """[V] raw logits -> the smallest scaled logit (z / T, float32) the filters keep; -inf = all.
    Kept set = {x : z_x / T >= threshold}."""
    if not _filters_on(s):
        return -math.inf
    return float(_thresholds(logits.float().reshape(1, -1), s)[0, 0])


def logprobs(logits: Tensor, s: Sampling) -> Tensor:
    """[..., V] logits -> [..., V] float32 log-probabilities of the filtered distribution (removed
    tokens -inf). Greedy: 0 at the argmax, -inf elsewhere."""
    z = logits.float()
    if s.greedy:
        out = torch.full_like(z, -math.inf)
        return out.scatter_(-1, z.argmax(-1, keepdim=True), 0.0)
    rows = z.reshape(-1, z.shape[-1])                                     # [n, V]
    scaled = rows / s.temperature
    if _filters_on(s):
        scaled = scaled.masked_fill(scaled < _thresholds(rows, s), -math.inf)
    return torch.log_softmax(scaled, -1).reshape(z.shape)


def _filters_on(s: Sampling) -> bool:
    return s.top_k > 0 or s.top_p < 1 or s.min_p > 0


# ---------------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------------

def _scores(z: Tensor, T: float, thr: Tensor | None, index: Tensor, g: Tensor) -> Tensor:
    """Scores z / T + G [n, m] f32 of tokens index [n, m] (rows of z), -inf past V or below thr."""
    V = z.shape[1]
    past = V % BLOCK != 0
    zc = z.gather(1, index.clamp_max(V - 1) if past else index)
    if T != 1.0:
        zc = zc / T
    score = zc + g
    if past:
        score.masked_fill_(index >= V, -math.inf)
    if thr is not None:
        score.masked_fill_(zc < thr, -math.inf)
    return score


def _gumbel_argmax(z: Tensor, T: float, thr: Tensor | None, kb: Tensor, ks: Tensor) -> list[int]:
    """Row r of z [n, V] f32: argmax over {x : z_x / T >= thr[r]} of z_x / T + G_x, G the noise of
    block key kb[r] and slot key ks[r] ([n, 1] int64; thr [n, 1] f32 or None = keep all); ties go to
    the lowest token. Up to _FIRST_BLOCKS blocks the whole noise is computed; past that, only the
    blocks that can hold the winner (``_argmax_pruned``)."""
    n, V = z.shape
    nb = -(-V // BLOCK)
    if nb > _FIRST_BLOCKS:
        return _argmax_pruned(z, T, thr, kb, ks)
    weyl = _weyl(nb * BLOCK, z.device)
    words = torch.cat([weyl[:nb] + kb, weyl + ks], 1)                    # [n, nb + nb B]
    e = _exp1(_finalize_(words))
    e_over_b, m, slot_of_max = _block_values(e[:, :nb], words[:, :nb])   # [n, nb] each
    g = _slot_values(e[:, nb:].reshape(n * nb, BLOCK), e_over_b.view(-1), m.view(-1),
                     slot_of_max.view(-1)).view(n, nb * BLOCK)[:, :V]    # [n, V]
    zs = z / T if T != 1.0 else z
    score = zs + g
    if thr is not None:
        score.masked_fill_(zs < thr, -math.inf)
    return score.argmax(1).tolist()


def _argmax_pruned(z: Tensor, T: float, thr: Tensor | None, kb: Tensor, ks: Tensor) -> list[int]:
    """``_gumbel_argmax`` past _FIRST_BLOCKS blocks, in two stages. Stage 1 hashes, in one pass,
    every block's level values and the slots of the R blocks with the largest logits. Stage 2
    computes the other blocks whose bound max(z / T) + M reaches the best score stage 1 found (on
    a real LM's logits: none for most rows at T <= 0.7)."""
    n, V = z.shape
    dev = z.device
    nb = -(-V // BLOCK)
    slots = torch.arange(BLOCK, device=dev)                               # [B]
    top = _block_max(z, nb)                                               # [n, nb]
    if T != 1.0:
        top = top / T                                                     # fl(max z / T) bounds every fl(z / T)
    first = top.topk(_FIRST_BLOCKS, 1, sorted=False).indices.sort(1).values   # [n, R] ascending
    R = first.shape[1]
    index1 = (first[:, :, None] * BLOCK + slots).view(n, R * BLOCK)      # [n, R B] ascending tokens
    weyl = _weyl(nb * BLOCK, dev)
    words = torch.cat([weyl[:nb] + kb, torch.take(weyl, index1).add_(ks)], 1)   # [n, nb + R B]
    e = _exp1(_finalize_(words))
    e_over_b, m, slot_of_max = _block_values(e[:, :nb], words[:, :nb])   # [n, nb] each
    g1 = _slot_values(e[:, nb:].reshape(n * R, BLOCK), e_over_b.gather(1, first).view(-1),
                      m.gather(1, first).view(-1), slot_of_max.gather(1, first).view(-1))   # [n R, B]
    score1 = _scores(z, T, thr, index1, g1.view(n, R * BLOCK))            # [n, R B]
    best, arg1 = score1.max(1, keepdim=True)                              # [n, 1] first maximum
    tokens = index1.gather(1, arg1)                                       # [n, 1]
    upper = top + m                                                       # [n, nb] bound on each block's scores
    if thr is not None:
        upper.masked_fill_(top < thr, -math.inf)
    upper.scatter_(1, first, -math.inf)                                   # stage 1 is done
    rest = upper >= best
    if bool(rest.any()):
        best, tokens = _stage2(z, T, thr, rest, ks, weyl, e_over_b, m, slot_of_max, best, tokens)
    return tokens[:, 0].tolist()


def _stage2(z, T, thr, rest, ks, weyl, e_over_b, m, slot_of_max, best1, tokens) -> tuple[Tensor, Tensor]:
    """The blocks ``rest`` [n, nb] (bool) stage 1 could not rule out: their scores, merged with
    stage 1's (best1, tokens [n, 1]) by score, then lowest token."""
    V = z.shape[1]
    rows, blocks = rest.nonzero(as_tuple=True)                            # [c]
    index = blocks[:, None] * BLOCK + torch.arange(BLOCK, device=z.device)   # [c, B]
    e = _exp1(_finalize_(torch.take(weyl, index).add_(ks[rows])))
    g = _slot_values(e, e_over_b[rows, blocks], m[rows, blocks], slot_of_max[rows, blocks])   # [c, B]
    zc = z[rows[:, None], index.clamp_max(V - 1)]
    if T != 1.0:
        zc = zc / T
    score = zc + g
    if V % BLOCK:
        score.masked_fill_(index >= V, -math.inf)
    if thr is not None:
        score.masked_fill_(zc < thr[rows], -math.inf)
    best2, arg2 = score.max(1)                                            # [c] first maximum
    found = index.gather(1, arg2[:, None])[:, 0]                          # [c]
    best, out = best1[:, 0].tolist(), tokens[:, 0].tolist()
    for r, b, t in zip(rows.tolist(), best2.tolist(), found.tolist()):
        if b > best[r] or (b == best[r] and t < out[r]):
            best[r], out[r] = b, t
    return torch.tensor(best, device=z.device)[:, None], torch.tensor(out, device=z.device)[:, None]


def _sample_rows(logits: Tensor, s: Sampling, positions: list[int], stream: str,
                 drafts: list[int] | None = None) -> list[int]:
    if logits.dim() != 2 or logits.shape[0] != len(positions):
        raise ValueError(f"logits [n, V] with one position per row, got {tuple(logits.shape)} "
                         f"and {len(positions)} positions")
    if s.greedy:
        return until_miss(first_max(logits), drafts)
    if s.seed is None:
        raise ValueError("sampling needs a seed: draw one with draw_seed()")
    z = logits.float().contiguous()
    t = None
    if _filters_on(s):
        t = _thresholds(z, s)
    return _argmax(z, float(s.temperature), t, s.seed, positions, stream, drafts)


def until_miss(tokens: list[int], drafts: list[int] | None) -> list[int]:
    """A verify's row tokens up to the first that differs from its draft (the rows after it are
    never used); all of them without drafts."""
    if drafts is None:
        return tokens
    return tokens[: lcp(drafts, tokens) + 1]


def _argmax(z: Tensor, T: float, thr: Tensor | None, seed: int, positions: list[int], stream: str,
            drafts: list[int] | None = None) -> list[int]:
    """``_gumbel_argmax`` with the keys of (seed, positions, stream): in one call of the kernel
    library's sampler where it runs (CPU), else in torch's ops. With a verify's ``drafts``
    (len(positions) - 1 of them), only the rows up to the first token that differs from its draft."""
    lib = _c_sampler() if z.device.type == "cpu" else None
    if lib is None:
        return until_miss(_gumbel_argmax(z, T, thr, *_key_pairs(seed, positions, stream, z.device)), drafts)
    n, V = z.shape
    kb, ks = _key_words(seed, positions, stream)
    keys = (ctypes.c_uint64 * (2 * n))(*kb, *ks)
    out = (ctypes.c_int64 * n)()
    expect = None if drafts is None else (ctypes.c_int64 * max(1, n - 1))(*drafts[: n - 1])
    if thr is not None:
        thr = thr.reshape(n).contiguous()
    rc = lib.rakv_gumbel_argmax(z.data_ptr(), n, V, T, None if thr is None else thr.data_ptr(),
                                ctypes.addressof(keys), ctypes.addressof(keys) + 8 * n, out, expect)
    if rc != 0:
        raise MemoryError("the sampler could not allocate its block tables")
    # -1: every score -inf (the argmax then); -2: a row past the first miss, not sampled
    return [x if x >= 0 else int(z[r].argmax()) for r, x in enumerate(out) if x != -2]


def _c_sampler():
    """The kernel library (rakv.kernels.blockq) when its sampler may run, else None;
    ``RAKV_C_SAMPLER=0`` keeps torch's ops (for comparison)."""
    if not env_on("RAKV_C_SAMPLER"):
        return None
    from ..kernels import blockq

    return blockq.library()


def sample(logits: Tensor, s: Sampling, position: int) -> int:
    """[V] logits -> the token at output ``position``: argmax at temperature 0, else Gumbel-max of
    the filtered distribution with noise(s.seed, position)."""
    if s.greedy:
        return int(logits.argmax())
    return _sample_rows(logits.reshape(1, -1), s, [position], "sample")[0]


def sample_rows(logits: Tensor, s: Sampling, positions: list[int], drafts: list[int] | None = None) -> list[int]:
    """[n, V] logits -> row j's token at positions[j] (a verify's k + 1 rows); each row exactly
    what ``sample`` gives for it. With the verify's k ``drafts``: the rows up to the first whose
    token differs from its draft (seeded acceptance needs no more; the sampler skips the rest)."""
    if drafts is not None and len(drafts) != len(positions) - 1:
        raise ValueError(f"{len(positions)} rows verify {len(positions) - 1} drafts, got {len(drafts)}")
    return _sample_rows(logits, s, list(positions), "sample", drafts)


def propose(draft_logits: Tensor, s: Sampling, position: int, verify: str | None = None) -> int:
    """[V] draft logits -> the drafted token at ``position``. Seeded: the same noise as the target
    (a coupled draft, = sample). Rejection: a sample of the filtered q with the "draft" stream."""
    verify = s.verify if verify is None else verify
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if s.greedy:
        return int(draft_logits.argmax())
    stream = "sample" if verify == "seeded" else "draft"
    return _sample_rows(draft_logits.reshape(1, -1), s, [position], stream)[0]


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------

def accept_seeded(drafts: list[int], targets: list[int]) -> int:
    """Seeded mode: the accepted count, the longest prefix with drafts[j] == targets[j]; the next
    token is targets[accepted]."""
    return lcp(drafts, targets)


def _accept_probability(log_p: float, log_q: float) -> float:
    """min(1, p(x) / q(x)) for a drafted x."""
    return 1.0 if log_p >= log_q else math.exp(log_p - log_q)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """[V] -> [V] the unnormalised residual max(0, p - q) a rejection resamples from."""
    return (p - q).clamp_min_(0.0)


def accept_rejection(p_logits: Tensor, q_logits: Tensor | None, drafts: list[int], s: Sampling,
                     position0: int) -> tuple[int, int]:
    """Rejection mode: (accepted count a, the token after the accepted drafts).

    p_logits [k+1, V] target rows (row j judges drafts[j], row k gives the bonus token); q_logits
    [k, V] the draft's rows, or None for a deterministic proposal (q a point mass on the draft).
    Draft j sits at output position position0 + j. Greedy settings accept the drafts equal to the
    argmax and return the argmax after them (what both modes reduce to)."""
    k = len(drafts)
    if p_logits.shape[0] != k + 1 or (q_logits is not None and q_logits.shape[0] != k):
        raise ValueError(f"p_logits [k+1, V] and q_logits [k, V] for k = {k} drafts, got "
                         f"{tuple(p_logits.shape)} and "
                         f"{None if q_logits is None else tuple(q_logits.shape)}")
    if s.greedy:
        targets = first_max(p_logits)
        a = accept_seeded(drafts, targets)
        return a, targets[a]
    if s.seed is None:
        raise ValueError("sampling needs a seed: draw one with draw_seed()")
    if k == 0:
        return 0, sample(p_logits[0], s, position0)
    rows = p_logits[:k].float() if q_logits is None else torch.cat([p_logits[:k].float(), q_logits.float()])
    lr = logprobs(rows, s)                                                # [k, V] p rows, then [k, V] q rows
    drafted = torch.tensor(drafts, device=lr.device)
    at = lr.gather(1, drafted.repeat(lr.shape[0] // k)[:, None])[:, 0].tolist()   # log p(x_j), then log q(x_j)
    log_q = at[k:] if q_logits is not None else [0.0] * k
    for j, x in enumerate(drafts):
        if uniform(s.seed, position0 + j, "accept") < _accept_probability(at[j], log_q[j]):
            continue
        p = lr[j].exp()                                                   # [V]
        if q_logits is not None:
            q = lr[k + j].exp()
        else:
            q = torch.zeros_like(p).index_fill_(0, drafted[j:j + 1], 1.0)
        r = _residual(p, q)                                               # [V]
        if not bool(r.sum() > 0):                                         # float rounding only
            r = p
        return j, _residual_sample(r, s.seed, position0 + j)
    return k, sample(p_logits[k], s, position0 + k)


def _residual_sample(r: Tensor, seed: int, position: int) -> int:
    """Gumbel-max of the normalised r [V] with the "residual" stream at ``position``."""
    z = r.log()[None].float().contiguous()                                # [1, V], -inf where 0
    return _argmax(z, 1.0, None, seed, [position], "residual")[0]
