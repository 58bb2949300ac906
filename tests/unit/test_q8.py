"""q8 numerics (``--numerics q8``): integer dot products of 8-bit activation groups with the weight
codes. The kernel against a plain torch reference of the same sums (tests/q8_reference.py), bit for
bit, for every kind of codes and every GGUF type; the narrower builds alike; and every policy, draft
and k on tiny random models equal to target-only decoding in q8, greedy and seeded."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from rakv.backends import lean_of
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.kernels import blockq
from rakv.drafts.int8 import int8_copy
from rakv.drafts.layers import layers_copy
from rakv.load.loaded import ModelError
from rakv.load.numerics import resolve_numerics, set_numerics
from rakv.config import Sampling
from tests import q8_reference as ref
from tests.tiny import make_pair, synthetic_profile

kernel = pytest.mark.skipif(blockq.library() is None, reason=f"no block kernel: {blockq.reason()}")


def _codes(kind: str, N: int, K: int, seed: int = 0) -> blockq.BlockWeight:
    g = torch.Generator().manual_seed(seed)
    if kind == "q4":
        return blockq.BlockWeight("q4", N, K, torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g),
                                  torch.rand(N, K // 32, generator=g) * 0.1, torch.randn(N, K // 32, generator=g) * 0.1)
    if kind == "q8x":
        return blockq.BlockWeight("q8x", N, K, torch.randint(0, 64, (N, K // 32, 32), dtype=torch.uint8, generator=g),
                                  torch.rand(N, K // 16, generator=g) * 0.1, torch.randn(N, K // 16, generator=g) * 0.1)
    return blockq.quantize_q8_0(torch.randn(N, K, generator=g))


@kernel
@pytest.mark.parametrize("kind", ["q4", "q8", "q8x"])
@pytest.mark.parametrize("K", [32, 96, 256, 288, 800])      # odd blocks, a partial last group, several groups
def test_the_kernel_equals_the_torch_reference_bit_for_bit(kind, K):
    b = _codes(kind, 37, K, seed=K).with_numerics("q8")
    torch.manual_seed(K)
    x, bias = torch.randn(17, K) * 3, torch.randn(37)
    x[2] = 0.0                                    # a row of zeros (dx = 0)
    x[3, :32] = 0.0                               # a group's first block zero
    for M in (1, 2, 5, 9, 17):
        got = b(x[:M], bias)
        assert torch.equal(got, ref.linear(b, x[:M], bias)), (kind, K, M)
        # and each row alone (a decode step) is the same row among M (a verify)
        for i in range(M):
            assert torch.equal(b(x[i:i + 1], bias)[0], got[i])


@pytest.mark.fast
@kernel
def test_q8_numerics_stay_close_to_the_fp32_linear():
    """Not a bit-exactness property: the 8-bit activations move a dot product by well under 1%
    of the output scale on random data (what llama.cpp's arithmetic does too)."""
    for kind in ("q4", "q8", "q8x"):
        b = _codes(kind, 64, 512, seed=3)
        x = torch.randn(4, 512)
        y32, y8 = b(x), b.with_numerics("q8")(x)
        assert float((y8 - y32).abs().max() / y32.abs().max()) < 0.02


gguf = pytest.importorskip("gguf")
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@kernel
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_every_gguf_type_runs_from_its_own_codes_in_q8(qtype):
    from tests.unit.test_gguf_codes import _raw

    N, K = 12, 512
    raw, w = _raw(qtype, N, K, seed=1)
    b = blockq.from_gguf(raw, qtype, N, K)
    assert b is not None and torch.equal(b.dequantize(), w)
    q = b.with_numerics("q8")
    x = torch.randn(9, K)
    assert torch.equal(q(x), ref.linear(q, x))
    assert torch.equal(q(x[4:5])[0], q(x)[4])


@kernel
@pytest.mark.parametrize("form", ["q4", "q8", "q8x", "Q4_K", "Q6_K"])
def test_every_row_count_gives_a_rows_own_bits(form):
    """Tiles of 16 outputs take 1 row (VNNI or portable) or 2+ rows at once (AMX tiles where the CPU
    and kernel allow them, else TROWS at a time): a row's output is the same bits in every case, and
    the torch reference's. N = 37 leaves a part tile."""
    from tests.unit.test_gguf_codes import _raw

    N, K = 37, 768
    if form.startswith("Q"):
        raw, _ = _raw(form, N, K, seed=4)
        b = blockq.from_gguf(raw, form, N, K).with_numerics("q8")
    else:
        b = _codes(form, N, K, seed=4).with_numerics("q8")
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([b(x[i:i + 1]) for i in range(x.shape[0])])
    if b.kind != "q8x" or b.compact:
        assert torch.equal(alone, ref.linear(b, x))
    for M in (2, 3, 5, 9, 16, 17, 33):
        assert torch.equal(b(x[:M]), alone[:M]), M
    bias = torch.randn(N)
    assert torch.equal(b(x[:9], bias), b(x[:9]) + bias)


_AMX_SCRIPT = """
import sys, torch
from rakv.kernels import blockq
from tests.unit.test_q8 import _tiled_cases
torch.save([b(x) for b, x in _tiled_cases()], sys.argv[1])
"""


def _tiled_cases():
    from tests.unit.test_gguf_codes import _raw

    out = []
    for form in ("q4", "q8", "Q4_K", "Q6_K"):
        if form.startswith("Q"):
            raw, _ = _raw(form, 37, 768, seed=4)
            b = blockq.from_gguf(raw, form, 37, 768).with_numerics("q8")
        else:
            b = _codes(form, 37, 768, seed=4).with_numerics("q8")
        out += [(b, torch.randn(M, 768, generator=torch.Generator().manual_seed(M))) for M in (2, 5, 9, 17)]
    return out


@kernel
def test_amx_tiles_give_the_vnni_bits(tmp_path):
    """RAKV_AMX=1 runs 2+ rows on AMX-INT8 tiles where the CPU and the OS allow them: the same exact
    block sums, so the same bits as the default form."""
    import ctypes
    import os
    import subprocess
    import sys

    if "amx_int8" not in open("/proc/cpuinfo").read():
        pytest.skip("no AMX-INT8 on this CPU")
    out = tmp_path / "amx.pt"
    env = dict(os.environ, RAKV_AMX="1")
    code = ("import ctypes; from rakv.kernels import blockq; "
            "print(blockq.library().rakv_tiled_simd(ctypes.c_int64(9)))")
    form = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if form.stdout.strip() != "2":
        pytest.skip("AMX tiles refused here (the kernel did not grant the tile state)")
    subprocess.run([sys.executable, "-c", _AMX_SCRIPT, str(out)], env=env, check=True,
                   cwd=str(Path(__file__).resolve().parents[2]))
    amx = torch.load(out)
    assert blockq.library().rakv_tiled_simd(ctypes.c_int64(9)) != 2      # this process: the default form
    assert all(torch.equal(a, b(x)) for a, (b, x) in zip(amx, _tiled_cases()))


@kernel
@pytest.mark.parametrize("form", ["q4", "q8", "Q4_K", "Q6_K"])
def test_the_lane_form_keeps_a_rows_own_bits(form, monkeypatch):
    """RAKV_TILES=0 (the lane form, kept for comparisons) is its own fixed order: a row's output is
    the same bits whatever rows ride with it, and close to the tiled form's."""
    from tests.unit.test_gguf_codes import _raw

    if form.startswith("Q"):
        raw, _ = _raw(form, 37, 768, seed=6)
        base = blockq.from_gguf(raw, form, 37, 768)
    else:
        base = _codes(form, 37, 768, seed=6)
    lanes = base.with_numerics("q8", lanes=True)             # (RAKV_TILES=0 as a load reads it)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(7))
    y = lanes(x)
    assert lanes._tiled is None
    assert all(torch.equal(lanes(x[i:i + 1])[0], y[i]) for i in range(9))
    torch.testing.assert_close(base.with_numerics("q8")(x), y, rtol=1e-4, atol=1e-3)


def test_the_tiled_form_in_use_is_named():
    lib = blockq.library()
    if lib is None:
        pytest.skip(blockq.reason() or "no C kernel")
    import ctypes

    one, nine = lib.rakv_tiled_simd(ctypes.c_int64(1)), lib.rakv_tiled_simd(ctypes.c_int64(9))
    assert one in (0, 1) and nine in (0, 1, 2) and (nine == 2) <= (one == 1)


NARROWER = [("-mno-avx512vnni",), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")]


@kernel
def test_the_narrower_builds_give_the_same_bits(tmp_path, monkeypatch):
    """The VNNI kernel, the portable C under AVX-512 without VNNI, AVX2 and plain x86-64: one set of
    bits for every kind and row count."""
    native = blockq.library()
    if platform.machine().lower() not in ("x86_64", "amd64") or native.rakv_q8act_simd() != 2:
        pytest.skip("the native build has no AVX-512 VNNI form to compare with")
    libs = []
    for i, flags in enumerate(NARROWER):
        out = tmp_path / f"n{i}.so"
        assert blockq._build(blockq._compiler(), out, flags) == ""
        libs.append(blockq._load(out))
        assert libs[-1].rakv_q8act_simd() == 0

    def outputs():
        res = []
        for kind in ("q4", "q8", "q8x"):
            b = _codes(kind, 21, 288, seed=7).with_numerics("q8")     # fresh: bound to the library in use
            x = torch.randn(10, 288, generator=torch.Generator().manual_seed(8))
            res += [b(x[:M], torch.ones(21)) for M in (1, 3, 10)]
        from tests.unit.test_gguf_codes import _raw

        for qtype in ("Q4_K", "Q6_K"):               # with the file's own integer scales
            raw, _ = _raw(qtype, 6, 512, seed=3)
            b = blockq.from_gguf(raw, qtype, 6, 512).with_numerics("q8")
            res.append(b(torch.randn(9, 512, generator=torch.Generator().manual_seed(9))))
        return res

    a = outputs()
    for lib in libs:
        monkeypatch.setattr(blockq._Lib, "handle", lib)
        assert all(torch.equal(u, v) for u, v in zip(a, outputs()))


# ----------------------------------------------------------------------------- whole models
def _q8_pair(arch: str, agreement: str):
    t, d = make_pair(arch, agreement)
    return set_numerics(t, "q8"), set_numerics(d, "q8")


def prompts():
    base = list(range(5, 45))
    return [base, base[:30] + [7, 8, 9, 10], base[:12], [3, 4, 5] * 6]


def _ar(target, n=20, sampling=None):
    cfg = RakvConfig(policy="ar", sampling=sampling or Sampling())
    e = Engine(target, None, cfg)
    return {tuple(p): e.generate(p, n).output_ids for p in prompts()}


POLICIES = ["kv", "spec:1", "spec:2", "spec:4", "spec:8", "joint:3", "adaptive", "adaptive:nogate"]


@kernel
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("agreement", ["identical", "mostly", "disagree"])
def test_every_policy_equals_target_only_decoding_in_q8(arch, agreement):
    target, draft = _q8_pair(arch, agreement)
    assert target.numerics == "q8" and "+q8:" in target.key
    want = _ar(target)
    for policy in POLICIES:
        prof = synthetic_profile() if policy.startswith("adaptive") else None
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), profile=prof)
        for p in prompts() + prompts():           # the second pass: exact repeats and partial hits
            assert eng.generate(p, 20).output_ids == want[tuple(p)], (policy, p[:4])


