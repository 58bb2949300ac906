"""The fast forward path (packed oneDNN linears), its switch and fallback; --device resolution."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rakv.kernels import fastpath
from rakv.cli import main
from rakv.config import RakvConfig
from rakv.decide.policy import batch_vs, lookup_vs
from rakv.util.device import DeviceError, resolve
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.drafts.int8 import int8_copy
from rakv.load.numerics import set_fast, wrap
from tests.tiny import hf_greedy, make_model, oracle, save_tiny, tiny_tokenizer

_NO_ONEDNN = fastpath.unavailable_reason(torch.nn.Linear(2, 2))    # a float32 CPU linear: only oneDNN can lack
needs_onednn = pytest.mark.skipif(_NO_ONEDNN is not None, reason=f"{_NO_ONEDNN} (the packed fast path needs it)")
PROMPTS = [list(range(5, 45)), [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5], list(range(60, 72))]


def n_linear(model) -> int:
    from transformers.pytorch_utils import Conv1D

    return sum(isinstance(m, (torch.nn.Linear, Conv1D)) for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_engaged_on_every_linear_and_same_greedy_ids(arch, monkeypatch):
    monkeypatch.delenv("RAKV_FAST", raising=False)
    plain = make_model(arch)
    want = n_linear(plain)                      # GPT-2: Conv1D layers + the LM head
    keys = sorted(plain.state_dict())
    ref = {tuple(p): oracle(plain, p, 20) for p in PROMPTS}
    lm = wrap(copy.deepcopy(plain), tiny_tokenizer(), name=f"tiny-{arch}")
    assert lm.fast and fastpath.is_enabled(lm.model)
    assert sum(isinstance(m, fastpath.FastLinear) for m in lm.model.modules()) == want
    assert sorted(lm.model.state_dict()) == keys          # HF stays the source of truth
    for p in PROMPTS:                   # HF's forward on the packed linears: the plain model's ids
        assert hf_greedy(lm.model, p, 20) == ref[tuple(p)]
    # the engine on the fast path: ar and speculation give the plain path's greedy ids
    draft = wrap(copy.deepcopy(plain), tiny_tokenizer(), name="d")
    for policy in ("ar", "spec:4", "joint:8"):
        eng = Engine(lm, ModelDraft(draft), RakvConfig(policy=policy))
        for p in PROMPTS:
            assert eng.generate(p, 20).output_ids == ref[tuple(p)], (policy, p)


@pytest.mark.fast
@needs_onednn
def test_switch_off_and_env(monkeypatch):
    lm = wrap(make_model("llama"), name="t", fast=False)
    assert not lm.fast and not fastpath.is_enabled(lm.model)
    set_fast(lm, True)
    assert lm.fast and fastpath.is_enabled(lm.model)
    set_fast(lm, False)
    assert not fastpath.is_enabled(lm.model) and all(type(m) is not fastpath.FastLinear for m in lm.model.modules())
    monkeypatch.setenv("RAKV_FAST", "0")
    assert not wrap(make_model("llama"), name="t").fast
    assert RakvConfig().fast is False
    monkeypatch.setenv("RAKV_FAST", "1")
    assert RakvConfig().fast is True and wrap(make_model("llama"), name="t").fast


@needs_onednn
def test_inplace_weight_change_repacks():
    lm = wrap(make_model("llama"), name="t")
    with torch.no_grad():
        for p in lm.model.parameters():
            p.mul_(1.7)
    got = hf_greedy(lm.model, PROMPTS[0], 12)
    fastpath.disable(lm.model)
    assert got == hf_greedy(lm.model, PROMPTS[0], 12)


def test_fallback_leaves_model_plain(monkeypatch):
    m16 = make_model("llama").to(torch.float16)
    info = fastpath.enable(m16)
    assert not info["fast"] and "float16" in info["reason"] and not fastpath.is_enabled(m16)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    lm = wrap(make_model("llama"), name="t", fast=True)
    assert not lm.fast and "oneDNN" in lm.fast_reason


@needs_onednn
def test_int8_draft_of_a_fast_target_and_deepcopy():
    lm = wrap(make_model("gpt2"), tiny_tokenizer(), name="t")
    q = int8_copy(lm)
    assert not fastpath.is_enabled(q.model)
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in q.model.modules())
    assert fastpath.is_enabled(lm.model)                  # the target is untouched
    c = copy.deepcopy(lm.model)
    assert fastpath.is_enabled(c) and hf_greedy(c, PROMPTS[1], 10) == hf_greedy(lm.model, PROMPTS[1], 10)
    assert fastpath.linear_floor_ms(lm.model, rows=1, reps=2) > 0
    assert fastpath.linear_floor_ms(q.model, rows=2, reps=2) > 0


# ----------------------------------------------------------------------------- devices
@pytest.mark.fast
def test_device_resolution_here():
    assert resolve("cpu") == "cpu"
    if not torch.cuda.is_available() and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        assert resolve("auto") == "cpu"
        with pytest.raises(DeviceError, match="not available"):
            resolve("cuda")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve("tpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fastmodels")
    save_tiny(d / "target", "llama")
    return d


def test_cli_unavailable_device_is_one_line_exit_2(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # also on a machine with a GPU
    code = main(["generate", "--target", str(tiny_dir / "target"), "--draft", "none", "--prompt", "hello",
                 "--device", "cuda", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "cuda" in err and "not available" in err and len(err.strip().splitlines()) == 1
    assert main(["calibrate", "--target", str(tiny_dir / "target"), "--draft", "none", "--device", "gpu"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_fast_and_plain_same_ids_and_calibrate_regime(tiny_dir, capsys):
    outs = []
    for flag in ("--fast", "--no-fast"):
        code = main(["generate", "--target", str(tiny_dir / "target"), "--draft", "ngram", "--policy", "spec:3",
                     "--prompt", "The quick brown fox jumps over the lazy dog.", "--max-new-tokens", "10",
                     "--json", "--device", "auto", flag])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs.append(json.loads(out)["output_ids"])
    assert outs[0] == outs[1]
    code = main(["calibrate", "--target", str(tiny_dir / "target"), "--draft", "int8", "--quick", "--json",
                 "--k-max", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    prof = json.loads(out)
    g = prof["regime"]
    assert g["floor_ms"] > 0 and g["step_ms"] > 0 and set(g["V_over_t"]) == {"1", "2", "3"} | {str(k) for k in lookup_vs(3) + batch_vs(3)}
    assert g["d_over_t"] > 0 and isinstance(g["isa"], list) and g["torch_threads"] >= 1
    assert prof["fingerprint"]["device"] == "cpu" and prof["fingerprint"]["fast"] == g["fast"]
    code = main(["calibrate", "--target", str(tiny_dir / "target"), "--draft", "int8", "--quick", "--k-max", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "weight-streaming floor" in out and "V(k)/t" in out and "d/t" in out and "ISA" in out


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_one_row_kernel_keeps_greedy_ids(arch, monkeypatch):
    """RAKV_ONE_ROW=packed: decode steps on the packed kernel too; every policy still gives the plain
    model's greedy ids (and the profile fingerprint tells the two kernels apart)."""
    from rakv.decide.profile import pair_fingerprint

    plain = make_model(arch)
    ref = {tuple(p): oracle(plain, p, 20) for p in PROMPTS}
    monkeypatch.setenv("RAKV_ONE_ROW", "packed")
    lm = wrap(copy.deepcopy(plain), tiny_tokenizer(), name=f"tiny-{arch}")
    assert lm.one_row == {"kernel": "packed", "how": "RAKV_ONE_ROW"} and fastpath.one_row_kernel(lm.model) == "packed"
    draft = wrap(copy.deepcopy(plain), tiny_tokenizer(), name="d")
    for policy in ("ar", "spec:4", "joint:8"):
        eng = Engine(lm, ModelDraft(draft), RakvConfig(policy=policy))
        for p in PROMPTS:
            assert eng.generate(p, 20).output_ids == ref[tuple(p)], (policy, p)
    assert pair_fingerprint(lm, None).get("one_row") == "packed"
    monkeypatch.setenv("RAKV_ONE_ROW", "plain")
    lm2 = wrap(copy.deepcopy(plain), tiny_tokenizer(), name=f"tiny-{arch}")
    assert fastpath.one_row_kernel(lm2.model) == "plain" and "one_row" not in pair_fingerprint(lm2, None)


