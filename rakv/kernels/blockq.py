"""Exact block-coded weights: a linear layer whose fp32 weights are exactly GGUF blocks runs from
the blocks.

The demo model comes from a Q4_1 GGUF (its LM head / embedding from Q8_0): every weight of its
linear layers is exactly ``d * q + m`` for a 4-bit code q and a scale d and minimum m shared by 32
inputs (the head's ``d * q`` for an 8-bit q). Stored as fp32 those weights cost 32 bits each, and a
decode step, which streams every weight once, pays for 32. Kept as the codes they cost 4.5 (8.5),
and ``kernels/blockq.c`` rebuilds each weight in fp32 exactly as it was, then multiplies in fp32:
the same weights and the same fp32 maths, about a seventh of the bytes.

Nothing is assumed: ``encode`` finds codes for a weight block by block and keeps them only when
every element is rebuilt bit for bit; a
layer where one block fails stays on the fp32 kernels. The kernel's order of additions does not
depend on the number of rows, so a row of a (k + 1)-token verify equals the same row computed as
a decode step, bit for bit.

The kernel is C, compiled once per machine with the system's C compiler (``cc``, ``-O3
-march=native -fopenmp``; ~2 s) into the cache dir and loaded with ctypes; it runs on torch's own
OpenMP runtime and thread count. Where it cannot be built (no compiler, not x86-64 / ARM Linux or
macOS), or ``RAKV_BLOCKQ=0``, or the weights are not block-coded, the fp32 kernels run as before.
Up to ``MAX_ROWS`` rows (decode, draft and verify steps, short prefills) use it; longer prefills keep
oneDNN's packed fp32 (a compute-bound shape where its blocking wins).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

BLK = 32                 # inputs per block (GGUF's Q4_0/Q4_1/Q8_0)
MAX_ROWS = 64            # rows up to which the block kernel runs: every decode and verify step (k <= 16) and
                         # short prefills (below ~64 rows it beat oneDNN's packed fp32 here: 32 rows 54 vs 69 ms)
ATTEND_ROWS = 17         # new rows up to which a step's attention is blockq.attend (decode and verify)
MIN_PARAMS = 1024        # smaller weights are not worth a kernel call's overhead
SOURCE = Path(__file__).with_name("blockq.c")


def env_enabled() -> bool:
    """``RAKV_BLOCKQ`` (on unless 0): read at load (``rakv.backend.read_switches``), not per call."""
    from ..paths import env_on

    return env_on("RAKV_BLOCKQ")


# ----------------------------------------------------------------------------- the compiled kernel
class _Lib:
    handle = None          # ctypes.CDLL once built and loaded
    reason = ""            # why not, when it could not be
    tried = False
    ident = ""             # the loaded build's identity (source, compiler, CPU)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build_dir() -> Path:
    from ..paths import cache_dir

    return cache_dir() / "kernels"


def _ident(cc: str) -> str:
    """What the built library depends on: the source, the compiler, the CPU it was tuned for."""
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    from ..device import hardware_info

    flags = ""
    try:
        from ..device import isa_flags

        flags = " ".join(isa_flags())
    except Exception:  # noqa: BLE001 - the flags only name the build
        pass
    h = hashlib.sha1()
    for part in (SOURCE.read_bytes(), ver.encode(), hardware_info()["cpu"].encode(), flags.encode(),
                 platform.machine().encode(), sys.platform.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(cc: str, out: Path, extra: tuple = (), source: Path = SOURCE) -> str:
    """Compile the kernel (``source``, by default the product's) into ``out`` (atomically); returns
    "" or why it failed. ``extra``: more compiler flags (the tests build the narrower SIMD variants
    with ``-mno-avx512f``, ``-mno-avx2``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O3", "-march=native", *extra, "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
           "-o", str(tmp), str(source), "-lm"]
    if sys.platform == "darwin":           # Apple clang: OpenMP through torch's libomp is not assumed
        cmd = [c for c in cmd if c != "-fopenmp"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cc} failed: {e}"
    if r.returncode != 0 or not tmp.exists():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        tmp.unlink(missing_ok=True)
        return f"{cc} failed: {last}"
    os.replace(tmp, out)
    return ""


def library():
    """The loaded kernel library, building it on first use; None when it cannot be (``reason()``)."""
    if _Lib.tried:
        return _Lib.handle
    _Lib.tried = True
    if not SOURCE.exists():
        _Lib.reason = f"kernel source missing ({SOURCE})"
        return None
    if sys.platform.startswith("win"):
        _Lib.reason = "no C kernel build on Windows"
        return None
    cc = _compiler()
    if cc is None:
        _Lib.reason = "no C compiler (cc, gcc, clang) on PATH"
        return None
    from ..filelock import file_lock
    from . import trust

    ident = _ident(cc)
    out = _build_dir() / f"blockq-{ident}.so"
    if trust.untrusted(out):            # loaded only as built here (rakv/kernels/trust.py)
        try:
            with file_lock(trust.private_dir(out.parent) / f"{out.stem}.lock"):
                if (not_ours := trust.untrusted(out)) and out.exists():
                    print(f"[rakv] not loading {out}: {not_ours}; building it again", file=sys.stderr)
                if not_ours:
                    print("[rakv] building the block-weight kernel (once per machine) ...", file=sys.stderr)
                    why = _build(cc, out)
                    if why:
                        _Lib.reason = why
                        return None
                    trust.record(out)
        except OSError as e:
            _Lib.reason = f"cannot write {out.parent}: {e}"
            return None
    try:
        lib = _load(out)
    except (OSError, AttributeError) as e:      # AttributeError: a library without the kernel's entry points
        _Lib.reason = f"cannot load {out.name}: {e}"
        return None
    _Lib.handle, _Lib.ident = lib, ident
    return lib


def build_id() -> str:
    """The loaded kernel build's identity ("" when there is none): a profile measured with another
    build of the kernel measured another machine."""
    library()
    return _Lib.ident


def _load(path: Path):
    """The built library at ``path`` with its entry points typed."""
    lib = ctypes.CDLL(str(path))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rakv_linear.argtypes = [vp, vp, i64, vp, vp, i32]
    lib.rakv_linear.restype = None
    lib.rakv_attend.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i64, i64, ctypes.c_float, vp, i32,
                                i64, ctypes.c_float]
    lib.rakv_attend.restype = None
    lib.rakv_check.argtypes = [vp, vp, i64, i64, i32]
    lib.rakv_check.restype = i64
    lib.rakv_blockq_avx512.restype = i32
    lib.rakv_blockq_simd.restype = i32
    lib.rakv_decode_layers.argtypes = [vp, i64, vp, i64, i64, i64, i64, i64, i64, i64, vp, vp,
                                       ctypes.c_float, ctypes.c_float, i32, vp, i64, vp, vp]
    lib.rakv_decode_layers.restype = i32
    lib.rakv_gumbel_argmax.argtypes = [vp, i64, i64, ctypes.c_float, vp, vp, vp, vp, vp]
    lib.rakv_gumbel_argmax.restype = i32
    lib.rakv_q8act_simd.restype = i32
    return lib