@kernel
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_seeded_sampling_in_q8_gives_target_only_samples(arch):
    target, draft = _q8_pair(arch, "mostly")
    s = Sampling(temperature=0.8, top_p=0.95, seed=11)
    want = _ar(target, sampling=s)
    for policy in ("kv", "spec:3", "joint:4"):
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy, sampling=s))
        for p in prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], policy


@kernel
def test_other_drafts_and_trees_in_q8():
    target, _ = _q8_pair("llama", "identical")
    want = _ar(target)
    drafts = [NgramDraft(), ModelDraft(int8_copy(target)), ModelDraft(layers_copy(target, 1))]
    for src, policy in [(drafts[0], "spec:4"), (drafts[0], "tree:8"), (drafts[1], "joint:2"), (drafts[2], "spec:3")]:
        eng = Engine(target, src, RakvConfig(policy=policy))
        for p in prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], policy


@kernel
def test_eos_mid_round_in_q8():
    target, draft = _q8_pair("llama", "identical")
    p = list(range(30, 50))
    free = Engine(target, None, RakvConfig(policy="ar")).generate(p, 30).output_ids
    j = next(i for i in range(5, 30) if free[i] not in free[:i])
    target.eos_ids = frozenset({free[j]})
    for k in (1, 3, 8):
        end = Engine(target, ModelDraft(draft), RakvConfig(policy=f"spec:{k}")).generate(p, 30)
        assert end.output_ids == free[:j + 1] and end.stopped == "eos"


