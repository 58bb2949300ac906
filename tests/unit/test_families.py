"""The lean forward of every family it runs (Llama lineage: Mistral with a window, Qwen3, Gemma 2,
Gemma 3, Phi-3): its logits equal HF's, and the engine's greedy ids under every policy (model,
int8 and layers drafts) equal transformers' ``generate`` on an untouched copy, on tiny random
models of each config with the features switched on (sliding windows smaller than the prompts,
soft-capping, q / k norms, partial rotary, attention biases). A config it does not reproduce
runs HF's forward, which the engine keeps exact too (a sliding-window cache is cropped and reused
like any other: the engine's cache keeps every position)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

from rakv import decoding as dec
from rakv.config import RakvConfig
from rakv.decide.profile import CostProfile
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.backends import lean_of
from rakv.kernels import fastpath, lean
from rakv.drafts.int8 import int8_copy
from rakv.drafts.layers import layers_copy
from rakv.load.numerics import wrap

from .test_fastpath import needs_onednn
from tests.tiny import VOCAB, oracle, perturbed
from tests.tiny import hf_forward as _hf  # HF's own forward, whatever the model has attached

WINDOW = 6           # smaller than every prompt: the window is exercised from the prefill on

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.4, eos_token_id=None,
              bos_token_id=0, pad_token_id=1, tie_word_embeddings=False)

FAMILIES = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM,
              dict(head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                   max_window_layers=1)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                    query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               dict(head_dim=16, sliding_window=WINDOW, final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh")),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(partial_rotary_factor=0.5, sliding_window=WINDOW + 2)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
}
KIND = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "mistral": "llama"}


def make_family(name: str, seed: int = 0, layers: int = 2, **extra) -> torch.nn.Module:
    """A tiny random model of ``name``'s config; norm weights random too (Gemma's start at zero)."""
    Cfg, Model, kw = FAMILIES[name]
    torch.manual_seed(seed)
    if "layer_types" in kw:
        kw = {**kw, "layer_types": (kw["layer_types"] * layers)[:layers]}
    cfg = Cfg(**{**COMMON, **kw, "num_hidden_layers": layers, **extra})
    m = Model(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(0.0 if name.startswith("gemma") else 1.0, 0.3)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 1
    return m


PROFILE = dict(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
               d=[[16, 0.1], [256, 0.1]], V={str(k): 1.0 + 0.05 * k for k in range(1, 9)}, alpha0=0.9)
P1 = [(7 * i + 3) % 300 for i in range(40)]
PROMPTS = [P1, P1[:30] + [7, 8, 9, 10], [5, 6, 7] * 4, P1[:9]]      # partial hit of 30 > window; short ones


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_onednn)])
def test_lean_logits_equal_hf(name, fast):
    m = make_family(name, layers=3)
    if fast:
        fastpath.enable(m)
    assert lean.supported(m) is None and lean.attach(m) == "" and lean.kind(m) == KIND[name]
    ids = [(7 * i + 3) % 300 for i in range(48)]
    c_hf, c_lean = dec.DynamicCache(), dec.DynamicCache()
    for chunk, keep in ((ids[:25], 1), (ids[25:30], 0), (ids[30:31], 1), (ids[31:40], 0), (ids[40:41], 0)):
        a, b = _hf(m, chunk, c_hf, keep), dec.forward(m, chunk, c_lean, keep)
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for la, lb in zip(c_hf.layers, c_lean.layers):           # the KV it wrote is HF's: every position
        torch.testing.assert_close(lb.keys, la.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lb.values, la.values, rtol=1e-4, atol=1e-4)
    dec.rollback(c_hf, 4)                                    # a rollback past the window's edge
    dec.rollback(c_lean, 4)
    for chunk in (ids[37:39], ids[39:40], ids[40:48]):
        torch.testing.assert_close(dec.forward(m, chunk, c_lean), _hf(m, chunk, c_hf), rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_policy_and_draft_gives_transformers_ids(name):
    m = make_family(name)
    want = {tuple(p): oracle(copy.deepcopy(m), p, 24) for p in PROMPTS}    # generate on an untouched copy
    tok = None                                   # no EOS: every request runs its 24 tokens, as generate does
    target = wrap(m, tok, name=f"tiny-{name}", fast=True)
    assert target.lean == KIND[name]
    draft = wrap(perturbed(copy.deepcopy(m), 0.01), tok, name=f"tiny-{name}-draft", fast=True)
    assert draft.lean
    for policy in ["ar", "kv", "spec:1", "spec:4", "joint:2", "joint:8", "adaptive"]:
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), profile=CostProfile(**PROFILE))
        for p in PROMPTS + PROMPTS:              # the second pass: exact repeats; P1[:30] + ...: a partial hit
            end = eng.generate(p, 24)
            assert end.output_ids == want[tuple(p)], (policy, p)
        if policy in ("kv", "joint:2"):
            assert eng.generate(PROMPTS[1] + [11], 24).hit_tokens > WINDOW      # reuse past the window
    q, lay = int8_copy(target), layers_copy(target, 1)
    assert q.lean and lay.lean and lean_of(lay.model).layers == lean_of(target.model).layers[:1]
    for d in (q, lay):
        for policy in ("spec:4", "joint:2"):
            eng = Engine(target, ModelDraft(d), RakvConfig(policy=policy))
            for p in PROMPTS[:2]:
                assert eng.generate(p, 24).output_ids == want[tuple(p)], (d.name, policy, p)
    eng = Engine(target, NgramDraft(), RakvConfig(policy="joint:8"))
    for p in PROMPTS:
        assert eng.generate(p, 24).output_ids == want[tuple(p)]


@pytest.mark.parametrize("name", ["gemma2", "qwen3"])
def test_hf_forward_on_sliding_windows_stays_exact_too(name, monkeypatch):
    """No lean forward (RAKV_LEAN=0): HF's sliding-window forward on the engine's cache, cropped after
    rejected drafts and reused by the prefix cache past the window."""
    monkeypatch.setenv("RAKV_LEAN", "0")
    m = make_family(name)
    want = {tuple(p): oracle(copy.deepcopy(m), p, 20) for p in PROMPTS[:2]}
    tok = None
    target = wrap(m, tok, name=f"hf-{name}")
    draft = wrap(perturbed(copy.deepcopy(m), 0.02), tok, name=f"hf-{name}-draft")
    assert not target.lean
    for policy in ("kv", "joint:4"):
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy))
        for p in PROMPTS[:2] + PROMPTS[:2]:
            assert eng.generate(p, 20).output_ids == want[tuple(p)], (policy, p)


@pytest.mark.fast
def test_what_the_lean_forward_does_not_reproduce_runs_hf():
    g = make_family("gemma3")
    g.config.use_bidirectional_attention = True
    assert "bidirectional" in lean.supported(g)
    p = make_family("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                              "partial_rotary_factor": 0.5},
                    original_max_position_embeddings=64)
    assert "longrope" in lean.supported(p)
    lm = wrap(p, name="phi3-longrope", fast=True)
    assert not lm.lean and lean_of(lm.model) is None            # HF's forward runs
    d = make_family("qwen3")
    d.config.hidden_act = "relu"
    d.model.layers[0].mlp.act_fn = torch.nn.ReLU()
    assert "activation" in lean.supported(d)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_scaling_frequencies_are_hfs(rope):
    """Static rope scalings (linear, llama3, yarn) run lean on HF's own frequencies; dynamic does not."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(**COMMON, rope_parameters={"rope_theta": 10000.0, **rope})
    m = T.LlamaForCausalLM(cfg).eval()
    if rope["rope_type"] == "dynamic":
        assert "dynamic" in lean.supported(m)
        return
    assert lean.attach(m) == ""
    ids = [(7 * i + 3) % 300 for i in range(70)]
    c_hf, c_lean = dec.DynamicCache(), dec.DynamicCache()
    for chunk in (ids[:50], ids[50:51], ids[51:70]):
        torch.testing.assert_close(dec.forward(m, chunk, c_lean), _hf(m, chunk, c_hf), rtol=1e-4, atol=1e-4)
