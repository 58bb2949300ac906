"""A GGUF converted straight from the file (``rakv.load.gguf._convert_direct``): its codes as they are and
every other tensor dequantized as transformers' loader would, tensor by tensor, with no float32 copy
of the coded weights. The folder it writes holds the same codes and tensors as a conversion through
transformers' loader (every tensor dequantized at once, then matched back), so a model loads and
computes the same bits either way, q8 and fp32; a file the direct path does not cover falls back
to transformers' loader with one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rakv import decoding as dec
import rakv.load.gguf as LG
import rakv.load.hub as LH
import rakv.load.slim as LS
from rakv.kernels import blockq

from tests.unit.test_gguf import write_llama_gguf
from tests.unit.test_gguf_codes import MIXED, Q4_K_M, kernel
from tests.tiny import make_model

gguf = pytest.importorskip("gguf")
IDS = [(7 * i + 3) % 300 for i in range(24)]


def _convert(f, out, direct: bool, monkeypatch):
    if not direct:
        def refuse(_):
            raise LG._Direct("the transformers path, for comparison")
        monkeypatch.setattr(LG, "_convert_direct", refuse)
    LG.convert_gguf(f, out)
    monkeypatch.undo()


def _same_codes(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for n in a:
        x, y = a[n], b[n]
        assert (x.kind, x.N, x.K) == (y.kind, y.N, y.K), n
        for f in ("qs", "d", "m", "isc", "imn", "dg", "mg"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None) and (u is None or torch.equal(u, v)), (n, f)


@kernel
@pytest.mark.parametrize("types", [Q4_K_M, MIXED, "Q8_0"], ids=["q4_k_m", "mixed", "q8_0"])
def test_the_direct_conversion_writes_what_transformers_path_writes(types, tmp_path, monkeypatch, capsys):
    f = tmp_path / "tiny.gguf"
    m = make_model("llama", hidden=256)
    if isinstance(types, dict):
        write_llama_gguf(f, m, qtypes=types)
    else:
        write_llama_gguf(f, m, types)
    a, b = tmp_path / "direct", tmp_path / "transformers"
    _convert(f, a, True, monkeypatch)
    assert "through transformers" not in capsys.readouterr().err
    _convert(f, b, False, monkeypatch)
    _same_codes(blockq.load_codes(a / LS.CODES_FILE), blockq.load_codes(b / LS.CODES_FILE))
    ra, rb = load_file(str(a / LS.SLIM_FILE)), load_file(str(b / LS.SLIM_FILE))
    assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
    for weights in (False, True):                     # q8 leaves the coded weights unmade; fp32 makes them
        ma, mb = LS._from_slim(a, "a", weights), LS._from_slim(b, "b", weights)
        if weights:
            assert all(torch.equal(p, q) for p, q in zip(ma.state_dict().values(), mb.state_dict().values()))
            la = dec.forward(ma, IDS, dec.DynamicCache())
            assert torch.equal(la, dec.forward(mb, IDS, dec.DynamicCache()))


@kernel
def test_a_converted_model_loads_and_runs_the_same_both_ways(tmp_path, monkeypatch):
    f = tmp_path / "tiny-kquant.gguf"
    write_llama_gguf(f, make_model("llama", hidden=256), qtypes=Q4_K_M)
    out = {}
    for direct in (True, False):
        monkeypatch.setenv("RAKV_CACHE", str(tmp_path / f"cache-{direct}"))
        if not direct:
            monkeypatch.setattr(LG, "_convert_direct", lambda g: (_ for _ in ()).throw(LG._Direct("compare")))
        for numerics in ("q8", "fp32"):
            lm = LH.load_model(str(f), numerics=numerics)
            out[direct, numerics] = dec.forward(lm.model, IDS, dec.DynamicCache())
    for numerics in ("q8", "fp32"):
        assert torch.equal(out[True, numerics], out[False, numerics]), numerics


def test_a_file_the_direct_path_does_not_cover_falls_back_with_one_line(tmp_path, monkeypatch, capsys):
    f = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(f, make_model("llama", hidden=64), "F32")
    monkeypatch.setattr(LG, "_convert_direct", lambda g: (_ for _ in ()).throw(LG._Direct("a reshaped tensor")))
    LG.convert_gguf(f, tmp_path / "out")
    err = [l for l in capsys.readouterr().err.splitlines() if "through transformers" in l]
    assert len(err) == 1 and "a reshaped tensor" in err[0]
    assert (tmp_path / "out" / LS.CONVERTED_MARK).is_file()
