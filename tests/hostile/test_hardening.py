"""Hardening (bad input, concurrency, damaged files) and calibration that notices contention.

Each test here failed before its fix. Tiny random models only; nothing touches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from rakv.decide import calibration as C, profile as CP
from rakv.cli import main
from rakv.drafts.model import ModelDraft
from rakv.load.hub import load_model
from rakv.load.loaded import ModelError
from rakv.records import read_recording
from tests.tiny import make_pair, save_tiny, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "resources" / "example.jsonl"


@pytest.fixture(scope="module")
def good_profile(drafted):
    target, draft = drafted
    return asdict(C.calibrate(target, draft, k_max=2, quick=True))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("rakv: error")]


# ------------------------------------------------------------------------------- 1. profile types
BAD_FIELDS = [
    ("T_pf", "fast"), ("V", {"1": "2.0", "2": "3.0"}), ("V", [1.0, 2.0]), ("scale", [1.0]),
    ("scale", "x"), ("V_ctx", "128"), ("t", [[16, "1.0"]]), ("V", {"1": float("nan")}),
    ("alpha0", "0.5"), ("samples", {"t": "3"}), ("fingerprint", []), ("D_pf", [[1, 2, 3]]),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}-{type(v).__name__}" for f, v in BAD_FIELDS])
def test_malformed_profile_is_reported_and_measured_again(drafted, tmp_path, capsys, field, value):
    target, draft = drafted
    prof, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    path = CP.profile_path(tmp_path, prof.fingerprint)
    d = json.loads(path.read_text())
    d[field] = value
    path.write_text(json.dumps(d))
    capsys.readouterr()
    with pytest.raises(CP.ProfileError, match=str(path.name)):
        CP.load_profile(path)
    prof2, fresh2 = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    err = capsys.readouterr().err
    assert fresh2 and err.count("is malformed") == 1 and str(path) in err
    assert CP.load_profile(path) is not None          # the measured one replaced it
    prof2.step(100), prof2.verify(2, 100)


def test_malformed_profile_never_breaks_generate(models, tmp_path, capsys, monkeypatch):
    """The CLI run succeeds and the bad profile is not written back by the run's final save."""
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    args = ["generate", "--target", models / "target", "--draft", models / "draft", "--prompt", "alpha beta",
            "--max-new-tokens", "4", "--k-set", "0,1,2"]
    assert run(capsys, *args)[0] == 0
    (path,) = (tmp_path / "profiles").glob("*.json")
    d = json.loads(path.read_text())
    d["V"] = {k: str(v) for k, v in d["V"].items()}
    path.write_text(json.dumps(d))
    code, _, err = run(capsys, *args)
    assert code == 0 and "malformed" in err and "Traceback" not in err
    assert CP.load_profile(path) is not None
    assert run(capsys, *args)[0] == 0


def test_profile_rejects_unknown_and_missing_fields(good_profile, tmp_path):
    p = tmp_path / "p.json"
    for d in ({**good_profile, "bogus": 1}, {k: v for k, v in good_profile.items() if k != "T_pf"}, [], "x"):
        p.write_text(json.dumps(d))
        with pytest.raises(CP.ProfileError):
            CP.load_profile(p)
    p.write_text("{not json")
    with pytest.raises(CP.ProfileError, match="not valid JSON"):
        CP.load_profile(p)
    assert CP.load_profile(tmp_path / "none.json") is None
    p.write_text(json.dumps(good_profile))
    assert CP.load_profile(p) is not None


# ------------------------------------------------------------------------------- 2. read-only cache
def test_unwritable_cache_calibrates_and_runs(drafted, tmp_path, capsys):
    target, draft = drafted
    (tmp_path / "profiles").write_text("a file where the profiles folder should be")   # saving fails, even as root
    prof, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    err = capsys.readouterr().err
    assert fresh and prof.T_pf and "cannot save the cost profile" in err
    assert CP.save_learned(prof, tmp_path) is None        # warned once already: no second complaint