@needs_onednn
def test_one_row_kernel_measured_once_then_remembered(tmp_path, monkeypatch):
    monkeypatch.delenv("RAKV_ONE_ROW", raising=False)
    m = make_model("llama")
    fastpath.enable(m)
    assert fastpath.choose_one_row(m, "tiny", tmp_path)["how"] == "small model (default)"
    monkeypatch.setattr(fastpath, "ONE_ROW_MIN_PARAMS", 0)
    monkeypatch.setattr(fastpath, "ONE_ROW_SHARE_MIN", 1.01)     # as if another process took the CPU
    busy = fastpath.choose_one_row(m, "tiny", tmp_path)
    assert busy["kernel"] == "plain" and busy["how"].startswith("busy") and not (tmp_path / "kernels.json").exists()
    monkeypatch.setattr(fastpath, "ONE_ROW_SHARE_MIN", 0.0)
    first = fastpath.choose_one_row(m, "tiny", tmp_path)
    assert first["how"] == "measured" and first["kernel"] in ("plain", "packed") and first["plain_step_ms"] > 0
    assert fastpath.one_row_kernel(m) == first["kernel"]
    again = fastpath.choose_one_row(m, "tiny", tmp_path)
    assert again["how"] == "remembered" and again["kernel"] == first["kernel"]
    assert json.loads((tmp_path / "kernels.json").read_text())
