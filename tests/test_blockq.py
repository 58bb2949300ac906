"""Exact block-coded weights (rakv.kernels.blockq): codes found only where they rebuild every weight bit for
bit, a kernel whose rows do not depend on how many there are, every policy still exact, the codes'
cache, and the fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch

from rakv.kernels import blockq, fastpath
from rakv.config import RakvConfig
from rakv.costs import CostProfile
from rakv.drafts import ModelDraft, NgramDraft
from rakv.engine import Engine
from rakv.models import wrap

from .test_fastpath import needs_onednn
from .tiny import make_model, oracle, perturbed, snap_to_blocks, tiny_tokenizer



@pytest.fixture
def kernel():
    """The compiled kernel (built on first use, into the test cache dir); skip where it cannot be."""
    if blockq.library() is None:
        pytest.skip(f"block kernel: {blockq.reason()}")


def _coded(kind: str, N: int = 96, K: int = 128, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.4)
    snap_to_blocks(lin, kind=kind, head=kind)
    return lin.weight.detach().clone()


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_codes_rebuild_the_weights_bit_for_bit_and_nothing_else_gets_codes(kind):
    w = _coded(kind)
    b = blockq.encode(w)
    assert b is not None and b.kind == kind and (b.N, b.K) == tuple(w.shape)
    assert torch.equal(b.dequantize(), w)
    assert b.nbytes < w.numel() * 4 / 3                 # 4.5 or 8.5 bits a weight, not 32
    # a weight that is not exactly coded has no codes: plain fp32, or one element one ulp off
    assert blockq.encode(torch.randn(96, 128)) is None
    off = w.clone()
    off[3, 70] = torch.nextafter(off[3, 70], torch.tensor(9.0))
    assert blockq.encode(off) is None
    assert blockq.encode(torch.randn(96, 100)) is None  # K not a multiple of 32


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_rows_do_not_depend_on_how_many_and_are_fp32_accurate(kernel, kind, threads):
    w = _coded(kind, N=70, K=160)          # N not a multiple of the output tile
    b = blockq.encode(w)
    bias = torch.randn(70)
    torch.manual_seed(1)
    x = torch.randn(1, 30, 160)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = b(x, bias)
        ref = x.double() @ w.double().t() + bias.double()
        assert whole.shape == (1, 30, 70)
        torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-5)
        for M in (1, 2, 3, 5, 9, 12, 13, 17):            # a decode step, verifies, more than one pass
            part = b(x[:, :M], bias)
            assert torch.equal(part, whole[:, :M]), M
        assert torch.equal(b(x[:, 7:8], bias), whole[:, 7:8])
    finally:
        torch.set_num_threads(old)


def _block_pair(arch: str, eos=None):
    """A target whose weights are block-coded (Q4_1 layers, Q8_0 head) on the fast path, a close
    draft, and a plain copy of the target (torch's own kernels, HF's forward) for the oracle."""
    tok = tiny_tokenizer()
    t = snap_to_blocks(make_model(arch, eos=eos))
    plain = copy.deepcopy(t)
    d = snap_to_blocks(perturbed(copy.deepcopy(t), 0.01))
    return wrap(t, tok, name=f"tiny-{arch}-q4"), wrap(d, tok, name=f"tiny-{arch}-q4-draft"), plain


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_policy_is_exact_on_block_coded_weights(kernel, arch):
    target, draft, plain = _block_pair(arch)
    n_linears = len([m for m in target.model.modules() if isinstance(m, fastpath.FastLinear)])
    assert target.blockq["layers"] == n_linears and target.blockq["kinds"].get("q8") == 1
    lean_ops = target.model._rakv_lean.ops
    assert all(op.block is not None for op in lean_ops)  # the fused q|k|v and gate|up included
    prompts = [list(range(5, 45)), list(range(5, 35)) + [7, 8, 9, 10], list(range(5, 17)),
               [3, 4, 5] * 6]
    want = {tuple(p): oracle(plain, p, 24) for p in prompts}
    prof = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                       d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)
    for policy in ["ar", "kv", "spec:1", "spec:4", "joint:2", "joint:8", "adaptive"]:
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), profile=copy.deepcopy(prof))
        for p in prompts + prompts:          # the second pass: exact repeats and partial hits
            assert eng.generate(p, 24).output_ids == want[tuple(p)], (policy, p)
    eng = Engine(target, NgramDraft(), RakvConfig(policy="joint:8"))
    for p in prompts:
        assert eng.generate(p, 24).output_ids == want[tuple(p)]


@needs_onednn
def test_codes_are_saved_once_and_checked_against_the_weights(kernel, monkeypatch):
    t = snap_to_blocks(make_model("llama", seed=3))
    fastpath.enable(t)
    info = fastpath.attach_codes(t, "tiny-cache-test")
    assert info["layers"] > 0 and blockq._cache_path("tiny-cache-test").exists()
    calls = []
    real = blockq.encode
    monkeypatch.setattr(blockq, "encode", lambda w: calls.append(w.shape) or real(w))
    again = copy.deepcopy(t)
    assert fastpath.attach_codes(again, "tiny-cache-test")["layers"] == info["layers"]
    assert calls == []                                   # all from the saved codes
    with torch.no_grad():                                # a weight that is not the saved one
        again.model.layers[0].mlp.down_proj.weight.mul_(2)
    assert fastpath.attach_codes(again, "tiny-cache-test")["layers"] == info["layers"]
    assert len(calls) == 1
    y = again.model.layers[0].mlp.down_proj(torch.randn(1, 1, 128))
    w = again.model.layers[0].mlp.down_proj.weight
    assert torch.equal(again.model.layers[0].mlp.down_proj.block.dequantize(), w.detach())
    assert y.shape == (1, 1, 64)


@needs_onednn
def test_without_a_compiler_or_switched_off_the_fp32_kernels_run(monkeypatch):
    tok = tiny_tokenizer()
    monkeypatch.setattr(blockq._Lib, "tried", False)
    monkeypatch.setattr(blockq._Lib, "handle", None)
    monkeypatch.setattr(blockq._Lib, "reason", "")
    monkeypatch.setattr(blockq, "_compiler", lambda: None)
    m = snap_to_blocks(make_model("llama"))
    plain = copy.deepcopy(m)
    lm = wrap(m, tok, name="tiny-nocc")
    assert lm.blockq["layers"] == 0 and "no C compiler" in lm.blockq["reason"]
    p = list(range(5, 40))
    assert Engine(lm, None, RakvConfig(policy="ar")).generate(p, 16).output_ids == oracle(plain, p, 16)
    monkeypatch.setattr(blockq._Lib, "tried", False)
    monkeypatch.setenv("RAKV_BLOCKQ", "0")
    lm2 = wrap(copy.deepcopy(plain), tok, name="tiny-off")
    assert lm2.blockq["layers"] == 0 and lm2.blockq["reason"] == "RAKV_BLOCKQ=0"


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_verify_row_equals_the_decode_step_bit_for_bit(kernel, arch):
    """On block-coded weights every row-dependent piece of a step is the project's own (the block
    kernel, blockq.attend): a (k + 1)-token verify gives each row exactly the logits and KV that
    k + 1 one-token steps give, so accepting drafts cannot change a single bit of the output."""
    from rakv import decoding as dec

    target, _, _ = _block_pair(arch)
    m = target.model
    ids = [(7 * i + 3) % 300 for i in range(60)]
    for k in (1, 4, 8, 16):
        c1, c2 = dec.DynamicCache(), dec.DynamicCache()
        dec.prefill(m, ids[:30], c1)
        dec.prefill(m, ids[:30], c2)
        with torch.inference_mode():
            v = dec.forward(m, ids[30: 31 + k], c1).reshape(k + 1, -1)
            steps = torch.cat([dec.forward(m, ids[30 + j: 31 + j], c2).reshape(1, -1) for j in range(k + 1)])
        assert torch.equal(v, steps), k
        for a, b in zip(c1.layers, c2.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_own_attention_is_causal_attention(kernel):
    """blockq.attend against torch's SDPA: GQA, a growing cache, rows that see 0..past + i."""
    torch.manual_seed(0)
    Hq, Hk, D, past, n = 6, 2, 32, 21, 5
    qk = torch.randn(1, n, Hq + Hk, D)
    k = torch.randn(1, Hk, 64, D)[:, :, : past + n]          # a buffer view, as the lean forward's
    v = torch.randn(1, Hk, 64, D)[:, :, : past + n]
    assert blockq.attend_ok(k, v, n, Hq, Hk, D)
    got = blockq.attend(qk, (Hq + Hk) * D, k, v, n, Hq, Hk, D, 0.2)
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    q = qk[:, :, :Hq].transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2,
                                                             enable_gqa=True).transpose(1, 2).reshape(1, n, Hq * D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = blockq.attend(qk[:, 2:3].contiguous(), (Hq + Hk) * D, k[:, :, : past + 3], v[:, :, : past + 3],
                        1, Hq, Hk, D, 0.2)
    assert torch.equal(one, got[:, 2:3])


def test_the_row_limits_agree():
    """fastpath and lean keep their own copy of the block kernel's row limit (no import of blockq)."""
    from rakv.kernels import lean

    assert fastpath._BLOCK_ROWS == lean.BLOCK_ROWS == blockq.MAX_ROWS
    assert blockq.ATTEND_ROWS >= 17                      # every verify (k <= 16) attends on its own


def test_the_portable_kernel_gives_the_same_bits(kernel, tmp_path, monkeypatch):
    """A CPU without AVX-512 runs the portable C (the same order of operations): built here with
    -mno-avx512f, it must give exactly what the AVX-512 build gives."""
    import platform

    native = blockq.library()
    if platform.machine().lower() not in ("x86_64", "amd64") or not native.rakv_blockq_avx512():
        pytest.skip("the native build is the portable one here")
    out = tmp_path / "portable.so"
    assert blockq._build(blockq._compiler(), out, ("-mno-avx512f",)) == ""
    portable = blockq._load(out)
    assert portable.rakv_blockq_avx512() == 0

    def outputs():
        res = []
        for kind in ("q4", "q8"):
            w = _coded(kind, N=70, K=160, seed=4)
            b = blockq.encode(w)                          # fresh codes: bound to the library now in use
            torch.manual_seed(5)
            x, bias = torch.randn(1, 30, 160), torch.randn(70)
            res += [b(x, bias), b(x[:, :1], bias)]
        torch.manual_seed(6)
        qk = torch.randn(1, 5, 8, 32)
        k, v = torch.randn(1, 2, 64, 32)[:, :, :26], torch.randn(1, 2, 64, 32)[:, :, :26]
        res.append(blockq.attend(qk, 8 * 32, k, v, 5, 6, 2, 32, 0.2))
        return res

    a = outputs()
    monkeypatch.setattr(blockq._Lib, "handle", portable)
    b = outputs()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