def test_unwritable_cache_generate_runs(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    (tmp_path / "profiles").write_text("")
    code, out, err = run(capsys, "generate", "--target", models / "target", "--draft", models / "draft",
                         "--prompt", "alpha beta", "--max-new-tokens", "4", "--k-set", "0,1,2", "--json")
    assert code == 0, err
    assert json.loads(out)["output_ids"]
    assert err.count("cannot save") + err.count("could not save") == 1


# ------------------------------------------------------------------------------- 3. overwriting inputs
def test_replay_refuses_csv_onto_its_recording(tmp_path, capsys):
    rec = tmp_path / "r.jsonl"
    rec.write_bytes(EXAMPLE.read_bytes())
    code, _, err = run(capsys, "replay", rec, "--csv", tmp_path / "." / "r.jsonl")
    assert code == 2 and len(error_lines(err)) == 1 and "same file" in err
    assert rec.read_bytes() == EXAMPLE.read_bytes()


def test_generate_refuses_record_onto_prompts_file(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("hello\n")
    code, _, err = run(capsys, "generate", "--target", tmp_path / "no-model", "--prompts-file", f, "--record", f)
    assert code == 2 and "same file" in err and "--record" in err     # before the (missing) model loads
    assert f.read_text() == "hello\n"


def test_bench_refuses_out_onto_its_workload(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    w = out / "executions.csv"
    w.write_text("prompt one\nprompt two\n")
    code, _, err = run(capsys, "bench", "--tiny", "--workload", w, "--out", out)
    assert code == 2 and "same file" in err
    assert w.read_text() == "prompt one\nprompt two\n"


def test_explorer_refuses_screenshot_onto_replay(tmp_path, capsys):
    from app import main as app_main

    rec = tmp_path / "r.jsonl"
    rec.write_bytes(EXAMPLE.read_bytes())
    assert app_main.main(["--replay", str(rec), "--screenshot", str(rec), "--exit-after-run"]) == 2
    assert rec.read_bytes() == EXAMPLE.read_bytes()


# ------------------------------------------------------------------------------- 4. weights not loaded
def write_vocab_only_gguf(path: Path) -> None:
    """A GGUF with a llama config and the tiny tokenizer but no tensors at all."""
    gguf = pytest.importorskip("gguf")
    js = json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(js["model"]["vocab"].items(), key=lambda x: x[1])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in js["model"]["merges"]])
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_without_weights_is_refused(tmp_path):
    f = tmp_path / "vocab-only.gguf"
    write_vocab_only_gguf(f)
    with pytest.raises(ModelError, match="lacks .* weight"):
        load_model(str(f))


def test_model_dir_with_missing_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    sd = load_file(st)
    del sd["model.layers.0.self_attn.q_proj.weight"]
    save_file(sd, st, metadata={"format": "pt"})
    with pytest.raises(ModelError, match="q_proj"):
        load_model(str(tmp_path / "m"))


@pytest.mark.parametrize("spec", ["models/nope", "nope.gguf", "./nope", "~/surely-not-here-rakv"])
def test_missing_local_path_says_so(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelError, match="path does not exist"):
        load_model(spec)


def test_corrupt_demo_model_names_the_folder_to_delete(tmp_path, monkeypatch):
    from rakv.load.demo import DEMO_DIRNAME

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    d = tmp_path / "models" / DEMO_DIRNAME
    d.mkdir(parents=True)
    (d / "config.json").write_text("{broken")
    (d / "model.safetensors").write_bytes(b"\0" * 100)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError) as e:
        load_model("demo")
    assert str(d) in str(e.value) and "delete" in str(e.value)


# ------------------------------------------------------------------------------- 5. races
def test_concurrent_profile_saves_never_collide(good_profile, tmp_path):
    prof = CP.CostProfile(**good_profile)
    path = tmp_path / "profiles" / "p.json"
    errors = []

    def saver():
        for _ in range(150):
            try:
                CP.save_profile(prof, path)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=saver) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors[:3]
    assert CP.load_profile(path) is not None
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]       # no temp files left behind


