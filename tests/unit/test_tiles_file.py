"""The tiled form of a model's codes kept in the cache dir (``blockq.attach_tiles``): made and saved
once, read back (memory-mapped) by the next load, so a first request does not tile and the tiled
pages are the file's; the same bits as tiles made in memory; a damaged or mismatched file is made
again; a read-only cache dir keeps the tiles in memory."""

from __future__ import annotations

import pytest
import torch

from rakv import decoding as dec
from rakv.kernels import blockq
from rakv.load.numerics import set_numerics
from tests.tiny import make_pair

pytestmark = [pytest.mark.skipif(blockq.library() is None, reason=f"no block kernel: {blockq.reason()}"),
              pytest.mark.fast]      # the whole file is in the fast subset (docs/contributing.md#tests)
gguf = pytest.importorskip("gguf")


def _blocks():
    from tests.unit.test_gguf_codes import _raw

    out = {}
    for i, form in enumerate(("Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0")):
        raw, _ = _raw(form, 37, 512, seed=i)
        out[form] = blockq.from_gguf(raw, form, 37, 512).with_numerics("q8")
    return out


def test_tiles_are_made_once_then_read_back_with_the_same_bits():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    mem = _blocks()
    want = {n: b(x) for n, b in mem.items()}                  # tiles made in memory at the first call
    first = _blocks()
    info = blockq.attach_tiles(first, "test-model-a")
    assert info["tiled"] == len(first) and info["made"] == len(first) and info["bytes"] > 0
    again = _blocks()
    info = blockq.attach_tiles(again, "test-model-a")
    assert info["tiled"] == len(again) and info["made"] == 0
    for n, b in again.items():
        assert torch.equal(b(x), want[n]), n
    path = str(blockq._cache_path("test-model-a+tiles"))
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        maps = None
    if maps is not None:                                                  # a file's pages (a memory map)
        assert path in maps


def test_a_damaged_or_mismatched_tiles_file_is_made_again():
    blocks = _blocks()
    blockq.attach_tiles(blocks, "test-model-b")
    path = blockq._cache_path("test-model-b+tiles")
    path.write_bytes(b"not a safetensors file")
    again = _blocks()
    assert blockq.attach_tiles(again, "test-model-b")["made"] == len(again)
    from tests.unit.test_gguf_codes import _raw

    other = {"Q4_K": blockq.from_gguf(_raw("Q4_K", 21, 256)[0], "Q4_K", 21, 256).with_numerics("q8")}
    assert blockq.attach_tiles(other, "test-model-b")["made"] == 1          # another shape under that name


def test_fp32_blocks_are_left_alone():
    b = {"Q4_K": _blocks()["Q4_K"].with_numerics("fp32")}
    assert blockq.attach_tiles(b, "test-model-c") == {"tiled": 0, "made": 0, "bytes": 0}


def test_a_model_in_q8_reads_its_tiles_at_load_and_stays_exact():
    t, _ = make_pair("llama", "mostly")
    ids = list(range(5, 30))
    want = dec.prefill(set_numerics(make_pair("llama", "mostly")[0], "q8").model, ids, dec.DynamicCache())
    t = set_numerics(t, "q8")
    tiles = t.blockq.get("tiles")
    assert tiles and tiles["tiled"] > 0
    assert torch.equal(dec.prefill(t.model, ids, dec.DynamicCache()), want)
