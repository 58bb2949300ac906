"""A GGUF whose linears keep the file's codes is converted SLIM: no fp32 copy of those weights is
written (the codes stand for them bit for bit); a q8 load leaves them unmade (q8 arithmetic runs the
codes), and anything that needs fp32 weights (fp32 numerics, an int8 copy) makes them from the codes,
giving exactly what a full conversion gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import rakv.drafts.int8 as DI
import rakv.load.gguf as LG
import rakv.load.hub as LH
import rakv.load.numerics as LN
import rakv.load.slim as LS
from rakv.config import RakvConfig
from rakv.decide.profile import CostProfile
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.kernels.fastpath import FastLinear

from tests.unit.test_gguf import write_llama_gguf
from tests.unit.test_gguf_codes import Q4_K_M, kernel
from tests.unit.test_fastpath import needs_onednn
from tests.tiny import make_model

PROMPTS = [[(7 * i + 3) % 300 for i in range(40)], [(5 * i + 1) % 300 for i in range(12)]]
PROFILE = dict(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
               d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)


@pytest.fixture
def kquant(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "tiny-kquant.gguf"
    write_llama_gguf(f, make_model("llama", hidden=256), qtypes=Q4_K_M)
    return f


def _ids(lm, policy: str = "ar", draft=None) -> list:
    lm.eos_ids = frozenset()
    eng = Engine(lm, draft or NgramDraft(), RakvConfig(policy=policy), profile=CostProfile(**PROFILE))
    return [eng.generate(p, 16).output_ids for p in PROMPTS]


def _linears(lm):
    return [(n, m) for n, m in lm.model.named_modules() if isinstance(m, FastLinear)]


@pytest.mark.fast
@kernel
@needs_onednn
def test_the_converted_folder_holds_no_fp32_copy_of_a_coded_weight(kquant):
    folder, _ = LG.ensure_gguf(kquant)
    assert not list(folder.glob("model*.safetensors"))
    with safe_open(str(folder / LS.SLIM_FILE), "pt") as f:
        names = set(f.keys())
    assert names and not any(n.endswith(("proj.weight", "lm_head.weight")) for n in names)
    assert "model.embed_tokens.weight" not in names and "model.norm.weight" in names     # the table too
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert size < 2 * kquant.stat().st_size             # codes + norms, not fp32 weights


@kernel
@needs_onednn
def test_a_q8_load_leaves_the_weights_unmade_and_equals_q8_on_made_weights(kquant):
    slim = LH.load_model(str(kquant), fast=True, numerics="q8")
    assert slim.slim and slim.numerics == "q8" and slim.lean == "llama"
    assert all(LS.placeholder(m.weight) for _, m in _linears(slim))
    assert LS.placeholder(slim.model.model.embed_tokens.weight)           # its rows come from the codes
    assert slim.blockq["layers"] == slim.blockq["of"] == 15
    full = LN.set_numerics(LH.load_model(str(kquant), fast=True, numerics="fp32"), "q8")
    assert not full.slim and not any(LS.placeholder(m.weight) for _, m in _linears(full))
    assert slim.key == full.key
    want = _ids(full)
    assert _ids(slim) == want
    for policy in ("kv", "spec:4", "joint:2", "adaptive"):        # every policy exact on the slim load
        assert _ids(slim, policy) == want, policy


@kernel
@needs_onednn
def test_fp32_numerics_and_an_int8_copy_make_the_weights_from_the_codes(kquant):
    fp32 = LH.load_model(str(kquant), fast=True, numerics="fp32")
    slim = LH.load_model(str(kquant), fast=True, numerics="q8")
    q = DI.int8_copy(slim)                                     # made in the copy; the target stays slim
    assert slim.slim and all(LS.placeholder(m.weight) for _, m in _linears(slim))
    ref = DI.int8_copy(fp32)
    for (n, a), (_, b) in zip(sorted(q.model.state_dict().items()), sorted(ref.model.state_dict().items())):
        if isinstance(a, torch.Tensor) and a.dtype == torch.float32 and not LS.placeholder(a):
            assert torch.equal(a, b), n                  # (the token table: rows from the codes)
    assert _ids(slim, "spec:4", ModelDraft(q)) == _ids(slim)
    LN.set_numerics(slim, "fp32")                              # switched: the weights made, bit for bit
    assert not slim.slim
    w = dict(fp32.model.named_parameters())
    for n, p in slim.model.named_parameters():
        assert torch.equal(p, w[n]), n
    assert _ids(slim) == _ids(fp32)


@kernel
@needs_onednn
def test_a_slim_folder_without_its_codes_is_converted_again(kquant, capsys):
    folder, _ = LG.ensure_gguf(kquant)
    (folder / LS.CODES_FILE).write_bytes(b"\0" * 64)
    lm = LH.load_model(str(kquant), fast=True, numerics="q8")
    assert "converting it again" in capsys.readouterr().err
    assert lm.slim and lm.blockq["layers"] == 15


@kernel
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_codes_are_saved_without_fp32_scales_and_make_the_same_ones(qtype, tmp_path):
    from rakv.kernels import blockq

    from tests.unit.test_gguf_codes import _raw

    N, K = 64, 512
    raw, w = _raw(qtype, N, K)
    b = blockq.from_gguf(raw, qtype, N, K)
    assert b.compact and b.d is not None and torch.equal(b.dequantize(), w)
    blockq.save_codes(tmp_path / "c.safetensors", {"w": b, "tied": b})
    got = blockq.load_codes(tmp_path / "c.safetensors")
    assert got["tied"] is got["w"]                                   # one copy of a shared weight
    c = got["w"]
    assert c.d is None and c.m is None and c.nbytes < b.nbytes
    x = torch.randn(3, K)
    assert torch.equal(c.with_numerics("q8")(x), b.with_numerics("q8")(x))     # q8 never needs them
    assert c.d is None
    assert torch.equal(c(x), b(x))                                   # fp32 arithmetic makes them ...
    assert torch.equal(c.d, b.d) and torch.equal(c.m, b.m)           # ... the very floats from_gguf made
    assert torch.equal(c.rows([5, 1]).dequantize(), b.dequantize()[[5, 1]])


@kernel
@needs_onednn
def test_the_int8_draft_of_a_slim_target_looks_its_rows_up_from_the_codes_and_is_cached(kquant, tmp_path):
    slim = LH.load_model(str(kquant), fast=True, numerics="q8")
    fp32 = LH.load_model(str(kquant), fast=True, numerics="fp32")
    made = DI.int8_copy(slim)                                   # quantized (then cached)
    loaded = DI.int8_copy(slim)                                 # from the cache
    ref = DI.int8_copy(fp32)
    ids = torch.tensor([PROMPTS[0]])
    want = ref.model(ids).logits
    for q in (made, loaded):
        assert LS.placeholder(q.model.model.embed_tokens.weight)              # no table of zeros
        assert torch.equal(q.model(ids).logits, want)
