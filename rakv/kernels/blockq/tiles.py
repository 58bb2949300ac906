"""The tiled form of q8 codes (blockq.c, "tiled K-quant codes"), and its file in the cache dir."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .consts import BLK, TILE



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


TILE_FIELDS = ("tq", "tsc", "tmn", "tdg", "tmg")


def _tiles_fit(b: "BlockWeight", t: dict) -> bool:
    """Whether ``t`` (tiles read back from a file) has the fields and shapes ``tiled(b)`` makes."""
    T, nb = (b.N + TILE - 1) // TILE, b.K // BLK
    nv = {"q4": (nb, 4), "q8": (nb, 8), "q8x": (2 * nb, 4)}[b.kind]
    need = {"tq", "tdg"} | ({"tsc"} if b.compact else set()) | ({"tmn", "tmg"} if b.kind == "q4" and b.compact else set()) \
        | ({"tmg"} if b.kind == "q4" and not b.compact else set())
    return set(t) == need and tuple(t["tq"].shape) == (T, nv[0], nv[1], TILE, 4)


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
