"""The lean forward (rakv.kernels.lean), Llama and GPT-2: HF's logits and greedy ids, the caches it shares,
its switch."""

from __future__ import annotations

import pytest
import torch

from rakv import decoding as dec
from rakv.backends import lean_of
from rakv.kernels import fastpath, lean
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.drafts.int8 import int8_copy
from rakv.drafts.layers import layers_copy
from rakv.load.numerics import set_fast, wrap

from tests.unit.test_fastpath import needs_onednn
from tests.tiny import make_model, oracle, wrap_tiny
from tests.tiny import hf_forward as _hf  # HF's own forward, whatever the model has attached


ARCHS = ["llama", "gpt2"]


def _lean_model(arch="llama"):
    """A tiny model on the packed linears with its lean forward, and a prompt."""
    m = make_model(arch)
    fastpath.enable(m)
    lean.attach(m)
    return m, list(range(5, 25))


@pytest.mark.parametrize("arch", ARCHS + ["mistral", "qwen2"])
@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_onednn)])
def test_lean_logits_equal_hf_prefill_verify_and_step(fast, arch):
    m = make_model(arch, layers=3)
    if fast:
        fastpath.enable(m)
    assert lean.attach(m) == ""
    ids = [(7 * i + 3) % 300 for i in range(40)]
    c_hf, c_lean = dec.DynamicCache(), dec.DynamicCache()
    for chunk, keep in ((ids[:25], 1), (ids[25:30], 0), (ids[30:31], 1), (ids[31:40], 0)):
        a, b = _hf(m, chunk, c_hf, keep), dec.forward(m, chunk, c_lean, keep)
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the KV it wrote is HF's (so the prefix cache, crop and clone work on it unchanged)
    for la, lb in zip(c_hf.layers, c_lean.layers):
        torch.testing.assert_close(lb.keys, la.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lb.values, la.values, rtol=1e-4, atol=1e-4)
    # after a rollback it continues from the cropped cache like HF does
    dec.rollback(c_hf, 4)
    dec.rollback(c_lean, 4)
    torch.testing.assert_close(dec.forward(m, ids[36:38], c_lean), _hf(m, ids[36:38], c_hf), rtol=1e-4, atol=1e-4)


@pytest.mark.fast
@needs_onednn
def test_lean_is_attached_with_the_fast_path_and_switched_off(monkeypatch):
    lm = wrap(make_model("llama"), name="t", fast=True)
    assert lm.lean == "llama" and lean_of(lm.model) is not None
    set_fast(lm, False)
    assert not lm.lean and lean_of(lm.model) is None
    monkeypatch.setenv("RAKV_LEAN", "0")
    lm = wrap(make_model("llama"), name="t", fast=True)
    assert lm.fast and not lm.lean
    monkeypatch.delenv("RAKV_LEAN")
    g = wrap(make_model("gpt2"), name="g", fast=True)      # GPT-2 has its own
    assert g.fast and g.lean == "gpt2" and isinstance(lean_of(g.model), lean.LeanGPT2)
    g.model.config.reorder_and_upcast_attn = True          # maths it does not reproduce: HF's forward
    assert "reorder_and_upcast_attn" in (lean.supported(g.model) or "")


@needs_onednn
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_drafts_int8_and_layers_share_and_stay_exact(arch):
    target = wrap_tiny(make_model(arch, layers=4), name="t", fast=True)
    q = int8_copy(target)
    assert q.lean and lean_of(q.model) is not None and lean_of(target.model) is not lean_of(q.model)
    lay = layers_copy(target, 2)
    assert lay.lean and lean_of(lay.model).layers == lean_of(target.model).layers[:2]
    p = [(11 * i + 5) % 300 for i in range(30)]
    want = oracle(target, p, 24)
    for d in (q, lay):
        for pol in ("spec:4", "joint:2"):
            eng = Engine(target, ModelDraft(d), RakvConfig(policy=pol))
            assert eng.generate(p, 24).output_ids == want


@needs_onednn
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_follows_an_in_place_weight_change(arch):
    m, ids = _lean_model(arch)
    with torch.no_grad():
        if arch == "llama":
            m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            m.model.layers[1].mlp.up_proj.weight.add_(0.1)
        else:
            m.transformer.h[0].attn.c_attn.weight.mul_(1.5)
            m.transformer.h[1].mlp.c_fc.weight.add_(0.1)
    torch.testing.assert_close(dec.forward(m, ids, dec.DynamicCache()), _hf(m, ids, dec.DynamicCache()),
                               rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_follows_the_one_row_kernel_switch(arch):
    m, ids = _lean_model(arch)
    c = dec.DynamicCache()
    dec.prefill(m, ids, c)
    for kernel in ("packed", "plain", "packed"):
        fastpath.set_one_row(m, kernel)
        got = dec.decode_one(m, 7, c)
        assert all(op.plain1 == (kernel == "plain") for op in lean_of(m).ops if op.fn is None)
        dec.rollback(c, 1)
        torch.testing.assert_close(got, _hf(m, [7], c, keep=1)[-1], rtol=1e-4, atol=1e-4)
        dec.rollback(c, 1)