def test_demo_fetch_and_convert_run_once_for_two_first_uses(tmp_path, monkeypatch):
    """Two first uses of `demo` at once: one converts, the other waits and finds the result."""
    import time

    import rakv.load.demo as Mo

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    calls = []

    def convert(base, out):
        calls.append(1)
        time.sleep(0.3)
        tmp = base / f".part-{len(calls)}"
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"x")
        (tmp / "tokenizer.json").write_text("{}")
        os.replace(tmp, out)

    monkeypatch.setattr(Mo, "_convert_demo", convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(Mo.ensure_demo())) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1] and (got[0] / "model.safetensors").exists()


def test_file_lock_serialises(tmp_path):
    from rakv.util.filelock import file_lock

    lock = tmp_path / "x.lock"
    order = []
    waited = []

    def hold():
        with file_lock(lock):
            order.append("a-in")
            threading.Event().wait(0.3)
            order.append("a-out")

    t = threading.Thread(target=hold)
    t.start()
    while not order:
        threading.Event().wait(0.01)
    code = ("import sys; from rakv.util.filelock import file_lock\n"
            "with file_lock(sys.argv[1], on_wait=lambda: print('waited')): print('in')\n")
    p = subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    t.join()
    waited.append(p.stdout.split())
    assert p.returncode == 0 and waited[0] == ["waited", "in"] and order == ["a-in", "a-out"]


