"""Exact block-coded weights (rakv.kernels.blockq): codes found only where they rebuild every weight bit for
bit, a kernel whose rows do not depend on how many there are, every policy still exact, the codes'
cache, and the fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch

from rakv.backends import lean_of
from rakv.kernels import blockq, fastpath
from rakv.config import RakvConfig
from rakv.decide.profile import CostProfile
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.load.numerics import wrap

from .test_fastpath import needs_onednn
from tests.tiny import assert_exact, make_model, oracle, perturbed, snap_to_blocks, tiny_tokenizer, wrap_tiny

BUILDS_ON = {"linux": ("x86_64", "amd64", "aarch64", "arm64"), "darwin": ("x86_64", "arm64")}


def can_build() -> str:
    """Why the kernel cannot be built here at all ("" when it can: a C compiler on a platform it
    builds on)."""
    import platform
    import sys

    if blockq._compiler() is None:
        return "no C compiler"
    machines = next((m for p, m in BUILDS_ON.items() if sys.platform.startswith(p)), ())
    if platform.machine().lower() not in machines:
        return f"no kernel build for {sys.platform} {platform.machine()}"
    return ""


@pytest.fixture
def kernel():
    """The compiled kernel (built on first use, into the test cache dir). Skipped only where it
    cannot be built at all (no C compiler, a platform without a build); with a compiler present, a
    kernel that fails to build or load fails the suite, with the compiler's reason."""
    if blockq.library() is not None:
        return
    why = can_build()
    if why:
        pytest.skip(f"block kernel: {why} ({blockq.reason()})")
    pytest.fail(f"the block kernel did not build although a C compiler is present: {blockq.reason()}",
                pytrace=False)


def _coded(kind: str, N: int = 96, K: int = 128, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.4)
    snap_to_blocks(lin, kind=kind, head=kind)
    return lin.weight.detach().clone()


@pytest.mark.fast
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