def reason() -> str:
    """Why the kernel is not available ("" when it is, or was not tried yet)."""
    return _Lib.reason


# ----------------------------------------------------------------------------- finding the codes
def _fp16_near(x: torch.Tensor, step: int) -> torch.Tensor:
    """The float16 value ``step`` ulps from float16(x) in magnitude (as float32)."""
    h = x.to(torch.float16)
    if step:
        bits = h.view(torch.int16).to(torch.int32) + step
        h = bits.clamp(-32768, 32767).to(torch.int16).view(torch.float16)
    return h.to(torch.float32)


# Why an fp32 check is exact: every candidate scale d is a float16 value (11 significant bits), so
# d * q (q of 4 or 8 bits) is exact in fp32, and torch's separate mul and add round d q + m once,
# as the kernel's fma does. A block is kept only when that rebuild equals the weight bit for bit.
def _q4_try(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """Codes for blocks w [B, 32] under scale d and minimum m [B, 1]: (q [B, 32], ok [B])."""
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m) / safe).clamp_(0, 15)
    q = torch.where(d > 0, q, torch.zeros_like(q))
    ok = ((d * q + m) == w).all(1) & torch.isfinite(d).squeeze(1)
    return q, ok


def _q8_try(w: torch.Tensor, d: torch.Tensor):
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe).clamp_(-128, 127)
    q = torch.where(d > 0, q, torch.zeros_like(q))
    ok = ((d * q) == w).all(1) & torch.isfinite(d).squeeze(1)
    return q, ok


CANDIDATES = {"q4": [(top, step) for top in (15, 14, 13) for step in (0, -1, 1)],
              "q8": [(top, step) for top in (127, 128, 126) for step in (0, -1, 1)]}


def _solve(w: torch.Tensor, kind: str, chunk: int = 1 << 16):
    """Codes (q, d, m) for every block of w [B, 32] fp32, or None when a block has none. GGUF's
    quantizers put q = 0 at a Q4_1 block's minimum and |q| = 127 at a Q8_0 block's largest weight,
    so the scale is (max - min) / 15 or max |w| / 127 as a float16, give or take an ulp."""
    qs, ds, ms = [], [], []
    for s in range(0, w.shape[0], chunk):
        wb = w[s: s + chunk]
        n = wb.shape[0]
        done = torch.zeros(n, dtype=torch.bool)
        q = torch.zeros(n, BLK)
        d = torch.zeros(n, 1)
        lo, hi = wb.min(1, keepdim=True).values, wb.max(1, keepdim=True).values
        amax = wb.abs().max(1, keepdim=True).values
        for j, (top, step) in enumerate(CANDIDATES[kind]):
            todo = ~done
            idx = todo.nonzero().squeeze(1)
            if kind == "q4":
                dc = _fp16_near((hi[idx] - lo[idx]) / top, step)
                qc, ok = _q4_try(wb[idx], dc, lo[idx])
            else:
                dc = _fp16_near(amax[idx] / top, step)
                qc, ok = _q8_try(wb[idx], dc)
            got = idx[ok]
            if s == 0 and j == 0 and got.numel() < n // 2:
                return None               # not this code: a coded weight fits its first guess almost everywhere
            q[got], d[got] = qc[ok], dc[ok]
            done[got] = True
            if bool(done.all()):
                break
        if not bool(done.all()):
            return None
        qs.append(q)
        ds.append(d)
        ms.append(lo)
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


KIND_CODES = {"q4": 4, "q8": 8, "q8x": 9}     # rakv_layer.kind in blockq.c


class DecoderLayerDesc(ctypes.Structure):
    """``rakv_dlayer`` in kernels/blockq.c: one decoder layer for ``decode_layers``."""
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("cap", ctypes.c_int64), ("window", ctypes.c_int64),
                ("q_part", ctypes.c_void_p), ("k_part", ctypes.c_void_p), ("v_part", ctypes.c_void_p),
                ("gate_part", ctypes.c_void_p), ("up_part", ctypes.c_void_p)]


def layer_ref(bw: "BlockWeight") -> int:
    """The address of ``bw``'s ``rakv_layer`` description (made once, kept by ``bw``)."""
    if bw._fn is None:
        bw._bind()
    return ctypes.addressof(bw._desc)


def decode_layers(descs, n_layers: int, x: torch.Tensor, n: int, H: int, Hq: int, Hk: int, D: int, I: int,
                  past: int, cos: torch.Tensor, sin: torch.Tensor, eps: float, scale: float,
                  path: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                  final_w: torch.Tensor | None = None) -> None:
    """Run ``n_layers`` decoder layers (``descs``: a ctypes array of DecoderLayerDesc) on x [n, H]
    in place, the n rows at positions past .. past + n - 1 (cos, sin [n, D] contiguous: each row's
    own), their KV written into the layers' buffers at past + row (``kernels/blockq.c``
    rakv_decode_layers). ``path``, ``depth``: the rows are a token tree (see ``attend_tree``).
    ``final_w`` [H] (float32, contiguous): then the model's final RMSNorm too, with ``eps``."""
    if path is not None:
        path, depth = path.contiguous(), depth.contiguous()
    rc = _Lib.handle.rakv_decode_layers(ctypes.addressof(descs), n_layers, x.data_ptr(), n, H, Hq, Hk, D, I,
                                        past, cos.data_ptr(), sin.data_ptr(), eps, scale,
                                        torch.get_num_threads(), None if path is None else path.data_ptr(),
                                        0 if path is None else path.stride(0),
                                        None if depth is None else depth.data_ptr(),
                                        None if final_w is None else final_w.data_ptr())
    if rc:
        raise MemoryError("decode_layers: out of memory")


