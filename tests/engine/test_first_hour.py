"""A user's first hour (issue 44): one calibration, quick and shared; the int8 draft cached; --json
counts that agree; a notice for a model without a chat template; defaults. Tiny models, no timing
asserts."""

from __future__ import annotations

import copy

import pytest

from rakv.decide import calibration as C, profile as CP
from rakv.util import meter as M
from tests.tiny import make_pair


@pytest.mark.fast
def test_profile_key_names_numerics_and_threads(drafted, monkeypatch):
    target, draft = drafted
    fp = CP.pair_fingerprint(target, draft)
    other = copy.copy(target)
    other.numerics = "q8" if fp["numerics"] == "fp32" else "fp32"
    fp2 = CP.pair_fingerprint(other, draft)
    assert fp["numerics"] != fp2["numerics"] and CP.fingerprint_id(fp) != CP.fingerprint_id(fp2)
    import torch

    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert CP.pair_fingerprint(target, draft)["threads"] == n + 1
    finally:
        torch.set_num_threads(n)


def test_calibration_says_its_estimate_and_times_its_phases(drafted, tmp_path, capsys):
    target, draft = drafted
    lines = []
    prof, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2, log=lines.append)
    assert fresh and any(m.startswith("calibrating: about ") and m.split()[2].isdigit() for m in lines)
    q = prof.quality
    assert q["estimate_s"] > 0 and {"warm-up", "target curves", "verify ratios", "acceptance"} <= set(q["phases_s"])
    # what the cost model needs is all there: t and T_pf by length, V(k) for every k, d, medians
    assert len(prof.t) >= 2 and len(prof.T_pf) >= 2 and prof.d and {"1", "2"} <= set(prof.V)
    # loaded again (same machine, pair, numerics, threads): no calibration
    assert C.load_or_calibrate(target, draft, tmp_path, k_max=2, log=lines.append)[1] is False


def test_estimate_counts_the_grid():
    from rakv.decide.calibration import GRID, estimate_s

    g = dict(GRID["full"], keys=list(range(9)) + [12, 16])
    q = dict(GRID["quick"], keys=list(range(9)) + [12, 16])
    # the demo pair's quiet figures (2-core VM): step ~14 ms, prefill ~1 ms a token
    full = estimate_s(g, 14.0, 1.0)
    assert estimate_s(q, 14.0, 1.0) < full < 20
    assert estimate_s(g, 14.0, 1.0, 7.0, True) > full


def test_contended_profile_is_used_at_once_without_a_probe(drafted, tmp_path, monkeypatch):
    target, draft = drafted
    prof, _ = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    prof.quality = dict(prof.quality, contended=True, reasons=["test"])
    CP.save_profile(prof, CP.profile_path(tmp_path, prof.fingerprint))
    monkeypatch.setenv("RAKV_CONTENTION_CHECK", "1")
    probes = []
    monkeypatch.setattr("rakv.decide.calibration.quiet_probe", lambda t: probes.append(1) or M.Timing([1], [1]))
    lines = []
    again, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2, log=lines.append)
    assert not fresh and again.contended and not probes
    assert len(lines) == 1 and "busy machine" in lines[0]


def test_explorer_uses_the_cli_thread_count_by_default():
    import inspect

    import app.main as main

    src = inspect.getsource(main)
    assert "cpu_count() or 2) - 1" not in src          # no explorer-only thread count
    assert "if args.threads:" in src


# ----------------------------------------------------------------------------- the int8 draft, cached
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_int8_draft_is_cached_and_loads_identical(arch, tmp_path, monkeypatch, capsys):
    import torch

    from rakv import decoding as dec
    import rakv.drafts.int8 as DI

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    target, _ = make_pair(arch, "identical")
    path = DI.int8_cache_path(target)
    assert path is not None and path.parent == tmp_path / "models" / "int8" and not path.exists()
    q1 = DI.int8_copy(target)
    assert path.exists() and not list(path.parent.glob(".*.tmp"))          # written atomically

    def no_quantizing(_t):
        raise AssertionError("quantized again although the cache holds it")

    real = DI._quantize
    monkeypatch.setattr(DI, "_quantize", no_quantizing)
    q2 = DI.int8_copy(target)
    assert DI._FROM_CACHE.get(q2.model, "") == path.name
    lazy = DI.int8_copy(target, lazy=True)
    assert lazy.model is not None and "int8 draft loaded from the cache" in capsys.readouterr().err
    ids = list(range(30, 50))
    l1 = dec.prefill(q1.model, ids, dec.DynamicCache())
    l2 = dec.prefill(q2.model, ids, dec.DynamicCache())
    assert torch.equal(l1, l2)
    # a damaged cache file is made again, not a failed run
    monkeypatch.setattr(DI, "_quantize", real)
    path.write_bytes(b"not a state dict")
    q3 = DI.int8_copy(target)
    assert "unusable" in capsys.readouterr().err
    assert torch.equal(dec.prefill(q3.model, ids, dec.DynamicCache()), l1)