def _random_codes(kind: str, N: int, K: int, seed: int) -> blockq.BlockWeight:
    """Random codes of a kind: float16 scales and offsets (q8x: per 16 inputs), any code values."""
    g = torch.Generator().manual_seed(seed)
    nb = K // blockq.BLK
    groups = 2 * nb if kind == "q8x" else nb
    d = (torch.rand(N, groups, generator=g) * 0.05 + 1e-3).half().float()
    m = -(torch.rand(N, groups, generator=g) * 0.5).half().float()
    if kind == "q4":
        qs = torch.randint(0, 256, (N, nb, 16), dtype=torch.uint8, generator=g)
    elif kind == "q8":
        qs, m = torch.randint(-128, 128, (N, nb, 32), dtype=torch.int8, generator=g), None
    else:
        qs = torch.randint(0, 256, (N, nb, 32), dtype=torch.uint8, generator=g)
    return blockq.BlockWeight(kind, N, K, qs, d, m)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """tests/blockq_reference.c built here: the kernel's order of operations written out plainly,
    one output at a time."""
    import ctypes
    from pathlib import Path

    if blockq._compiler() is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("reference") / "reference.so"
    why = blockq._build(blockq._compiler(), out, source=Path(__file__).resolve().parents[1] / "blockq_reference.c")
    assert why == "", why
    lib = ctypes.CDLL(str(out))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.reference_linear.argtypes = [i64, i64, i64, vp, vp, vp, vp, i64, vp, vp]

    def linear(b: blockq.BlockWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.empty(x.shape[0], b.N)
        lib.reference_linear(blockq.KIND_CODES[b.kind], b.N, b.K, b.qs.data_ptr(), b.d.data_ptr(),
                             (b.m if b.m is not None else b.d).data_ptr(), x.data_ptr(), x.shape[0], y.data_ptr(),
                             None if bias is None else bias.data_ptr())
        return y
    return linear


@pytest.mark.parametrize("kind", ["q4", "q8", "q8x"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_every_row_count_gives_the_reference_bits(kernel, reference, kind, threads):
    """Every M from 1 to blockq.MAX_ROWS, on random codes of every kind: each row is bit for bit the
    plain one-output-at-a-time reference (tests/blockq_reference.c), with and without a bias, on
    shapes that are not whole tiles, strips or thread shares."""
    for N, K, seed in ((70, 160, 1), (29, 32, 2), (13, 608, 3)):
        b = _random_codes(kind, N, K, seed)
        torch.manual_seed(seed)
        x, bias = torch.randn(blockq.MAX_ROWS, K), torch.randn(N)
        want, want_nobias = reference(b, x, bias), reference(b, x, None)
        for M in range(1, blockq.MAX_ROWS + 1):
            assert torch.equal(b(x[:M], bias), want[:M]), (N, K, M)
        for M in (1, 5, 17, blockq.MAX_ROWS):
            assert torch.equal(b(x[:M]), want_nobias[:M]), (N, K, M)
        assert torch.equal(b(x[40:41], bias), want[40:41])


def _block_pair(arch: str, eos=None):
    """A target whose weights are block-coded (Q4_1 layers, Q8_0 head) on the fast path, a close
    draft, and a plain copy of the target (torch's own kernels, HF's forward) for the oracle."""
    tok = tiny_tokenizer()
    t = snap_to_blocks(make_model(arch, eos=eos))
    plain = copy.deepcopy(t)
    d = snap_to_blocks(perturbed(copy.deepcopy(t), 0.01))
    return wrap_tiny(t, tok, name=f"tiny-{arch}-q4"), wrap(d, tok, name=f"tiny-{arch}-q4-draft"), plain


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_policy_is_exact_on_block_coded_weights(kernel, arch):
    target, draft, plain = _block_pair(arch)
    n_linears = len([m for m in target.model.modules() if isinstance(m, fastpath.FastLinear)])
    assert target.blockq["layers"] == n_linears and target.blockq["kinds"].get("q8") == 1
    lean_ops = lean_of(target.model).ops
    assert all(op.block is not None for op in lean_ops)  # the fused q|k|v and gate|up included
    prompts = [list(range(5, 45)), list(range(5, 35)) + [7, 8, 9, 10], list(range(5, 17)),
               [3, 4, 5] * 6]
    want = {tuple(p): oracle(target, p, 24) for p in prompts}
    assert want == {tuple(p): oracle(plain, p, 24, eos=target.eos_ids) for p in prompts}      # the same copy
    prof = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                       d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)
    for policy in ["ar", "kv", "spec:1", "spec:4", "joint:2", "joint:8", "adaptive"]:
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), profile=copy.deepcopy(prof))
        for p in prompts + prompts:          # the second pass: exact repeats and partial hits
            assert_exact(eng.generate(p, 24), target, p, 24, policy)
    eng = Engine(target, NgramDraft(), RakvConfig(policy="joint:8"))
    for p in prompts:
        assert_exact(eng.generate(p, 24), target, p, 24)


