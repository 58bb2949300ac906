"""A model's layers on their codes: the codes found once and kept in the cache dir (``attach``,
``load_codes``, ``save_codes``), the tiled form read from its file (``attach_tiles``), a coded
embedding table."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .lib import library, reason
from .tiles import TILE_FIELDS, _read_tiles, _tiles_fit, _write_tiles, tiled, tiles
from .weight import BlockWeight, encode


# ----------------------------------------------------------------------------- a model's layers
def _cache_path(key: str) -> Path:
    from ...util.paths import cache_dir

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
           enabled: bool = True) -> dict:
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
    if not enabled:                                  # (RAKV_BLOCKQ as the load read it)
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
