"""Block codes on a load: the saved codes are checked against the weights in one streaming pass
(a weight one ulp off is refused, any strides), a fully coded model needs no one-row kernel timing
and no fp32 copy of its fused layers, and a long prefill past the codes' rows still equals HF."""

from __future__ import annotations

import pytest
import torch

from rakv import decoding as dec
from rakv.kernels import blockq, fastpath, lean
from rakv.models import wrap

from .test_fastpath import needs_onednn
from .tiny import make_model, snap_to_blocks

kernel = pytest.mark.skipif(blockq.library() is None, reason=f"block kernel unavailable: {blockq.reason()}")


@kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_rebuilds_checks_every_element_at_any_strides(kind):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 96))
    snap_to_blocks(m, kind)
    w = m[0].weight.detach()
    b = blockq.encode(w)
    assert b is not None and b.kind == kind
    assert b.rebuilds(w) and b.rebuilds(w.t().contiguous().t())
    for r, c in ((0, 0), (5, 17), (95, 255)):
        off = w.clone()
        off[r, c] = torch.nextafter(off[r, c], torch.tensor(float("inf")))
        assert not b.rebuilds(off) and not b.rebuilds(off.t().contiguous().t())
    assert not b.rebuilds(w[:, :224]) and not b.rebuilds(w.double())


@kernel
@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_fully_coded_model_loads_without_copies_and_long_prefills_equal_hf(arch, monkeypatch):
    m = snap_to_blocks(make_model(arch, layers=2))
    lm = wrap(m, name=f"coded-{arch}", fast=True)
    assert lm.blockq["layers"] == lm.blockq["of"] and "codes" in lm.one_row["how"]
    assert lm.lean
    if arch == "llama":
        qkv = lm.model._rakv_lean.layers[0].qkv
        assert qkv.packed is None and qkv.block is not None          # stacked codes, no fp32 copy
    packed = [f for f in lm.model.modules() if isinstance(f, fastpath.FastLinear) and f._packed is not None]
    assert len(packed) <= 1                      # packed on first use (one at enabling: the probe)
    ids = [(7 * i + 3) % 300 for i in range(100)]                    # past the codes' rows
    hf_model = lm.model
    c_lean, c_hf = dec.DynamicCache(), dec.DynamicCache()
    got = dec.forward(hf_model, ids, c_lean)
    saved, hf_model._rakv_lean = hf_model._rakv_lean, None
    try:
        want = dec.forward(hf_model, ids, c_hf)
    finally:
        hf_model._rakv_lean = saved
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