@needs_onednn
def test_codes_are_saved_once_and_checked_against_the_weights(kernel, monkeypatch):
    t = snap_to_blocks(make_model("llama", seed=3))
    fastpath.enable(t)
    info = fastpath.attach_codes(t, "tiny-cache-test")
    assert info["layers"] > 0 and blockq._cache_path("tiny-cache-test").exists()
    calls = []
    real = blockq.encode
    monkeypatch.setattr(blockq.store, "encode", lambda w: calls.append(w.shape) or real(w))
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
    monkeypatch.setattr(blockq.lib, "_compiler", lambda: None)
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


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@needs_onednn
@pytest.mark.parametrize("arch, threads", [("llama", 1), ("gpt2", 1), ("llama", 2)], indirect=["threads"])
@pytest.mark.parametrize("start", ["prefill", "partial hit"])
def test_a_verify_row_equals_the_decode_step_bit_for_bit(kernel, arch, start, threads):
    """On block-coded weights every row-dependent piece of a step is the project's own (the block
    kernel, blockq.attend): a (k + 1)-token verify gives each row exactly the logits and KV that
    k + 1 one-token steps give, so accepting drafts cannot change a single bit of the output. At 1
    and 2 threads, after a prefill or on the KV a partial prefix-cache hit hands out (views of a
    stored entry, the boundary token recomputed by the verify or the first step)."""
    from rakv import decoding as dec
    from rakv.prefix_cache import PrefixCache

    target, _, _ = _block_pair(arch)
    m = target.model
    ids = [(7 * i + 3) % 300 for i in range(60)]
    store = PrefixCache(1 << 30)
    if start == "partial hit":
        c = dec.DynamicCache()
        logits = dec.prefill(m, ids[:40], c)
        store.store(target.key, ids[:40], dec.kv_of(c, 40), logits)
        ids = ids[:30] + [(5 * i + 1) % 300 for i in range(30)]        # shares 30 tokens with the stored 40
    entry = [(k.clone(), v.clone()) for k, v in store.entries()[0].kv] if len(store) else []

    def cache():
        if start == "prefill":
            c = dec.DynamicCache()
            dec.prefill(m, ids[:30], c)
            return c, 30
        hit = store.lookup(target.key, ids)
        assert (hit.q, hit.usable) == (30, 29)
        return dec.cache_from(store.clone_kv(hit)), 29

    for k in (1, 4, 8, 16):
        (c1, at), (c2, _) = cache(), cache()
        with torch.inference_mode():
            v = dec.forward(m, ids[at: at + k + 1], c1).reshape(k + 1, -1)
            steps = torch.cat([dec.forward(m, ids[at + j: at + j + 1], c2).reshape(1, -1) for j in range(k + 1)])
        assert torch.equal(v, steps), k
        for a, b in zip(c1.layers, c2.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for (k0, v0), (k1, v1) in zip(entry, store.entries()[0].kv if entry else []):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)          # the stored entry is never written


def logits_by_position(monkeypatch, target, eng, prompts, n) -> list[dict]:
    """Run ``prompts`` through ``eng``; per request, the target's logits that decided each output
    token, by position (a verify row or a step's; a row fed a rejected draft is not one)."""
    from rakv import decoding

    calls, real = [], decoding.forward

    def spy(model, tokens, cache, keep=0):
        out = real(model, tokens, cache, keep)
        if model is target.model:
            toks = tokens.view(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
            calls.append((toks, decoding.cache_len(cache) - len(toks), out.clone()))
        return out
    monkeypatch.setattr(decoding, "forward", spy)
    found = []
    for p in prompts:
        calls.clear()
        end = eng.generate(p, n)
        seq = p + end.output_ids
        rows = {}
        for toks, start, out in calls:
            first = start + len(toks) - out.shape[0]          # the position of out's first row
            for r in range(out.shape[0]):
                i = first + r
                if toks[: i - start + 1] == seq[start: i + 1] and len(p) - 1 <= i < len(seq) - 1:
                    assert i not in rows, "a committed position computed twice"
                    rows[i] = out[r]
        assert set(rows) <= set(range(len(p) - 1, len(seq) - 1))
        found.append(rows)
    monkeypatch.undo()
    return found


@needs_onednn
@pytest.mark.parametrize("arch, threads", [("llama", 1), ("gpt2", 1), ("llama", 2)], indirect=["threads"])
def test_every_output_token_is_decided_by_the_same_bits_through_the_engine(kernel, arch, threads, monkeypatch):
    """End to end: on block-coded weights the logits that decide each output token are bit for bit
    the same whether they came from a one-token step (ar, kv) or a row of a verify (spec:k, joint:k),
    over a stream with partial hits and exact repeats. (At 2 threads one policy: a busy machine
    makes every small parallel kernel call slow.)"""
    target, draft, _ = _block_pair(arch)
    a = list(range(5, 45))
    prompts = [a, a[:30] + [7, 8, 9], a, list(range(60, 72)), a[:30] + [7, 8, 9]]
    groups = (("ar", ["spec:1", "spec:4", "spec:8"]), ("kv", ["joint:2", "joint:8"]))
    if threads == 2:
        groups, prompts = (("kv", ["joint:8"]),), prompts[:3]
    for base, others in groups:
        want = logits_by_position(monkeypatch, target, Engine(target, None, RakvConfig(policy=base)), prompts, 16)
        for policy in others:
            eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy))
            got = logits_by_position(monkeypatch, target, eng, prompts, 16)
            for g, w in zip(got, want):
                assert set(g) == set(w)                     # the same positions computed (none from storage)
                assert all(torch.equal(g[i], w[i]) for i in w), (policy, [i for i in w if not torch.equal(g[i], w[i])])
            assert eng.generate(a, 16).accepted > 0          # verifies did accept drafts