# ----------------------------------------------------------------------------- --json counts agree
def _session_for_counts():
    from types import SimpleNamespace

    from rakv.cli import Run

    s = object.__new__(Run)
    s.args = SimpleNamespace(json=True)
    s.on_record, s.recorder, s.stream, s.stream_text = None, None, None, False
    s.last_decision, s.starts, s.gated, s.copies = {}, {}, {}, {}
    s.policy = SimpleNamespace(name="adaptive:gate")
    s.engine = SimpleNamespace(target=SimpleNamespace(numerics="fp32"))
    return s


def test_json_counts_agree_with_the_gate_entries():
    from rakv.records import RequestEnd, Round

    s = _session_for_counts()
    rounds = [Round(request_id=0, index=1, kind="ar", k=0, drafted=5, accepted=3, draft_stop="source",
                    draft_source="lookup"),                                   # copies in a k = 0 round
              Round(request_id=0, index=2, kind="spec", k=4, drafted=4, accepted=2, draft_stop="gate"),
              Round(request_id=0, index=3, kind="ar", k=0, drafted=6, accepted=2, draft_stop="k_max",
                    draft_source="lookup")]
    for r in rounds:
        s.callback(r)
    end = RequestEnd(request_id=0, drafted=4, accepted=2, action={"reuse": 1, "k": 0})
    o = s.request_json(end)
    assert (o["drafted"], o["accepted"], o["copied"], o["copies_accepted"]) == (4, 2, 11, 5)
    assert o["drafted_total"] == sum(g["drafted"] for g in o["gate"]) == 15
    assert o["accepted_total"] == sum(g["accepted"] for g in o["gate"]) == 7
    # the next request starts from zero
    o2 = s.request_json(RequestEnd(request_id=1, action={"reuse": 0, "k": 0}))
    assert (o2["copied"], o2["drafted_total"], o2["accepted_total"]) == (0, 0, 0) and "gate" not in o2


# ----------------------------------------------------------------------------- no chat template
def test_no_chat_template_gives_one_notice(tmp_path, capsys):
    from rakv.cli import main
    from rakv.prompts import template_notice
    from tests.tiny import save_tiny, tiny_tokenizer

    assert "no chat template" in template_notice(tiny_tokenizer(), True, "m")
    assert template_notice(tiny_tokenizer(), False) == "" and template_notice(tiny_tokenizer(chat=True)) == ""
    save_tiny(tmp_path / "base", "llama")
    save_tiny(tmp_path / "chat", "llama", chat=True)
    for name, want in (("base", 1), ("chat", 0)):
        assert main(["generate", "--target", str(tmp_path / name), "--draft", "ngram", "--policy", "ar",
                     "--max-new-tokens", "3", "--prompt", "hello there", "--json"]) == 0
        err = capsys.readouterr().err
        assert err.count("has no chat template") == want, err
    assert main(["generate", "--target", str(tmp_path / "base"), "--draft", "none", "--policy", "ar", "--raw",
                 "--max-new-tokens", "3", "--prompt", "hello there"]) == 0
    assert "no chat template" not in capsys.readouterr().err          # --raw asked for raw text


def test_explorer_status_says_no_chat_template(qtbot, tmp_path):
    from app.window import MainWindow
    from tests.tiny import save_tiny

    save_tiny(tmp_path / "base", "llama")
    win = MainWindow()
    qtbot.addWidget(win)
    seen = []
    win.worker.loaded.connect(lambda info: seen.append(info))
    win.worker.load_models(str(tmp_path / "base"), "ngram", 2)
    qtbot.waitUntil(lambda: bool(seen), timeout=60000)
    assert "no chat template" in seen[0]["notice"] and "tick raw prompt" in seen[0]["notice"]
    qtbot.waitUntil(lambda: "no chat template" in win.msg.text(), timeout=10000)


# ----------------------------------------------------------------------------- defaults
def test_chat_default_is_256_tokens_and_generate_keeps_64():
    from rakv.cli import build_parser

    p = build_parser()
    assert p.parse_args(["chat"]).max_new_tokens == 256
    assert p.parse_args(["generate", "--prompt", "x"]).max_new_tokens == 64
    from app.settings import Settings

    assert Settings.DEFAULTS["run/max_new_tokens"] == 256


def test_bench_quick_runs_a_small_plan(capsys):
    from rakv.bench import QUICK_POLICIES, build_parser

    assert "a few minutes" in build_parser().format_help()
    from rakv.bench.runner import default_arm_names

    class D:
        name = "int8"
    names = [n for n in default_arm_names([0, 2, 4], True, D()) if n in QUICK_POLICIES]
    assert "ar" in names and "adaptive:request" in names and len(names) <= len(QUICK_POLICIES)