@kernel
def test_numerics_switch_back_and_name_the_key():
    target, _ = make_pair("llama", "mostly")
    fp = _ar(target)
    key = target.key
    set_numerics(target, "q8")
    assert target.key != key and target.numerics == "q8"
    set_numerics(target, "fp32")
    assert target.key == key and _ar(target) == fp


@pytest.mark.fast
def test_auto_numerics_follow_the_model_form():
    assert resolve_numerics("demo") == "q8" and resolve_numerics("x/model.GGUF") == "q8"
    assert resolve_numerics("./some_dir") == "fp32" and resolve_numerics("gpt2", "q8") == "q8"
    with pytest.raises(ModelError):
        resolve_numerics("demo", "int4")


@kernel
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_kquant_scales_as_the_file_holds_them_sum_in_integers(qtype):
    """Q4_K / Q6_K read with their own integer scales (what a q8 step streams: 4.75 / 8.6 bits a
    weight) multiply each lane sum by its integer scale sc inside the int32 sum of the super-block,
    then by the float dg once: the torch reference's bits, the float-scale form's values to float
    rounding, and the same bits for a row whatever rows ride with it."""
    from tests.unit.test_gguf_codes import _raw

    N, K = 9, 768
    raw, _ = _raw(qtype, N, K, seed=2)
    b = blockq.from_gguf(raw, qtype, N, K)
    assert b.compact
    flat = blockq.BlockWeight(b.kind, b.N, b.K, b.qs, b.d, b.m)
    x = torch.randn(10, K)
    q, f = b.with_numerics("q8"), flat.with_numerics("q8")
    y = q(x)
    assert torch.equal(y, ref.linear(q, x)) and torch.equal(f(x), ref.linear(f, x))
    torch.testing.assert_close(y, f(x), rtol=1e-5, atol=1e-4)
    for i in range(x.shape[0]):                                     # a row alone: the same bits
        assert torch.equal(q(x[i:i + 1]), y[i:i + 1])
    assert q.streamed_bytes < f.streamed_bytes
    idx = [3, 0, 8, 1]
    assert torch.equal(q.rows(idx)(x), y[:, idx])                   # a row permutation keeps them
    both = blockq.concat([q, q.rows(idx)])
    assert both.compact and torch.equal(both(x), torch.cat([y, y[:, idx]], 1))