class _LayerDesc(ctypes.Structure):
    """``rakv_layer`` in kernels/blockq.c."""
    _fields_ = [("kind", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("numerics", ctypes.c_int64), ("isc", ctypes.c_void_p), ("imn", ctypes.c_void_p),
                ("dg", ctypes.c_void_p), ("mg", ctypes.c_void_p),
                ("tq", ctypes.c_void_p), ("tsc", ctypes.c_void_p), ("tmn", ctypes.c_void_p),
                ("tdg", ctypes.c_void_p), ("tmg", ctypes.c_void_p)]

TILE = 16       # outputs a tile of the tiled K-quant form (blockq.c)


def _by_tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [T, G, 16]: per tile of 16 outputs, each column's 16 values together (zero past N)."""
    N = t.shape[0]
    pad = -N % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, TILE, *t.shape[1:]).transpose(1, 2).contiguous()


def tiled(b: "BlockWeight") -> dict:
    """The tiled K-quant form of ``b``'s codes and integer scales (blockq.c, "tiled K-quant codes"):
    per tile of 16 outputs and block of 32 (Q4) or group of 16 (Q8X) inputs, 4 quads of 64 bytes, byte
    4 j + i of quad v holding output j's code of input 4 v + i (Q4: and of 16 + 4 v + i, high nibble)."""
    N, nb = b.N, b.K // BLK
    if b.kind == "q4":
        q = b.qs.reshape(N, nb, 4, 4)                      # byte 4 v + i: inputs 4 v + i and 16 + 4 v + i
    elif b.kind == "q8":
        q = (b.qs.view(torch.uint8) ^ 0x80).reshape(N, nb, 8, 4)     # q + 128, unsigned; 8 quads a block
    else:
        q = b.qs.reshape(N, 2 * nb, 4, 4)                  # the 16 codes of a group in order
    nv = q.shape[2]
    tq = _by_tiles(q.reshape(N, q.shape[1], -1)).reshape(-1, q.shape[1], TILE, nv, 4).transpose(2, 3).contiguous()
    if not b.compact:                                      # a float scale (and offset) per block
        d, m = b.scales()
        return {"tq": tq, "tdg": _by_tiles(d), **({"tmg": _by_tiles(m)} if b.kind == "q4" else {})}
    out = {"tq": tq, "tsc": _by_tiles(b.isc), "tdg": _by_tiles(b.dg.float())}
    if b.kind == "q4":
        mn = b.imn.to(torch.int16)
        if mn.shape[1] % 2:
            mn = torch.cat([mn, mn.new_zeros(N, 1)], 1)
        out.update(tmn=_by_tiles(mn.reshape(N, -1, 2)), tmg=_by_tiles(b.mg.float()))    # int16 pairs of blocks
    return out


def tiles(b: "BlockWeight") -> bool:
    """Whether q8 numerics run ``b`` in the tiled form: K-quant codes, and Q4 / Q8 codes with a float
    scale per block (Q8X codes with float scales per 16 keep the lane form), unless ``b`` was made
    for the lane form (``b.lanes``: ``RAKV_TILES=0`` as read when its q8 codes were made, at load)."""
    return (b.compact or b.kind in ("q4", "q8")) and not b.lanes


def tiles_env_enabled() -> bool:
    """``RAKV_TILES`` (on unless 0): read when q8 codes are made (at load), never at a call."""
    return os.environ.get("RAKV_TILES", "1") != "0"


NUMERICS = ("fp32", "q8")       # rakv_layer.numerics in blockq.c: 0, 1
TILE_FIELDS = ("tq", "tsc", "tmn", "tdg", "tmg")


def _tiles_fit(b: "BlockWeight", t: dict) -> bool:
    """Whether ``t`` (tiles read back from a file) has the fields and shapes ``tiled(b)`` makes."""
    T, nb = (b.N + TILE - 1) // TILE, b.K // BLK
    nv = {"q4": (nb, 4), "q8": (nb, 8), "q8x": (2 * nb, 4)}[b.kind]
    need = {"tq", "tdg"} | ({"tsc"} if b.compact else set()) | ({"tmn", "tmg"} if b.kind == "q4" and b.compact else set()) \
        | ({"tmg"} if b.kind == "q4" and not b.compact else set())
    return set(t) == need and tuple(t["tq"].shape) == (T, nv[0], nv[1], TILE, 4)


def attach_tiles(named: dict, key: str) -> dict:
    """Give every q8 block of ``named`` ({name: BlockWeight}, each block once) its tiled form from
    the cache dir: a safetensors file per model key, memory-mapped, so the pages are the file's
    (shared, reclaimable) and a first request does not tile. Made and saved once where missing,
    then read back from the file. Returns {"tiled": blocks, "made": made now, "bytes": file size}."""
    want = {n: b for n, b in named.items() if b.numerics == "q8" and tiles(b)}
    info = {"tiled": 0, "made": 0, "bytes": 0}
    if not want or not key:
        return info
    path = _cache_path(key + "+tiles")
    loaded = _read_tiles(path)
    missing = [n for n in want if not _tiles_fit(want[n], {k: loaded[f"{n}.{k}"] for k in TILE_FIELDS
                                                            if f"{n}.{k}" in loaded})]
    if missing:
        tensors = {f"{n}.{k}": v for n in want
                   for k, v in (tiled(want[n]) if n in missing else
                                {k: loaded[f"{n}.{k}"] for k in TILE_FIELDS if f"{n}.{k}" in loaded}).items()}
        info["made"] = len(missing)
        if _write_tiles(path, tensors):
            loaded = _read_tiles(path)          # the file's pages, not the copies just made
        else:                                   # a read-only cache dir: the copies in memory
            loaded = tensors
    for n, b in want.items():
        t = {k: loaded[f"{n}.{k}"] for k in TILE_FIELDS if f"{n}.{k}" in loaded}
        if _tiles_fit(b, t):
            b._tiled, b._fn, b._ref = t, None, None     # bound again at the next call
            info["tiled"] += 1
    info["bytes"] = path.stat().st_size if path.exists() else 0
    return info


