"""Block codes on a load: the saved codes are checked against the weights in one streaming pass
(a weight one ulp off is refused, any strides), a fully coded model needs no one-row kernel timing
and no fp32 copy of its fused layers, and a long prefill past the codes' rows still equals HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rakv import decoding as dec
from rakv.backends import lean_of
from rakv.kernels import blockq, fastpath
from rakv.load.numerics import wrap

from tests.unit.test_blockq import can_build
from tests.unit.test_fastpath import needs_onednn
from tests.tiny import hf_forward, make_model, snap_to_blocks

# skipped only where the kernel cannot be built at all; with a compiler present a failed build fails
kernel = pytest.mark.skipif(blockq.library() is None and bool(can_build()),
                            reason=f"block kernel: {can_build()} ({blockq.reason()})")


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
        qkv = lean_of(lm.model).layers[0].qkv
        assert qkv.packed is None and qkv.block is not None          # stacked codes, no fp32 copy
    packed = [f for f in lm.model.modules() if isinstance(f, fastpath.FastLinear) and f._packed is not None]
    assert len(packed) <= 1                      # packed on first use (one at enabling: the probe)
    ids = [(7 * i + 3) % 300 for i in range(100)]                    # past the codes' rows
    hf_model = lm.model
    c_lean, c_hf = dec.DynamicCache(), dec.DynamicCache()
    got = dec.forward(hf_model, ids, c_lean)
    want = hf_forward(hf_model, ids, c_hf)                          # HF's forward (the torch backend)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ----------------------------------------------------------------------------- codes read from a GGUF
gguf = pytest.importorskip("gguf")
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]          # gguf.quants quantizes these
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]        # and dequantizes these (random blocks here)
KIND = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "q8", "Q8_0": "q8",
        "Q5_1": "q8x", "Q2_K": "q8x", "Q3_K": "q8x", "Q5_K": "q8x", "Q6_K": "q8x"}


def _raw(qtype: str, N: int, K: int, seed: int = 0):
    import numpy as np

    from tests.unit.test_gguf import random_blocks

    t = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype in LEGACY:
        x = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
        raw = gguf.quants.quantize(x, t)
    else:
        raw = random_blocks(qtype, N, K, seed=seed, scale=0.01)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(N, K).astype("float32"))


@kernel
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS)
def test_every_gguf_type_gives_codes_that_rebuild_its_weights_bit_for_bit(qtype):
    N, K = 10, 512
    raw, w = _raw(qtype, N, K)
    b = blockq.from_gguf(raw, qtype, N, K)
    assert b is not None and b.kind == KIND[qtype]
    assert torch.equal(b.dequantize(), w) and b.rebuilds(w) and b.rebuilds(w.t().contiguous().t())
    off = w.clone()
    off[3, 300] = torch.nextafter(off[3, 300], torch.tensor(float("inf")))
    assert not b.rebuilds(off)
    perm = [3, 1, 4, 0, 9, 2, 6, 5, 8, 7]
    assert b.rows(perm).rebuilds(w[perm])
    # the kernel: the fp32 linear of those weights, each row the same alone or among others
    x = torch.randn(7, K)
    y = b(x)
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-3)
    for r in range(7):
        assert torch.equal(b(x[r: r + 1]), y[r: r + 1])
    saved = blockq.concat([b, b.rows(perm)])           # stacked (a fused q|k|v) keeps the kind
    assert saved.kind == b.kind and saved.rebuilds(torch.cat([w, w[perm]]))
    assert blockq.from_gguf(raw, qtype, N, K + 32) is None and blockq.from_gguf(raw, "IQ2_XS", N, K) is None


@kernel
def test_the_portable_kernel_gives_the_same_bits_for_the_new_kind(tmp_path):
    import ctypes

    cc = blockq._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "portable.so"
    assert blockq._build(cc, out, ("-mno-avx512f",)) == ""
    portable = blockq._load(out)
    raw, w = _raw("Q6_K", 12, 512)
    b = blockq.from_gguf(raw, "Q6_K", 12, 512)
    x = torch.randn(5, 512)
    want = b(x)
    b._bind()
    y = torch.empty(5, 12)
    portable.rakv_linear(ctypes.byref(b._desc), x.data_ptr(), 5, y.data_ptr(), None, 1)
    assert torch.equal(y, want)
    assert portable.rakv_check(ctypes.byref(b._desc), w.data_ptr(), w.stride(0), w.stride(1), 1) == 0


Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
          "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q8_0", "token_embd": "Q8_0"}
MIXED = {"attn_q": "Q5_K", "attn_k": "Q3_K", "attn_output": "Q2_K", "ffn_gate": "Q5_1", "ffn_up": "Q5_1",
         "attn_v": "Q4_0", "ffn_down": "Q5_0", "output": "Q6_K", "token_embd": "Q4_1"}


@kernel
@needs_onednn
@pytest.mark.parametrize("types", [Q4_K_M, MIXED], ids=["q4_k_m", "mixed"])
def test_a_k_quant_gguf_runs_from_its_codes_and_gives_transformers_ids(types, tmp_path, monkeypatch):
    """A GGUF as people download them (Q4_K with Q6_K, or a mix of every other type): converted once,
    every linear runs from the file's codes (q / k rows permuted by the loader included), and the
    engine's ids under every policy equal transformers' generate on the file."""
    from transformers import AutoModelForCausalLM

    from rakv.config import RakvConfig
    from rakv.drafts.model import ModelDraft
    from rakv.drafts.ngram import NgramDraft
    from rakv.engine import Engine
    from rakv.drafts.int8 import int8_copy
    from rakv.load.hub import load_model
    from rakv.load.slim import CODES_FILE

    from tests.unit.test_gguf import write_llama_gguf
    from tests.tiny import oracle

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "tiny-kquant.gguf"
    write_llama_gguf(f, make_model("llama", hidden=256), qtypes=types)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f.name, dtype=torch.float32).eval()
    lm = load_model(str(f), fast=True)
    assert (Path(lm.codes_file).name == CODES_FILE) and lm.blockq["layers"] == lm.blockq["of"] == 15
    want_kinds = {KIND[t] for r, t in types.items() if r != "token_embd"}
    assert set(lm.blockq["kinds"]) == want_kinds
    assert lm.lean == "llama"
    prompts = [[(7 * i + 3) % 300 for i in range(40)], [(5 * i + 1) % 300 for i in range(12)]]
    want = {tuple(p): oracle(ref, p, 16) for p in prompts}
    lm.eos_ids = frozenset()
    q = int8_copy(lm)
    for policy in ("ar", "kv", "spec:4", "joint:2", "adaptive"):
        from rakv.decide.profile import CostProfile

        prof = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                           d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)
        for draft in (ModelDraft(q), NgramDraft()):
            eng = Engine(lm, draft, RakvConfig(policy=policy), profile=prof)
            for p in prompts + prompts:
                assert eng.generate(p, 16).output_ids == want[tuple(p)], (policy, p)