@kernel
@pytest.mark.parametrize("numerics", ["fp32", "q8"])
def test_c_layers_run_q_k_v_on_codes_of_different_kinds(numerics):
    """A Q4_K_M file codes q and k as Q4_K and v as Q6_K: they cannot be stacked, so the step's C
    layers run the three apart into the fused layer's columns (before, such a model fell back to
    the Python layers). Every policy still equals target-only decoding."""
    from tests.tiny import make_model, snap_to_blocks, tiny_tokenizer, wrap_tiny

    m = snap_to_blocks(make_model("llama", seed=3), "q4")
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.self_attn.v_proj.weight
            w.copy_(blockq.quantize_q8_0(w).dequantize())                   # v as Q8 codes: another kind
    target = wrap_tiny(m, tiny_tokenizer(), name="tiny-mixed")
    set_numerics(target, numerics)
    lean = lean_of(target.model)
    descs = lean.c_layers_on()
    assert descs and descs[0].qkv is None and descs[0].v_part, "the C layers should run q, k, v apart"
    want = _ar(target)
    for policy in ("spec:3", "joint:4"):
        eng = Engine(target, NgramDraft(), RakvConfig(policy=policy))
        for p in prompts():
            assert eng.generate(p, 20).output_ids == want[tuple(p)], policy


@kernel
@pytest.mark.parametrize("split", [0, 1, 12, 23, 24, 40])
def test_a_prefill_computes_each_row_as_its_decode_step_in_q8(split):
    """Under q8 every forward runs the steps' arithmetic (the C layers, each row alone), so a
    prefix hit's suffix (any length, past the attention kernel's old 17-row limit too) gives the
    KV and logits of the same positions of a whole prefill, bit for bit."""
    from rakv import decoding as dec

    target, _ = _q8_pair("llama", "identical")
    assert target.lean and lean_of(target.model).rows_alone()
    ids = [(7 * i + 3) % 200 for i in range(41)]
    whole = dec.DynamicCache()
    want = dec.forward(target.model, ids, whole)                  # [41, V]
    cache = dec.DynamicCache()
    parts = [dec.forward(target.model, ids[:split], cache)] if split else []
    parts.append(dec.forward(target.model, ids[split:split + 1], cache))         # one decode step
    if split + 1 < len(ids):
        parts.append(dec.forward(target.model, ids[split + 1:], cache))
    got = torch.cat(parts)
    assert torch.equal(got, want)
    for a, b in zip(whole.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