# ------------------------------------------------------------------------------- 6, 7. numeric flags
GEN_BAD = [
    (["--budget-mib", "inf"], "--budget-mib"), (["--budget-mib", "nan"], "--budget-mib"),
    (["--budget-mib", "-1"], "--budget-mib"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--threads", "0"], "--threads"), (["--threads", "-2"], "--threads"), (["--threads", "100000"], "--threads"),
    (["--policy", "bogus"], "--policy"), (["--max-new-tokens", "x"], "--max-new-tokens"),
]


@pytest.mark.parametrize("argv,flag", GEN_BAD, ids=[" ".join(a) for a, _ in GEN_BAD])
def test_generate_flags_checked_before_models_load(tmp_path, capsys, argv, flag):
    code, _, err = run(capsys, "generate", "--target", tmp_path / "no-model", "--prompt", "hi", *argv)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and flag in lines[0] and "Traceback" not in err
    assert "no-model" not in err                     # the flag failed first, not the model


@pytest.mark.parametrize("argv,flag", [(["--k-max", "0"], "--k-max"), (["--threads", "0"], "--threads")])
def test_calibrate_flags(tmp_path, capsys, argv, flag):
    code, _, err = run(capsys, "calibrate", "--target", tmp_path / "no-model", *argv)
    assert code == 2 and flag in err and "no-model" not in err


@pytest.mark.parametrize("argv,flag", [(["--budget-mib", "inf"], "--budget-mib"), (["--repeats", "0"], "--repeats"),
                                       (["--threads", "0"], "--threads"), (["--n-prompts", "-1"], "--n-prompts"),
                                       (["--lookup-k", "0"], "--lookup-k")])
def test_bench_flags(capsys, argv, flag):
    code, _, err = run(capsys, "bench", "--tiny", "--dry-run", *argv)
    assert code == 2 and len(error_lines(err)) == 1 and flag in err


@pytest.mark.parametrize("argv,flag", [(["--threads", "-2"], "--threads"), (["--threads", "0"], "--threads"),
                                       (["--threads", "100000"], "--threads"), (["--policy", "bogus"], "--policy"),
                                       (["--max-new-tokens", "0"], "--max-new-tokens"), (["--size", "big"], "--size")])
def test_explorer_flags_checked_before_anything_is_saved(tmp_path, capsys, monkeypatch, argv, flag):
    from app import main as app_main

    ini = tmp_path / "s.ini"
    monkeypatch.setenv("RAKV_SETTINGS", str(ini))
    code = app_main.main(argv + ["--exit-after-run"])
    err = capsys.readouterr().err
    assert code == 2 and flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not ini.exists() or "bogus" not in ini.read_text()


# ------------------------------------------------------------------------------- 8. stored settings
def test_bad_stored_settings_fall_back_with_a_warning(tmp_path, capsys):
    from app.settings import Settings

    ini = tmp_path / "s.ini"
    s = Settings(ini)
    for k, v in (("run/policy", "bogus"), ("controls/granularity", "sideways"), ("run/max_new_tokens", -5),
                 ("controls/budget_mib", "inf"), ("controls/k_set", "0,-3")):
        s.set(k, v)
    s.sync()
    s = Settings(ini)
    assert s.get("run/policy") == "adaptive" and s.get("controls/granularity") == "round"
    assert s.get("run/max_new_tokens") == Settings.DEFAULTS["run/max_new_tokens"] == 256 and s.get("controls/k_set") == "0,1,2,4,6,8"
    assert s.get("controls/budget_mib") == 512
    err = capsys.readouterr().err
    assert "run/policy='bogus'" in err and "warning" in err


def test_bad_stored_policy_does_not_stick_in_the_window(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    s = Settings(tmp_path / "s.ini")
    s.set("run/policy", "bogus")
    s.sync()
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        assert w.run_panel.policy_text() == "adaptive" and w.run_panel.check_policy() is None
    finally:
        w.shutdown()


# ------------------------------------------------------------------------------- 10. cut recordings
def cut_recording(tmp_path) -> Path:
    text = EXAMPLE.read_text()
    f = tmp_path / "cut.jsonl"
    f.write_text(text[: len(text) - 1 - len(text.splitlines()[-1]) // 2])   # half of the last line, no newline
    return f


def test_replay_keeps_complete_records_of_a_cut_recording(tmp_path, capsys):
    f = cut_recording(tmp_path)
    recs = read_recording(f)
    assert len(recs) == 224 and recs.warnings and "cut.jsonl:225" in recs.warnings[0]
    out = tmp_path / "t.csv"
    code, _, err = run(capsys, "replay", f, "--csv", out)
    assert code == 0 and "warning" in err and "cut off" in err
    assert len(out.read_text().splitlines()) >= 2


def test_explorer_replays_a_cut_recording_with_a_warning(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        assert w.open_recording(str(cut_recording(tmp_path)), play=False)
        assert not w.errors and w.warnings and "cut off" in w.warnings[0]
        bad = tmp_path / "typed.jsonl"
        lines = EXAMPLE.read_text().splitlines()
        rnd = json.loads(lines[4])
        rnd["k"] = "2"
        lines[4] = json.dumps(rnd)
        bad.write_text("\n".join(lines) + "\n")
        assert not w.open_recording(str(bad), play=False)
        assert f"{bad}:5" in w.errors[-1] and "Unexpected" not in w.errors[-1]
    finally:
        w.shutdown()


def test_string_typed_fields_give_file_and_line(tmp_path, capsys):
    lines = EXAMPLE.read_text().splitlines()
    for i, field, value in ((2, "candidates", [{"reuse": "1", "k": 0, "predicted_ms": 1.0, "feasible": True}]),
                            (4, "emitted", ["523"]), (0, "schema", "1"), (4, "verify_ms", "fast")):
        d = json.loads(lines[i])
        d[field] = value
        f = tmp_path / "x.jsonl"
        f.write_text("\n".join(lines[:i] + [json.dumps(d)] + lines[i + 1:]) + "\n")
        code, _, err = run(capsys, "replay", f, "--csv", tmp_path / "o.csv")
        assert code == 2 and f"x.jsonl:{i + 1}" in err and field in err


# ------------------------------------------------------------------------------- minor
def test_bom_is_stripped_in_txt_and_jsonl(tmp_path):
    from rakv.common import read_prompts

    t = tmp_path / "p.txt"
    t.write_bytes("\ufeffhello\nworld\n".encode())
    j = tmp_path / "p.jsonl"
    j.write_bytes(("\ufeff" + json.dumps({"prompt": "hello"}) + "\n").encode())
    assert read_prompts(str(t)) == ["hello", "world"] and read_prompts(str(j)) == ["hello"]


@pytest.mark.parametrize("where", ["missing-dir/r.jsonl", "a-dir", "a-file/r.jsonl"])
def test_bad_record_path_reported_before_models_load(tmp_path, capsys, where):
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    code, _, err = run(capsys, "generate", "--target", tmp_path / "no-model", "--prompt", "hi",
                       "--record", tmp_path / where)
    assert code == 2 and "--record" in err and "no-model" not in err


# ------------------------------------------------------------------------------- 9 + 13.4 calibration
from rakv.util import meter as M  # noqa: E402


def test_pool_adjacent_violators_and_drops():
    assert M.pool_adjacent_violators([5, 3, 4]) == [4, 4, 4]
    assert M.pool_adjacent_violators([1, 2, 3]) == [1, 2, 3]
    assert M.pool_adjacent_violators([262, 100, 60, 400]) == [140.66666666666666] * 3 + [400]
    assert M.drops([262, 100, 60, 400]) == [0, 1] and M.drops([10, 9.8, 20]) == []


def test_falling_prefill_is_measured_again_then_made_monotone():
    m = M.Meter(check=True, pause=lambda s: None)
    calls = []

    def remeasure(i):                 # a busy machine: the short prefill stays slow
        calls.append(i)
        return [262.0, 100.0, 60.0, 400.0][i]

    pts = m.monotone("T_pf", [[8, 262.0], [32, 100.0], [128, 60.0], [384, 400.0]], remeasure)
    ys = [y for _, y in pts]
    assert calls and all(b >= a for a, b in zip(ys, ys[1:]))
    assert m.forced == ["T_pf"] and m.quality()["contended"]
    m2 = M.Meter(check=True, pause=lambda s: None)
    pts = m2.monotone("T_pf", [[8, 262.0], [32, 100.0], [128, 60.0]], lambda i: [2.0, 5.0, 12.0][i])
    assert [y for _, y in pts] == [2.0, 5.0, 12.0] and not m2.forced      # re-measuring fixed it


def test_noisy_term_is_measured_again_and_the_cleanest_kept():
    m = M.Meter(check=True, pause=lambda s: None)
    attempts = iter([M.Timing([10, 30, 50], [10, 30, 50]), M.Timing([10, 11, 10.5], [10, 11, 10.5])])
    t = m.measure("T_pf@8", lambda: next(attempts))
    assert t.value == 10.5 and m.retries == {"T_pf@8": 1}
    q = m.quality()
    assert q["spread"]["T_pf@8"] < 0.1 and q["retries"] == 1 and not q["contended"]
    m = M.Meter(check=True, pause=lambda s: None)
    n = []
    t = m.measure("t@16", lambda: n.append(1) or M.Timing([10, 30, 50], [10, 30, 50]))
    assert len(n) == 1 + M.MAX_RETRIES                       # bounded
    m = M.Meter(check=False)
    m.measure("x", lambda: M.Timing([10, 30, 50], [5, 15, 25]))
    assert m.retries == {} and not m.quality()["contended"]  # the check off: no retries, no flag


def test_retries_stop_at_the_deadline():
    """A machine busy for the whole calibration: past the deadline no term is measured again
    (the cap on how long a busy machine can make a calibration), and the profile says so."""
    m = M.Meter(check=True, pause=lambda s: None, deadline_s=0.0)
    n = []
    m.measure("t@16", lambda: n.append(1) or M.Timing([10, 30, 50], [10, 30, 50]))
    assert len(n) == 1 and m.retries == {}
    q = m.quality()
    assert q["past_deadline"] and q["contended"] and any("stopped after" in r for r in q["reasons"])


def test_busy_start_gives_a_quick_calibration_marked_contended(drafted, tmp_path, capsys, monkeypatch):
    target, draft = drafted
    monkeypatch.setenv("RAKV_CONTENTION_CHECK", "1")
    monkeypatch.setattr("rakv.decide.calibration.quiet_probe", lambda target: M.Timing([10, 10, 10], [5, 5, 5]))   # 50% share
    prof, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2)
    err = capsys.readouterr().err
    assert fresh and prof.contended and "a quick calibration" in err
    assert any("busy when calibration started" in r for r in prof.quality["reasons"])
    assert [x for x, _ in prof.t] == [16, 128]            # the quick grid, not the full one
    # a quiet machine whose probe only varies (full CPU share, high spread) is not called busy
    monkeypatch.setattr("rakv.decide.calibration.quiet_probe", lambda target: M.Timing([10, 20, 14], [10, 20, 14]))
    assert C.busy_now(target) is None


def test_busy_machine_flags_the_profile(drafted, tmp_path, capsys, monkeypatch):
    """A calibration where another process takes half the CPU: flagged, said so, saved marked;
    a later run on a quiet machine measures again, on a still-busy one reuses it."""
    target, draft = drafted
    monkeypatch.setenv("RAKV_CONTENTION_CHECK", "1")
    real = M.cpu_clock
    monkeypatch.setattr(M, "cpu_clock", lambda: real() * 0.5)      # we run half the time we measure
    monkeypatch.setattr("rakv.decide.calibration.cpu_clock", M.cpu_clock)
    prof, fresh = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    err = capsys.readouterr().err
    q = prof.quality
    assert fresh and q["contended"] and q["cpu_share"] < 0.8 and q["retries"] > 0 and "busy machine" in err
    assert CP.load_profile(CP.profile_path(tmp_path, prof.fingerprint)).contended
    # a later run uses the contended profile at once: no probe, no wait before the first token
    probes = []
    monkeypatch.setattr("rakv.decide.calibration.quiet_probe", lambda t: probes.append(1) or M.Timing([1, 1], [1, 1]))
    prof2, fresh2 = C.load_or_calibrate(target, draft, tmp_path, k_max=2, quick=True)
    assert fresh2 is False and prof2.contended and not probes and "using it now" in capsys.readouterr().err
    # after its requests: still busy keeps it; quiet measures it again (saved for the next run)
    monkeypatch.setattr("rakv.decide.calibration.is_quiet", lambda t: False)
    assert C.remeasure_if_quiet(prof2, target, draft, tmp_path, k_max=2) is None
    assert "still busy" in capsys.readouterr().err
    monkeypatch.setattr(M, "cpu_clock", real)
    monkeypatch.setattr("rakv.decide.calibration.cpu_clock", real)
    monkeypatch.setattr("rakv.decide.calibration.is_quiet", lambda t: True)
    prof3 = C.remeasure_if_quiet(prof2, target, draft, tmp_path, k_max=2)
    err = capsys.readouterr().err
    assert prof3 is not None and "quiet now" in err and "calibrating: about" in err
    assert CP.load_profile(CP.profile_path(tmp_path, prof.fingerprint)).calibrated_at == prof3.calibrated_at


def test_calibrated_curves_rise_and_quality_is_recorded(drafted):
    target, draft = drafted
    prof = C.calibrate(target, draft, k_max=2, quick=True, meter=M.Meter(check=True, pause=lambda s: None))
    for curve in (prof.T_pf, prof.D_pf, prof.t, prof.d):
        ys = [y for _, y in curve]
        assert all(b >= a for a, b in zip(ys, ys[1:])), curve
    t_ref = CP.interp(prof.t, prof.V_ctx)
    assert all(v >= t_ref - 1e-9 for v in prof.V.values())     # a verify is never priced below a step
    q = prof.quality
    assert {"spread", "cpu_share", "retries", "contended", "monotone_forced"} <= set(q)
    assert {"T_pf@8", "t@16", "V1", "V2"} <= set(q["spread"])


def test_falling_prefill_never_cached_as_is(drafted, monkeypatch):
    """The reported case: 8 tokens slower than 128 (a busy moment). Re-measured, then monotone."""
    from rakv import decoding as dec

    target, draft = drafted
    real = dec.prefill

    def slow_short(model, ids, cache, *a, **kw):
        if len(ids) == 8 and model is target.model:
            threading.Event().wait(0.02)
        return real(model, ids, cache, *a, **kw)

    monkeypatch.setattr(dec, "prefill", slow_short)
    prof = C.calibrate(target, draft, k_max=2, quick=True, meter=M.Meter(check=True, pause=lambda s: None))
    ys = [y for _, y in prof.T_pf]
    assert all(b >= a for a, b in zip(ys, ys[1:])) and "T_pf" in prof.quality["monotone_forced"]
    assert prof.quality["retried"]


def test_online_refinement_corrects_a_stale_profile_quickly(good_profile):
    prof = CP.CostProfile(**good_profile)
    true = 2.0 * prof.step(100)                # the profile says half of what the machine does now
    for _ in range(4):
        prof.observe("t", prof.step(100), true)
    assert prof.step(100) == pytest.approx(true, rel=0.15)
    for _ in range(30):
        prof.observe("t", prof.step(100), true)
    settled = prof.step(100)
    prof.observe("t", prof.step(100), 1e6)     # later, one outlier moves it at most a little
    assert prof.step(100) < settled * 1.1


def test_calibrate_check(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    args = ["calibrate", "--target", models / "target", "--draft", models / "draft", "--check"]
    code, out, _ = run(capsys, *args)
    assert code == 0 and "no saved cost profile" in out
    code, out, _ = run(capsys, "calibrate", "--target", models / "target", "--draft", models / "draft", "--quick")
    assert code == 0 and "quality: CPU share" in out
    code, out, _ = run(capsys, *args)
    assert code == 0 and "now/profile" in out and "prefill 32" in out and "draft step" in out
    code, out, _ = run(capsys, *args, "--json")
    o = json.loads(out)
    assert code == 0 and {r["term"].split("@")[0] for r in o["terms"]} >= {"step", "V(4)", "prefill 32"}
    assert all(r["ratio"] > 0 for r in o["terms"])


def test_old_profile_version_is_not_accepted(good_profile, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**good_profile, "fingerprint": {"version": CP.PROFILE_VERSION - 1}}))
    with pytest.raises(CP.ProfileError, match="version"):
        CP.load_profile(p)


# ------------------------------------------------------------------------------- 5. two processes at once
def test_two_processes_on_a_fresh_cache(models, tmp_path):
    """Both first uses of a pair succeed and leave one valid profile (calibrated once, under a lock)."""
    env = {**os.environ, "RAKV_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "rakv", "generate", "--target", str(models / "target"), "--draft",
           str(models / "draft"), "--prompt", "alpha beta gamma", "--max-new-tokens", "6", "--k-set", "0,1,2",
           "--policy", "adaptive", "--json", "--threads", "1"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out)["output_ids"]
    assert json.loads(outs[0][0])["output_ids"] == json.loads(outs[1][0])["output_ids"]
    profiles = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(profiles) == 1 and CP.load_profile(profiles[0]).T_pf
    assert sum("calibrating costs" in err for _, err in outs) == 1      # the second waited for the first
    assert not list((tmp_path / "cache" / "profiles").glob("*.tmp"))


# ------------------------------------------------------------------------------- property test
def test_random_streams_stay_exact_and_within_budget():
    """Random prompts (shared prefixes, repeats), budgets (0, tiny, large) and policies on one
    engine: after every request the output equals `ar` and the cache is within its budget."""
    import random

    from rakv.config import RakvConfig
    from rakv.engine import Engine
    from tests.tiny import reference

    rng = random.Random(14)
    target, draft = make_pair("gpt2", "mostly")
    prof = C.calibrate(target, ModelDraft(draft), k_max=4, quick=True)
    policies = ["ar", "kv", "spec:2", "joint:3", "adaptive"]
    refs: dict[tuple, list[int]] = {}
    stems = [[rng.randrange(2, 300) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    for pol in ("adaptive", "joint:2", "kv"):
        eng = Engine(target, ModelDraft(draft), RakvConfig(policy=pol, k_set=(0, 1, 2, 4)), profile=prof)
        for _ in range(8):
            if rng.random() < 0.35:
                eng.set_budget_mib(rng.choice([0.0, 0.001, 0.02, 0.05, 512.0]))
            if rng.random() < 0.35:
                eng.set_policy(rng.choice(policies))
            if rng.random() < 0.2:
                eng.set_k_set(rng.choice([(0,), (0, 2), (1, 4), (0, 1, 2, 4)]))
            stem = rng.choice(stems)
            p = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(2, 300) for _ in range(rng.choice([0, 0, 3]))]
            n = rng.choice([1, 5, 12])
            end = eng.generate(p, n)
            key = (tuple(p), n)
            if key not in refs:
                refs[key] = reference(target, p, n)
            assert (end.output_ids, end.stopped) == refs[key], (eng.policy, p, n)
            st = eng.store.stats
            assert st.bytes_used <= st.budget, (st.bytes_used, st.budget)