@pytest.mark.fast
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


@needs_onednn
def test_the_codes_run_every_row_count_up_to_the_limit(kernel, monkeypatch):
    """Up to blockq.MAX_ROWS rows a block-coded linear runs from its codes, on HF's forward (the
    FastLinear) and on the lean forward's linears alike, and more rows on oneDNN's fp32; a step of up
    to 17 new rows (every verify, k <= 16) attends with blockq.attend, more with SDPA."""
    from rakv import decoding as dec
    from rakv.config import LOOKUP_K

    target, _, _ = _block_pair("llama")
    m = target.model
    seen = []

    class Spy:
        def __init__(self, block):
            self.block = block

        def __call__(self, x, bias):
            seen.append(x.shape[-2])
            return self.block(x, bias)

    lin = m.model.layers[0].mlp.down_proj
    lin.block = Spy(lin.block)
    x = torch.randn(1, blockq.MAX_ROWS + 1, lin.in_features)
    for rows in (1, 2, blockq.MAX_ROWS, blockq.MAX_ROWS + 1):
        lin(x[:, :rows])
    assert seen == [1, 2, blockq.MAX_ROWS]
    ops = lean_of(m).ops
    for op in ops:
        op.block = Spy(op.block)
    ids = [(7 * i + 3) % 300 for i in range(blockq.MAX_ROWS + 1)]
    for rows in (1, blockq.MAX_ROWS, blockq.MAX_ROWS + 1):
        seen.clear()
        dec.forward(m, ids[:rows], dec.DynamicCache())
        assert seen == ([rows] * len(ops) if rows <= blockq.MAX_ROWS else []), rows
    attended = []
    real = blockq.attend
    monkeypatch.setattr(blockq, "attend", lambda q, q_row, k, v, n, *a: attended.append(n) or real(q, q_row, k, v, n, *a))
    for n in (1, LOOKUP_K + 1, blockq.ATTEND_ROWS + 1):
        c = dec.DynamicCache()
        dec.prefill(m, ids[:20], c)
        attended.clear()
        dec.forward(m, ids[20: 20 + n], c)
        assert attended == ([n] * m.config.num_hidden_layers if n <= LOOKUP_K + 1 else []), n


NARROWER = {512: [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], 256: [("-mno-avx2",)]}