_ST_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F32": torch.float32}


def _read_tiles(path: Path) -> dict:
    """The tensors of a safetensors file as views of one private memory map of it (its pages the
    file's until written, which nothing does): {} where missing or damaged."""
    try:
        if not path.exists():
            return {}
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                return {}
            header = json.loads(f.read(n))
        mem = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        flat = torch.empty(0, dtype=torch.uint8).set_(mem)
        out = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            dt = _ST_DTYPES[spec["dtype"]]
            a, b = (8 + n + int(o) for o in spec["data_offsets"])
            if not a <= b <= size:
                return {}
            out[name] = flat[a:b].view(dt).view(spec["shape"]) if b > a else torch.empty(spec["shape"], dtype=dt)
        return out
    except Exception:  # noqa: BLE001 - a damaged file is made again
        return {}


def _write_tiles(path: Path, tensors: dict) -> bool:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


@dataclass
class BlockWeight:
    """One linear layer's weight W [N, K] as block codes (see the module docstring)."""

    kind: str                      # "q4" | "q8" | "q8x"
    N: int
    K: int
    qs: torch.Tensor               # q4: uint8 [N, K/32, 16] (input j low nibble, j + 16 high); q8: int8 [N, K/32, 32];
                                   # q8x: uint8 [N, K/32, 32]
    d: torch.Tensor | None         # float32 [N, K/32] (q8x: [N, K/16], a scale per 16 inputs); None in K-quant
                                   # codes read back from a file (``scales`` makes d and m from isc .. mg)
    m: torch.Tensor | None         # float32, as d (q4 and q8x; None for q8)
    numerics: str = "fp32"         # "fp32": the fp32 linear of the rebuilt weights; "q8": integer dot
                                   # products with 8-bit activation blocks (blockq.c, "q8 numerics")
    # K-quant scales as the file holds them (from_gguf of Q4_K / Q6_K; None otherwise): q8 numerics then
    # read these instead of d and m (D = dg sc, M = mg mn for q4; D = dg sc, M = -32 D for q8x), so a
    # decode step streams 4.75 (Q4_K) or 8.6 (Q6_K) bits a weight instead of 6 or 12, the same values
    isc: torch.Tensor | None = None    # q4: uint8 [N, K/32]; q8x: int8 [N, K/16]
    imn: torch.Tensor | None = None    # q4: uint8 [N, K/32] (the minimums' 6-bit multipliers)
    dg: torch.Tensor | None = None     # float32 [N, K/256]: the super-block scale d
    mg: torch.Tensor | None = None     # q4: float32 [N, K/256], -dmin
    lanes: bool = False                # q8 numerics in the lane form, not the tiled one (``tiles``): fixed
                                       # when the q8 codes are made (``with_numerics``), from RAKV_TILES at load

    @property
    def nbytes(self) -> int:
        if self.d is None:
            return sum(t.numel() * t.element_size() for t in (self.qs, *self._extra().values()) if t is not None)
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def scales(self) -> tuple:
        """(d, m) as the fp32 arithmetic reads them; K-quant codes kept without them (``save_codes``
        drops them: q8 arithmetic reads the file's own scales) get them made once from isc .. mg:
        the same floats from_gguf made (a float16 times a small integer; m = -dmin mn, or -32 d)."""
        if self.d is None:
            nb = self.K // BLK
            if self.kind == "q4":
                dg = self.dg.repeat_interleave(QK_K // BLK, 1)[:, :nb]
                mg = self.mg.repeat_interleave(QK_K // BLK, 1)[:, :nb]
                self.d, self.m = (dg * self.isc.float()).contiguous(), (mg * self.imn.float()).contiguous()
            else:                                            # q8x: Q6_K's int8 scales per 16 inputs
                dg = self.dg.repeat_interleave(QK_K // 16, 1)[:, :2 * nb]
                self.d = (dg * self.isc.float()).contiguous()
                self.m = (-32.0 * self.d).contiguous()
            self._fn = None                                  # described again with them
        return self.d, self.m

    @property
    def compact(self) -> bool:
        return self.isc is not None

    @property
    def streamed_bytes(self) -> int:
        """What one pass over this layer reads in its numerics (q8 with K-quant scales: codes and scales)."""
        if self.numerics == "q8" and self.compact:
            return sum(t.numel() * t.element_size() for t in (self.qs, self.isc, self.imn, self.dg, self.mg)
                       if t is not None)
        return self.nbytes

    def _extra(self) -> dict:
        return {"isc": self.isc, "imn": self.imn, "dg": self.dg, "mg": self.mg}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 -> [..., N]: the fp32 linear of the rebuilt weights (+ bias)."""
        fn = self._fn or self._bind()
        if not x.is_contiguous():
            x = x.contiguous()
        y = x.new_empty((*x.shape[:-1], self.N))
        fn(self._ref, x.data_ptr(), x.numel() // self.K, y.data_ptr(),
           None if bias is None else bias.data_ptr(), torch.get_num_threads())
        return y

    _fn = None
    _ref = None
    _tiled = None          # q8 numerics on K-quant codes: the tiled form (``tiled``), made at the first call

    def __deepcopy__(self, memo):
        return self          # read-only codes, shared (a copy would keep a description of these tensors)

    def _bind(self):
        """The kernel's entry and this layer's description for it (made once: a call then passes
        six plain arguments)."""
        if self.d is None and not (self.numerics == "q8" and self.compact):
            self.scales()                                    # fp32 arithmetic reads d and m
        d = self.d.data_ptr() if self.d is not None else None      # (q8 on K-quant scales: never read)
        if self.numerics == "q8" and tiles(self) and self._tiled is None:
            self._tiled = tiled(self)
        tl = self._tiled if self.numerics == "q8" and tiles(self) else {}
        self._desc = _LayerDesc(KIND_CODES[self.kind], self.N, self.K, self.qs.data_ptr(),
                                d, self.m.data_ptr() if self.m is not None else d,
                                NUMERICS.index(self.numerics),
                                *(t.data_ptr() if t is not None else None for t in (self.isc, self.imn, self.dg, self.mg)),
                                *(tl[k].data_ptr() if k in tl else None for k in ("tq", "tsc", "tmn", "tdg", "tmg")))
        self._ref = ctypes.byref(self._desc)
        self._fn = library().rakv_linear
        return self._fn

    def rebuilds(self, w: torch.Tensor) -> bool:
        """Whether these codes rebuild ``w`` [N, K] (float32, CPU, any strides) exactly, element by
        element as ``encode`` checks: one streaming pass in the kernel (a dequantized copy without it)."""
        if (self.N, self.K) != tuple(w.shape) or w.dtype != torch.float32 or w.device.type != "cpu":
            return False
        if library() is None:
            return torch.equal(self.dequantize(), w)
        self._fn or self._bind()
        return _Lib.handle.rakv_check(self._ref, w.data_ptr(), w.stride(0), w.stride(1),
                                      torch.get_num_threads()) == 0

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 rebuilt from the codes (what the kernel multiplies by)."""
        self.scales()
        d = self.d.unsqueeze(-1)
        if self.kind == "q4":
            q = torch.cat([self.qs & 15, self.qs >> 4], -1).float()
            w = d * q + self.m.unsqueeze(-1)          # d q is exact: one rounding, as the fma's
        elif self.kind == "q8x":                      # (GGUF's codes: d q exact too)
            w = d * self.qs.reshape(self.N, -1, BLK // 2).float() + self.m.unsqueeze(-1)
        else:
            w = d * self.qs.float()
        return w.reshape(self.N, self.K)

    def rows(self, index) -> "BlockWeight":
        """The codes of the rows ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return BlockWeight(self.kind, int(idx.numel()), self.K, self.qs[idx].contiguous(),
                           None if self.d is None else self.d[idx].contiguous(),
                           None if self.m is None else self.m[idx].contiguous(), self.numerics,
                           **{k: None if t is None else t[idx].contiguous() for k, t in self._extra().items()},
                           lanes=self.lanes)

    def with_numerics(self, numerics: str, lanes: bool | None = None) -> "BlockWeight":
        """The same codes under another arithmetic (``NUMERICS``), sharing the tensors. ``lanes``
        (q8): the lane form instead of the tiled one (None: as ``RAKV_TILES`` says now; a load passes
        what it read once)."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, not {numerics!r}")
        lanes = (not tiles_env_enabled() if lanes is None else bool(lanes)) if numerics == "q8" else False
        if numerics == self.numerics and lanes == self.lanes:
            return self
        return BlockWeight(self.kind, self.N, self.K, self.qs, self.d, self.m, numerics, **self._extra(), lanes=lanes)

    @property
    def all_rows(self) -> bool:
        """Whether every row count runs from the codes: under q8 numerics a long prefill must compute
        what the same rows compute one by one (fp32 codes hand long prefills to oneDNN)."""
        return self.numerics == "q8"


@torch.no_grad()
def encode(weight: torch.Tensor) -> BlockWeight | None:
    """Block codes that rebuild ``weight`` [N, K] (float32, CPU) bit for bit, Q4 tried before Q8;
    None when it has none (or is not a float32 CPU matrix with K a multiple of 32)."""
    w = weight.detach()
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % BLK \
            or w.numel() < MIN_PARAMS or not bool(torch.isfinite(w).all()):
        return None
    N, K = (int(s) for s in w.shape)
    blocks = w.reshape(-1, BLK)
    for kind in ("q4", "q8"):
        got = _solve(blocks, kind)
        if got is None:
            continue
        q, d, m = got
        if kind == "q4":
            q = q.to(torch.uint8).view(N, K // BLK, BLK)
            qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()
        else:
            qs = q.to(torch.int8).view(N, K // BLK, BLK).contiguous()
        return BlockWeight(kind, N, K, qs, d.to(torch.float32).view(N, K // BLK).contiguous(),
                           m.to(torch.float32).view(N, K // BLK).contiguous() if kind == "q4" else None)
    return None


# ----------------------------------------------------------------------------- codes read from a GGUF
# A GGUF tensor's blocks are codes already: each format's weights are exactly fma(D, q, M) for a small
# unsigned code q and a scale D and offset M per 16 or 32 inputs, with D q exact in fp32 (D is a
# float16 times at most a 7-bit integer, q at most 6 bits), so the one rounding is the fma's, as in
# the GGUF dequantizer (gguf.quants, transformers' loader). Q4_0, Q4_1, Q4_K become q4 codes; Q5_0 and
# Q8_0 q8; Q5_1, Q2_K, Q3_K, Q5_K, Q6_K q8x (a scale and an offset per 16 inputs). What they rebuild
# is still checked against the loaded weights element by element (``BlockWeight.rebuilds``).
QK_K = 256
GGUF_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
              "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
              "Q6_K": (QK_K, 210)}


def _f16(b):
    import numpy as np

    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)      # [n, 2] bytes -> [n, 1]


def _bits(b, shifts, mask):
    """b [n, c] bytes -> [n, len(shifts), c]: (b >> s) & mask for each shift."""
    import numpy as np

    return (b[:, None, :] >> np.asarray(shifts, dtype=np.uint8)[None, :, None]) & np.uint8(mask)


def _k_scale_min(scales):
    """Q4_K / Q5_K: the 8 six-bit scales and minimums packed in 12 bytes (gguf.quants.Q4_K)."""
    import numpy as np

    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _gguf_parts(b, qtype: str):
    """Blocks b [n, type size] -> (q [n, block], D [n, groups], M [n, groups] or None, signed): w =
    fma(D, q, M) (w = D q when M is None, q then signed) with groups of 16 or 32 inputs."""
    import numpy as np

    n = b.shape[0]
    if qtype == "Q8_0":
        return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, True
    if qtype in ("Q4_0", "Q4_1"):
        off = 2 if qtype == "Q4_0" else 4
        q = _bits(b[:, off:off + 16], [0, 4], 15).reshape(n, 32)
        d = _f16(b[:, :2])
        return q, d, (-8 * d if qtype == "Q4_0" else _f16(b[:, 2:4])), False
    if qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        qh = ((np.ascontiguousarray(b[:, off:off + 4]).view(np.uint32)
               >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)
        q = _bits(b[:, off + 4:off + 20], [0, 4], 15).reshape(n, 32) | (qh << 4)
        d = _f16(b[:, :2])
        if qtype == "Q5_0":
            return (q.astype(np.int16) - 16).astype(np.int8), d, None, True
        return q, d, _f16(b[:, 2:4]), False
    if qtype == "Q2_K":
        sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
        q = _bits(qs.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, QK_K)
        return q, d * (sc & 0xF).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32)), False
    if qtype == "Q3_K":
        hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        lo = _bits(scales[:, :8], [0, 4], 0xF).reshape(n, 16)
        hi = _bits(scales[:, 8:12], [0, 2, 4, 6], 3).reshape(n, 16)
        D = d * ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
        ql = _bits(qs.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, QK_K)
        h = _bits(hmask, list(range(8)), 1).reshape(n, QK_K)
        return ql + (h << 2), D, -4 * D, False               # q - 4 (h = 0) or q (h = 1): ql + 4 h - 4
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        if qtype == "Q4_K":
            q = _bits(b[:, 16:144].reshape(n * 4, 32), [0, 4], 15).reshape(n, QK_K)
        else:
            ql = _bits(b[:, 48:176].reshape(n * 4, 32), [0, 4], 15).reshape(n, QK_K)
            q = ql | (_bits(b[:, 16:48], list(range(8)), 1).reshape(n, QK_K) << 4)
        return q, d * sc, -(dmin * mn), False
    if qtype == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        lo = _bits(ql.reshape(n * 2, 64), [0, 4], 15).reshape(n, 2, 2, 64).reshape(n, 8, 32)
        hi = _bits(qh.reshape(n * 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
        D = d * sc.copy().view(np.int8).astype(np.float32)
        return (lo | (hi << 4)).reshape(n, QK_K), D, -32 * D, False
    return None


def from_gguf(data, qtype: str, N: int, K: int) -> BlockWeight | None:
    """The codes of a GGUF tensor (its raw blocks ``data``, ``qtype`` a GGML type name such as
    "Q4_K") as the weight W [N, K] the GGUF dequantizer gives, rows in the file's order; None for a
    type it does not read or a shape that is not whole blocks."""
    import numpy as np

    if qtype not in GGUF_BLOCK or K % BLK or N <= 0:
        return None
    bs, ts = GGUF_BLOCK[qtype]
    raw = np.ascontiguousarray(np.asarray(data).view(np.uint8).reshape(-1))
    if K % bs or raw.size != N * (K // bs) * ts:
        return None
    q, D, M, signed = _gguf_parts(raw.reshape(-1, ts), qtype)
    if not (np.isfinite(D).all() and (M is None or np.isfinite(M).all())):
        return None
    extra = _kquant_scales(raw.reshape(-1, ts), qtype, N, K)
    q = q.reshape(N, K // BLK, BLK)
    groups = D.size // (N * (K // BLK))               # scales per 32 inputs: 1 or 2
    D, M = D.reshape(N, -1), None if M is None else M.reshape(N, -1)
    t = torch.from_numpy
    if signed:
        return BlockWeight("q8", N, K, t(q.astype(np.int8)).contiguous(), t(D).contiguous(), None)
    if groups == 1 and int(q.max(initial=0)) <= 15:
        qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
        return BlockWeight("q4", N, K, t(qs).contiguous(), t(D).contiguous(), t(M).contiguous(),
                           **(extra if qtype == "Q4_K" else {}))
    if groups == 1:
        D, M = np.repeat(D, 2, axis=1), np.repeat(M, 2, axis=1)
    return BlockWeight("q8x", N, K, t(q.astype(np.uint8)).contiguous(), t(np.ascontiguousarray(D)),
                       t(np.ascontiguousarray(M)), **(extra if qtype == "Q6_K" else {}))


def _kquant_scales(b, qtype: str, N: int, K: int) -> dict:
    """Q4_K: the 6-bit scales and minimums per 32 and d, -dmin per 256; Q6_K: the int8 scales per 16
    and d per 256 (``BlockWeight.isc`` ...), as torch tensors by row; {} for any other type."""
    import numpy as np

    t = torch.from_numpy
    if qtype == "Q4_K":
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        return {"isc": t(sc.astype(np.uint8).reshape(N, K // BLK)).contiguous(),
                "imn": t(mn.astype(np.uint8).reshape(N, K // BLK)).contiguous(),
                "dg": t(d.reshape(N, K // QK_K)).contiguous(), "mg": t((-dmin).reshape(N, K // QK_K)).contiguous()}
    if qtype == "Q6_K":
        return {"isc": t(b[:, 192:208].copy().view(np.int8).reshape(N, K // 16)).contiguous(),
                "dg": t(_f16(b[:, 208:210]).reshape(N, K // QK_K)).contiguous()}
    return {}


# ----------------------------------------------------------------------------- attention
def attend_ok(k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int, D: int, any_rows: bool = False,
              enabled: bool | None = None) -> bool:
    """Whether ``attend`` takes this step: a float32 cache of batch 1 with rows of D contiguous
    values (the lean forward's growing buffer, or a prefill's own KV), at most ATTEND_ROWS new rows
    (``any_rows``: any number, as q8 numerics run every forward). ``enabled``: the RAKV_BLOCKQ switch
    as the backend read it at load (the lean forward passes it); None reads it now (direct calls)."""
    return ((any_rows or n <= ATTEND_ROWS) and D % 16 == 0 and Hq % Hk == 0 and k.dtype == torch.float32
            and k.device.type == "cpu" and k.shape[0] == 1 and v.shape[0] == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == D and v.stride(-2) == D
            and library() is not None and (env_enabled() if enabled is None else enabled))


def attend(q: torch.Tensor, q_row: int, k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int,
           D: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the n newest positions, their queries at ``q`` (row i, head h at element
    i * q_row + h * D; contiguous rows), over k, v [1, Hk, past + n, D]: out [1, n, Hq * D], each
    (row, head) computed alone in an order that does not depend on n (``kernels/blockq.c``).
    ``window`` > 0: a row sees only its last ``window`` positions (a sliding-window layer);
    ``softcap`` > 0: scores capped as tanh(s / softcap) softcap (Gemma 2)."""
    past = k.shape[-2] - n
    out = torch.empty(1, n, Hq * D)
    _Lib.handle.rakv_attend(q.data_ptr(), n, Hq, D, q_row, k.data_ptr(), k.stride(1), v.data_ptr(),
                            v.stride(1), Hk, past, scale, out.data_ptr(), torch.get_num_threads(),
                            int(window or 0), float(softcap or 0.0))
    return out


def _tree_fn():
    """``rakv_attend_tree`` with its arguments typed (once)."""
    fn = _Lib.handle.rakv_attend_tree
    if fn.restype is not None or not fn.argtypes:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i64, i64, ctypes.c_float, vp, ctypes.c_int,
                       i64, ctypes.c_float, vp, i64, vp]
        fn.restype = None
    return fn


def attend_tree(q: torch.Tensor, q_row: int, k: torch.Tensor, v: torch.Tensor, n: int, Hq: int, Hk: int,
                D: int, scale: float, path: torch.Tensor, depth: torch.Tensor, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
    """Tree attention of the n newest positions (a token tree after the cache): as ``attend``, but
    row i sees the cached positions 0..past-1, then its ancestors' rows root first, then itself
    (``path`` [n, P] int64: row i's ancestry rows path[i, 0..depth[i]], ending with i; ``depth`` [n]
    int64), in that order: the keys a decode step of the same token sees, with the same arithmetic,
    so a tree row equals that decode step bit for bit. ``window`` counts positions (row i's is
    past + depth[i]). out [1, n, Hq * D]."""
    past = k.shape[-2] - n
    out = torch.empty(1, n, Hq * D)
    path, depth = path.contiguous(), depth.contiguous()
    _tree_fn()(q.data_ptr(), n, Hq, D, q_row, k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1), Hk, past,
               scale, out.data_ptr(), torch.get_num_threads(), int(window or 0), float(softcap or 0.0),
               path.data_ptr(), path.stride(0), depth.data_ptr())
    return out


# ----------------------------------------------------------------------------- a model's layers
def _cache_path(key: str) -> Path:
    from ..paths import cache_dir

    return cache_dir() / "blockq" / (hashlib.sha1(key.encode()).hexdigest()[:20] + ".safetensors")


def _load_cached(path: Path) -> dict[str, BlockWeight | None]:
    try:
        from safetensors.torch import load_file
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception:  # noqa: BLE001 - a missing or damaged cache is made again
        return {}
    out: dict[str, BlockWeight | None] = {}
    aliases = {}
    for name, spec in meta.items():
        if spec == "none":
            out[name] = None
            continue
        if spec.startswith("alias:"):                 # a weight shared by two modules: saved once
            aliases[name] = spec[6:]
            continue
        kind, N, K = spec.split(":")
        out[name] = BlockWeight(kind, int(N), int(K), tensors[f"{name}.qs"], tensors.get(f"{name}.d"),
                                tensors.get(f"{name}.m"), "fp32",
                                **{k: tensors.get(f"{name}.{k}") for k in ("isc", "imn", "dg", "mg")})
    for name, of in aliases.items():
        if of not in out:
            return {}                                 # damaged: made again
        out[name] = out[of]
    return out


def _save_cached(path: Path, codes: dict[str, BlockWeight | None]) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    first: dict[int, str] = {}
    for name, b in codes.items():
        if b is None:
            meta[name] = "none"
            continue
        if id(b) in first:
            meta[name] = f"alias:{first[id(b)]}"
            continue
        first[id(b)] = name
        meta[name] = f"{b.kind}:{b.N}:{b.K}"
        tensors[f"{name}.qs"] = b.qs
        if not b.compact:                     # K-quant codes: d and m are made from their scales
            tensors[f"{name}.d"] = b.d
            if b.m is not None:
                tensors[f"{name}.m"] = b.m
        for k, v in b._extra().items():
            if v is not None:
                tensors[f"{name}.{k}"] = v
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError:                  # a read-only cache dir: the codes are found again next time
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _matrix(fl) -> torch.Tensor:
    w = fl.weight.detach()
    return w.t() if fl.transposed else w                     # [N, K] (GPT-2's Conv1D stores [K, N])


_MISSING = object()


def load_codes(path: Path) -> dict[str, BlockWeight | None]:
    """Codes saved by ``save_codes`` ({} when the file is missing or damaged)."""
    return _load_cached(Path(path)) if Path(path).exists() else {}


def save_codes(path: Path, codes: dict[str, BlockWeight | None]) -> None:
    """Save codes by layer name (safetensors, atomically; a read-only place keeps nothing)."""
    _save_cached(Path(path), codes)


def attach(fls: list, key: str = "", offered: dict | None = None, trusted: bool = False,
           enabled: bool | None = None) -> dict:
    """Give every fast-path linear in ``fls`` ([(name, FastLinear)], ``fastpath.attach_codes``)
    whose weight is block-coded its codes (``.block``), taken from the cache dir when a saved copy
    still rebuilds the weight exactly, else from ``offered`` (codes by layer name, e.g. read from
    the model's GGUF) when they do, else found and saved. Returns what it did: ``{"layers":
    coded, "of": linears, "bytes": codes' size, "fp32_bytes": those weights in fp32, "kinds":
    {...}, "reason": why none}``. ``trusted``: the offered codes ARE the weights (a slim converted
    GGUF, whose coded linears keep no fp32 weights to check them against, see models._materialize):
    taken as they are."""
    for _, m in fls:
        if m._weight_version() != m._version:      # changed in place since packed: pack it as it is now
            m.repack()
        m.block = None
    info = {"layers": 0, "of": len(fls), "bytes": 0, "fp32_bytes": 0, "kinds": {}, "reason": ""}
    if not fls:
        info["reason"] = "not on the fast path"
        return info
    if not (env_enabled() if enabled is None else enabled):      # (the load passes what it read)
        info["reason"] = "RAKV_BLOCKQ=0"
        return info
    if library() is None:
        info["reason"] = f"kernel unavailable: {reason()}"
        return info
    path = _cache_path(key) if key else None
    saved = _load_cached(path) if path is not None and path.exists() else {}
    codes: dict[str, BlockWeight | None] = {}
    fresh = False
    seen: dict[int, BlockWeight | None] = {}                 # a weight shared by two modules (tied)
    for name, m in fls:
        w = _matrix(m)
        if id(m.weight) in seen:
            b = seen[id(m.weight)]
        elif trusted and (offered or {}).get(name) is not None:
            b = offered[name]
        else:
            b = saved.get(name, _MISSING)
            good = b is not _MISSING and (b is None or b.rebuilds(w))
            o = (offered or {}).get(name)
            better = o is not None and o.compact and (b is _MISSING or b is None or not b.compact)
            if (not good or b is None or better) and o is not None and o.rebuilds(w):
                b, fresh = o, True                           # the file's own codes (any GGUF type)
            elif not good:
                b, fresh = encode(w), True                   # none saved, or not this weight's
        seen[id(m.weight)] = b
        codes[name] = b
        m.block = b
        if b is not None:
            info["layers"] += 1
            info["bytes"] += b.nbytes
            info["fp32_bytes"] += w.numel() * 4
            info["kinds"][b.kind] = info["kinds"].get(b.kind, 0) + 1
    if not info["layers"]:
        info["reason"] = "no layer's weights are block-coded"
    if path is not None and fresh and info["layers"]:
        _save_cached(path, codes)
    return info


class CodedEmbedding(torch.nn.Embedding):
    """An embedding table held as block codes (``block``; a slim load's, see models._from_slim):
    while its weight is unmade (a placeholder) a lookup dequantizes just the rows asked for, the same
    values F.embedding would read from the made table."""

    block: BlockWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., H] float32."""
        w = self.weight
        if self.block is None or not (w.numel() > 1 and all(st == 0 for st in w.stride())):
            return torch.nn.functional.embedding(ids, w)
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        return self.block.rows(flat).dequantize().to(w.device).reshape(*ids.shape, self.block.K)


def concat(blocks: list) -> BlockWeight | None:
    """The codes of layers stacked along their outputs (a fused q|k|v), when all have codes of one kind."""
    if not blocks or any(b is None for b in blocks) or len({(b.kind, b.K) for b in blocks}) != 1:
        return None
    if len({(b.numerics, b.lanes) for b in blocks}) != 1:
        return None
    b0 = blocks[0]
    extra = {}
    if all(b.compact for b in blocks) and len({b.imn is None for b in blocks}) == 1:
        extra = {k: torch.cat([b._extra()[k] for b in blocks]) for k, v in b0._extra().items() if v is not None}
    if not extra or any(b.d is not None for b in blocks):
        for b in blocks:
            b.scales()
    d = None if any(b.d is None for b in blocks) else torch.cat([b.d for b in blocks])
    m = torch.cat([b.m for b in blocks]) if d is not None and b0.m is not None else None
    return BlockWeight(b0.kind, sum(b.N for b in blocks), b0.K, torch.cat([b.qs for b in blocks]), d, m,
                       b0.numerics, **extra, lanes=b0.lanes)


def parts_of(fused: BlockWeight, sizes: list) -> list:
    """The codes of stacked layers (``concat``'s result) part by part, as views of its tensors (rows
    n0..n1 of each): the parts then keep no copy of their own."""
    out, n0 = [], 0
    for n in sizes:
        sl = {k: None if t is None else t[n0:n0 + n] for k, t in fused._extra().items()}
        out.append(BlockWeight(fused.kind, n, fused.K, fused.qs[n0:n0 + n], None if fused.d is None else fused.d[n0:n0 + n],
                               None if fused.m is None else fused.m[n0:n0 + n], fused.numerics, **sl,
                               lanes=fused.lanes))
        n0 += n
    return out


@torch.no_grad()
def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 codes of ``weight`` [N, K] (K a multiple of 32) as llama.cpp quantizes a tensor to Q8_0:
    per block of 32, d = float16(max |w| / 127), q = round(w / d). Under q8 numerics these codes ARE
    the layer (a weight that has no codes of its own: an fp32 checkpoint, a tied head)."""
    w = weight.detach().float().reshape(weight.shape[0], -1, BLK)
    N, nb = w.shape[0], w.shape[1]
    d = (w.abs().amax(-1) / 127.0).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe.unsqueeze(-1)).clamp_(-127, 127)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return BlockWeight("q8", N, nb * BLK, q.to(torch.int8).contiguous(), d.contiguous(), None)


@torch.no_grad()
def quantize_q4_1(weight: torch.Tensor) -> BlockWeight:
    """Q4_1 codes of ``weight`` [N, K] (K a multiple of 32) as llama.cpp quantizes to Q4_1: per block
    of 32, m = float16(min w), d = float16((max w - m) / 15), q = round((w - m) / d) in 0 .. 15.
    A draft's codes made narrower (``models.narrow_draft``): a step streams 6 bits a weight instead
    of 9 for Q8_0 or Q5_0 codes; the draft changes, every policy stays exact (the target verifies)."""
    w = weight.detach().float().reshape(weight.shape[0], -1, BLK)
    N, nb = w.shape[0], w.shape[1]
    lo, hi = w.amin(-1), w.amax(-1)
    m = lo.to(torch.float16).float()
    d = ((hi - m) / 15.0).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q)).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()              # input j low nibble, j + 16 high
    return BlockWeight("q4", N, nb * BLK, qs, d.contiguous(), m.contiguous())


def narrower_q4(b: BlockWeight, rows: int = 8192) -> BlockWeight:
    """``b`` as Q4_1 codes of its own weights (rows at a time: no whole fp32 copy), under b's
    numerics; ``b`` itself where its codes are 4-bit already."""
    if b.kind == "q4":
        return b
    parts = [quantize_q4_1(b.rows(torch.arange(r0, min(r0 + rows, b.N))).dequantize()) for r0 in range(0, b.N, rows)]
    out = BlockWeight("q4", b.N, b.K, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                      torch.cat([p.m for p in parts]))
    return out.with_numerics(b.numerics, lanes=b.lanes)