def test_the_narrower_builds_give_the_same_bits(kernel, tmp_path, monkeypatch):
    """A CPU without AVX-512 runs the AVX2 code, one without AVX2 the portable C (the same order of
    operations): built here with the wider instructions switched off, each must give exactly what
    the native build gives, for every kind of codes and several row counts."""
    import platform

    native = blockq.library()
    simd = native.rakv_blockq_simd()
    if platform.machine().lower() not in ("x86_64", "amd64") or simd not in NARROWER:
        pytest.skip(f"no narrower x86 build to compare with (machine {platform.machine()}, native SIMD width {simd})")
    narrower = []
    for i, flags in enumerate(NARROWER[simd]):
        out = tmp_path / f"narrower{i}.so"
        assert blockq._build(blockq._compiler(), out, flags) == ""
        narrower.append(blockq._load(out))
        assert narrower[-1].rakv_blockq_simd() < simd

    def outputs():
        res = []
        for kind in ("q4", "q8", "q8x"):
            b = _random_codes(kind, 70, 160, seed=4)       # fresh codes: bound to the library now in use
            torch.manual_seed(5)
            x, bias = torch.randn(1, 64, 160), torch.randn(70)
            res += [b(x[:, :M], bias) for M in (1, 2, 3, 9, 17, 30, 64)]
        torch.manual_seed(6)
        qk = torch.randn(1, 5, 8, 32)
        k, v = torch.randn(1, 2, 64, 32)[:, :, :26], torch.randn(1, 2, 64, 32)[:, :, :26]
        res.append(blockq.attend(qk, 8 * 32, k, v, 5, 6, 2, 32, 0.2))
        res.append(blockq.attend(qk, 8 * 32, k, v, 5, 6, 2, 32, 0.2, window=7, softcap=3.0))
        path = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 1, 3], [4, 0, 0]])
        depth = torch.tensor([0, 1, 1, 2, 0])
        res.append(blockq.attend_tree(qk, 8 * 32, k, v, 5, 6, 2, 32, 0.2, path, depth))
        # heads of 64 (the values' sums in registers), 9 query heads over 3, 9 rows past 41 keys
        qk = torch.randn(1, 9, 12, 64) * 3
        k, v = torch.randn(1, 3, 50, 64), torch.randn(1, 3, 50, 64)
        res.append(blockq.attend(qk, 12 * 64, k, v, 9, 9, 3, 64, 0.125))
        res.append(blockq.attend(qk[:, :1].contiguous(), 12 * 64, k[:, :, :42], v[:, :, :42], 1, 9, 3, 64, 0.125))
        return res

    a = outputs()
    for lib in narrower:
        monkeypatch.setattr(blockq._Lib, "handle", lib)
        b = outputs()
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_kernels_exp_is_within_an_ulp_of_libm_and_its_lanes_agree(tmp_path):
    """The kernel's own exp (softmax, SiLU) on a spread of 1M floats over the whole range (every
    4099th bit pattern): within 1 ulp of the C library's expf, inf / 0 / NaN where it gives them,
    and the 16-lane form's bits equal the scalar form's (scripts/att_exp_check.c; the script
    without -DSTRIDE checks every float)."""
    import subprocess
    from pathlib import Path

    cc = blockq._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(__file__).resolve().parents[2] / "scripts" / "att_exp_check.c"
    exe = tmp_path / "att_exp_check"
    r = subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-DSTRIDE=4099", "-o",
                        str(exe), str(src), "-lm"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout
    assert "!= scalar form: 0;" in r.stdout and "max |exp_f - expf| 1 ulp" in r.stdout, r.stdout


# ----------------------------------------------------------------------------- every layer of a step in C
@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_a_step_runs_every_layer_in_c_and_keeps_its_tokens(kernel, arch, monkeypatch):
    """A decode or verify step of a block-coded Llama-family model runs all its layers in one C call
    (``blockq.decode_layers``: norms, rotary, KV write, attention, MLP); its logits are the Python
    layers' to float rounding, a verify row is still its decode step bit for bit, and every policy
    still gives transformers' greedy ids (Mistral: a sliding window; Qwen2: q, k, v biases).
    ``RAKV_C_LAYERS`` is read when the backend is chosen (at load): each setting chooses again."""
    from rakv import decoding as dec
    from rakv.backends import select_backend

    target, draft, _ = _block_pair(arch)
    m = target.model
    calls = []
    real = blockq.decode_layers
    monkeypatch.setattr(blockq, "decode_layers", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    prompt = [(5 * i + 3) % 300 for i in range(24)]
    steps = {}
    for c_layers in ("1", "0"):
        monkeypatch.setenv("RAKV_C_LAYERS", c_layers)
        select_backend(target)                                    # the switch is read at selection
        cache = dec.DynamicCache()
        dec.prefill(m, prompt, cache)
        one = [dec.forward(m, [t], cache)[-1] for t in (7, 8, 9)]
        cache = dec.DynamicCache()
        dec.prefill(m, prompt, cache)
        rows = dec.forward(m, [7, 8, 9], cache)                 # [3, V]
        steps[c_layers] = (one, rows)
        if c_layers == "1":
            assert calls == [1, 1, 1, 3]                          # three decode steps, one verify of 3
            assert all(torch.equal(a, b) for a, b in zip(one, rows))
    for a, b in zip(steps["1"][0], steps["0"][0]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("RAKV_C_LAYERS", "1")
    select_backend(target)
    for policy in ("ar", "spec:4", "joint:2"):
        eng = Engine(target, ModelDraft(draft) if policy != "ar" else None, RakvConfig(policy=policy))
        for p in (prompt, prompt[:10] + [1, 2, 3] * 5):
            assert_exact(eng.generate(p, 16), target, p, 16, (arch, policy))


def test_c_steps_on_two_caches_in_turn_and_after_crops_keep_each_caches_logits(kernel, monkeypatch):
    """The C forward reuses its KV buffers without looking again while every layer still holds the
    views it left (``lean.buffers_hold``; one allocation for all layers): steps on two caches in
    turn (engines sharing a target), a crop, a 20-row forward through the Python layers between
    steps and a cache grown past its buffer still give each cache's own logits, bit for bit those
    of a cache that stepped alone."""
    from rakv import decoding as dec

    monkeypatch.setenv("RAKV_C_LAYERS", "1")
    m = _block_pair("llama")[0].model
    pa, pb = [(5 * i + 3) % 300 for i in range(24)], [(7 * i + 1) % 300 for i in range(30)]

    burst = [(3 * j + 1) % 300 for j in range(20)]           # 20 rows: the Python layers, same buffers

    def alone(p, toks, crop_after=None):
        c = dec.DynamicCache()
        dec.prefill(m, p, c)
        out = []
        for j, t in enumerate(toks):
            out.append(dec.forward(m, [t], c)[-1])
            if j == crop_after:
                dec.rollback(c, 2)
                out.append(dec.forward(m, burst, c)[-1])
        return out

    toks = [(11 * j + 2) % 300 for j in range(300)]          # past KV_MIN_CAPACITY: a buffer grows
    want_a, want_b = alone(pa, toks, crop_after=5), alone(pb, toks)
    ca, cb = dec.DynamicCache(), dec.DynamicCache()
    dec.prefill(m, pa, ca)
    dec.prefill(m, pb, cb)
    got_a = []
    for j, t in enumerate(toks):
        got_a.append(dec.forward(m, [t], ca)[-1])
        if j == 5:
            dec.rollback(ca, 2)
            got_a.append(dec.forward(m, burst, ca)[-1])
        assert torch.equal(dec.forward(m, [t], cb)[-1], want_b[j]), j
    assert len(got_a) == len(want_a) and all(torch.equal(a, b) for a, b in zip(got_a, want_a))


def test_a_gone_caches_kv_buffer_serves_the_next_cache_and_a_live_or_viewed_one_does_not(kernel, monkeypatch):
    """``lean.KvPool``: a request's KV buffer is reused by the next cache once its cache is gone
    (fresh pages cost page faults), never while that cache lives or anyone keeps a view of it, and
    the reused buffer's stale positions do not leak into the next cache's logits."""
    from rakv import decoding as dec
    from rakv.kernels import lean

    monkeypatch.setenv("RAKV_C_LAYERS", "1")
    monkeypatch.setattr(lean.kv, "KV_POOL", lean.KvPool(keep=2))
    m = _block_pair("llama")[0].model
    pa, pb = [(5 * i + 3) % 300 for i in range(24)], [(7 * i + 1) % 300 for i in range(20)]

    def steps(p, toks):
        c = dec.DynamicCache()
        dec.prefill(m, p, c)
        return c, [dec.forward(m, [t], c)[-1] for t in toks]

    toks = [(11 * j + 2) % 300 for j in range(6)]
    ca, want_a = steps(pa, toks)
    buf_a = lean.views_of(ca).K.data_ptr()
    cb, want_b = steps(pb, toks)                      # a is alive: b gets a buffer of its own
    assert lean.views_of(cb).K.data_ptr() != buf_a
    buf_b = lean.views_of(cb).K.data_ptr()
    kept = cb.layers[-1].keys                         # someone keeps a view of b's KV
    del ca, cb
    cc, got = steps(pb, toks)                         # a's buffer is free, b's is viewed
    assert lean.views_of(cc).K.data_ptr() == buf_a
    assert all(torch.equal(x, y) for x, y in zip(got, want_b))
    assert kept.data_ptr() != lean.views_of(cc).K.data_ptr() and kept.shape[-2] == len(pb) + len(toks)
    del kept, cc
    cd, got = steps(pa, toks)
    assert lean.views_of(cd).K.data_ptr() in (buf_a, buf_b)
    assert all(torch.equal(x, y) for x, y in zip(got, want_a))
    assert len(lean.kv.KV_POOL.entries) <= 3


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_rollback_after_c_steps_makes_the_same_views_as_a_crop(kernel, monkeypatch, arch):
    """``lean._Views.crop`` (the rollback after a verify on the C layers): every layer's K and V are
    the views ``DynamicCache.crop`` would have made (same buffer, offset, shape, strides, values),
    the next steps' logits are bit for bit those after a real crop, and a cache that is not in the
    C forward's state (a layer replaced) is left to ``crop``. Mistral: its sliding-window layers
    keep transformers' own crop where the cache holds them."""
    from rakv import decoding as dec
    from rakv.kernels import lean

    monkeypatch.setenv("RAKV_C_LAYERS", "1")
    monkeypatch.setattr(lean.kv, "KV_POOL", lean.KvPool())    # (a pooled buffer of another capacity: other strides)
    m = _block_pair(arch)[0].model
    prompt = [(5 * i + 3) % 300 for i in range(24)]

    def run(fast: bool):
        c = dec.DynamicCache()
        dec.prefill(m, prompt, c)
        dec.forward(m, [7], c)
        out, used = [], []
        for drafts, reject in (([8, 9, 10, 11], 3), ([12, 13], 2), ([14, 15, 16], 1)):
            dec.forward(m, drafts, c)                              # a verify
            if fast:
                used.append(lean.views_of(c).crop(c, reject))
                if not used[-1]:
                    c.crop(-reject)
            else:
                c.crop(-reject)
            out.append(dec.forward(m, [drafts[0]], c)[-1])
        return c, out, used

    fast, slow = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fast[1], slow[1]))
    for La, Lb in zip(fast[0].layers, slow[0].layers):
        for a, b in ((La.keys, Lb.keys), (La.values, Lb.values)):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if arch == "llama":
        assert fast[2] == [True, True, True]
        c = fast[0]
        c.layers[0].keys = c.layers[0].keys.clone()                # no longer the C forward's view
        assert not lean.views_of(c).crop(c, 1)


def test_a_model_the_c_layers_cannot_run_keeps_the_python_ones(kernel, monkeypatch):
    """GPT-2, a model without block codes: no C layers (they would be wrong maths, not slower)."""
    from rakv import decoding as dec

    calls = []
    real = blockq.decode_layers
    monkeypatch.setattr(blockq, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    for t in (_block_pair("gpt2")[0], wrap_tiny(make_model("llama"), tiny_tokenizer(), name="tiny-llama-fp32")):
        cache = dec.DynamicCache()
        dec.prefill(t.model, [3, 4, 5, 6], cache)
        dec.forward(t.model, [7], cache)
    assert calls == []


def test_the_floor_of_a_coded_model_is_the_kernels_own_pass(kernel):
    """On block codes the weight-streaming floor times the kernel calls the lean forward makes
    (q|k|v, o, gate|up, down a layer, and the head), not every HF module through Python."""
    target, _, _ = _block_pair("llama")
    m = target.model
    ops = fastpath._coded_ops(m)
    assert len(ops) == 4 * m.config.num_hidden_layers + 1
    assert fastpath.linear_floor_ms(m, rows=1, reps=2) > 0
    assert fastpath._coded_ops(wrap_tiny(make_model("llama"), tiny_tokenizer(), name="tiny-fp32").model) == []
