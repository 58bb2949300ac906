"""Hostile input, round three: each case below ended in a traceback, a hang or a planted file run
as native code before its fix. Tiny random models only; nothing touches the network."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rakv.decide import profile as CP
from rakv.cli import main
from rakv.common import CliError, read_prompts
from rakv.kernels import trust
from rakv.records import RecordingError, read_recording
from rakv.util.text_in import TextError, checked_text, decode_file, load_json, text_problem
from tests.tiny import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "resources" / "example.jsonl"
ORACLE = ROOT / "docs" / "oracle-example.jsonl"
DEEP = "[" * 100_000 + "]" * 100_000


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    """The one error line of a refused command (and no traceback)."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("rakv: error")]
    assert len(lines) == 1, err
    return lines[0]


GEN = ["generate", "--target", "/nonexistent/model", "--draft", "ngram", "--max-new-tokens", "2"]


# ----------------------------------------------------------------------------- text from outside
def test_the_text_rule():
    assert text_problem("plain, café, 日本語 🙂") is None
    assert "byte 0xff" in text_problem("ab\udcffcd") and "character 3" in text_problem("ab\udcffcd")
    assert "U+D800" in text_problem("x\ud800")
    with pytest.raises(TextError, match="--prompt: not valid text"):
        checked_text("\udc80", "--prompt")
    assert decode_file(b"\xef\xbb\xbfhi\n", "f") == "hi\n"
    with pytest.raises(TextError, match=r"f:2: .*0xfe"):
        decode_file(b"ok\nno \xfe\n", "f")


def test_invalid_utf8_in_a_prompt_argument(capsys):
    code, _, err = run(capsys, *GEN, "--prompt", "fine", "--prompt", "ab\udcffcd")   # argv's undecodable byte
    line = one_error(err)
    assert code == 2 and "--prompt 2" in line and "0xff" in line and "/nonexistent" not in err


def test_lone_surrogate_in_a_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": "a\\ud800b"}\n')
    code, _, err = run(capsys, *GEN, "--prompts-file", f)
    line = one_error(err)
    assert code == 2 and "p.jsonl:2" in line and "U+D800" in line


def test_invalid_bytes_in_a_text_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"one\ntwo \xc3\x28\n")
    code, _, err = run(capsys, *GEN, "--prompts-file", f)
    assert code == 2 and "p.txt:2" in one_error(err)


def test_deeply_nested_prompts_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": ' + DEEP + "}\n")
    code, _, err = run(capsys, *GEN, "--prompts-file", f)
    line = one_error(err)
    assert code == 2 and "p.jsonl:2" in line and "nested" in line
    with pytest.raises(CliError):
        read_prompts(str(f))


def test_the_tokenizer_door_refuses_too():
    from rakv.prompts import encode_prompt

    with pytest.raises(ValueError, match="not valid text"):
        encode_prompt(tiny_tokenizer(), "a\ud800")


def test_piped_chat_with_invalid_utf8_answers_the_turns_before(models, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"alpha beta\nbad \xff line\nnever\n")))
    code, out, err = run(capsys, "chat", "--target", models / "target", "--draft", "ngram", "--policy", "ar",
                         "--max-new-tokens", "3", "--json")
    line = one_error(err)
    assert code == 2 and "stdin line 2" in line and "0xff" in line
    assert len(out.splitlines()) == 1 and json.loads(out)["turn"] == 1


# ----------------------------------------------------------------------------- cost profiles
GOOD = {"T_pf": [[1, 1.0], [64, 8.0]], "t": [[16, 1.0], [256, 1.5]], "V": {"1": 1.3, "2": 1.6}}


@pytest.mark.parametrize("field,value", [
    ("accept_map", {"hits": ["1"] * 10, "n": [2] * 10}), ("accept_map", {"hits": "x"}), ("accept_map", [1]),
    ("alpha_by_setting", {"t0.7": {"alpha0": "high"}}), ("alpha_by_setting", {"t0.7": 3}),
    ("quality", {"spread": {"t": "wide"}}), ("quality", []), ("regime", {"floor_ms": "1"}), ("regime", 5),
])
def test_profile_sections_of_the_wrong_type_are_damage(tmp_path, field, value):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**GOOD, field: value}))
    with pytest.raises(CP.ProfileError, match=f"malformed: field '{field}'"):
        CP.load_profile(p)
    p.write_text(json.dumps(GOOD))
    assert CP.load_profile(p) is not None


def test_deeply_nested_profile_is_damage(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(DEEP)
    with pytest.raises(CP.ProfileError, match="nested"):
        CP.load_profile(p)
    p.write_text(json.dumps({**GOOD, "regime": {"x": json.loads("[" * 80 + "]" * 80)}}))
    with pytest.raises(CP.ProfileError, match="nested"):
        CP.load_profile(p)


def test_accept_map_of_strings_never_breaks_this_run_or_the_next(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    args = ["generate", "--target", models / "target", "--draft", models / "draft", "--prompt", "alpha beta",
            "--max-new-tokens", "4", "--k-set", "0,1,2"]
    assert run(capsys, *args)[0] == 0
    (path,) = (tmp_path / "profiles").glob("*.json")
    d = json.loads(path.read_text())
    d["accept_map"] = {"hits": ["3"] * 10, "n": ["4"] * 10}
    path.write_text(json.dumps(d))
    code, _, err = run(capsys, *args)
    assert code == 0 and err.count("is malformed") == 1 and "accept_map" in err and "Traceback" not in err
    assert CP.load_profile(path) is not None                    # measured again and saved
    code, _, err = run(capsys, *args)
    assert code == 0 and "malformed" not in err


# ----------------------------------------------------------------------------- recordings
def _oracle_variant(tmp_path, change) -> Path:
    lines = ORACLE.read_text().splitlines()
    i = next(n for n, x in enumerate(lines) if json.loads(x)["type"] == "oracle")
    d = json.loads(lines[i])
    change(d)
    lines[i] = json.dumps(d)
    f = tmp_path / "o.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f, i + 1


@pytest.mark.parametrize("what", ["empty action", "no median_ms", "an action that is a string"])
def test_replay_of_damaged_oracle_actions(tmp_path, capsys, what):
    def change(d):
        if what == "empty action":
            d["actions"][0] = {}
        elif what == "no median_ms":
            for a in d["actions"]:
                a.pop("median_ms")
        else:
            d["actions"][1] = "r=0 k=2"
    f, n = _oracle_variant(tmp_path, change)
    code, _, err = run(capsys, "replay", f, "--csv", tmp_path / "o.csv")
    line = one_error(err)
    assert code == 2 and f"o.jsonl:{n}" in line and "actions" in line


def test_explorer_refuses_a_damaged_oracle_record_with_a_dialog(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        f, n = _oracle_variant(tmp_path, lambda d: [a.pop("median_ms") for a in d["actions"]])
        assert not w.open_recording(str(f), play=False)
        assert f"o.jsonl:{n}" in w.errors[-1] and "median_ms" in w.errors[-1]
    finally:
        w.shutdown()


def test_deeply_nested_recording_line(tmp_path):
    lines = EXAMPLE.read_text().splitlines()
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(lines[:3] + [DEEP] + lines[3:]) + "\n")
    with pytest.raises(RecordingError, match="r.jsonl:4: .*nested"):
        read_recording(f)


def cut_mid_character(tmp_path) -> Path:
    """The example recording with one more record holding non-ASCII text, cut inside a character
    (as a kill -9 mid-write leaves it)."""
    data = EXAMPLE.read_bytes()
    extra = json.dumps({"type": "request_start", "request_id": 99, "prompt": "naïve café 日本語"},
                       ensure_ascii=False).encode()
    cut = extra.index("日".encode()) + 1
    f = tmp_path / "cut-char.jsonl"
    f.write_bytes(data + extra[:cut])
    return f


def test_a_recording_cut_inside_a_character_keeps_every_complete_line(tmp_path, capsys):
    f = cut_mid_character(tmp_path)
    recs = read_recording(f)
    assert len(recs) == 225 and "cut-char.jsonl:226" in recs.warnings[0]
    code, _, err = run(capsys, "replay", f, "--csv", tmp_path / "c.csv")
    assert code == 0 and "cut off" in err


def test_explorer_replays_a_cut_recording_and_says_where(tmp_path):
    """The scripted explorer (--replay --exit-after-run) on recordings cut mid-character and
    mid-record finishes, replays what is complete and says which line was cut."""
    data = EXAMPLE.read_bytes()
    mid = tmp_path / "cut-mid.jsonl"
    mid.write_bytes(data[: data.index(b"\n", len(data) // 2) + 40])
    for f in (cut_mid_character(tmp_path), mid):
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "RAKV_SETTINGS": str(tmp_path / "s.ini"),
               "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "app", "--replay", str(f), "--exit-after-run"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and f"{f.name}:" in r.stderr and "cut off" in r.stderr


def test_play_clock_skips_damaged_times():
    from app.replay import Replayer
    from rakv.records import RunHeader, RequestStart

    recs = [RunHeader(t=0.0), RequestStart(t=float("nan")), RequestStart(t=float("inf")), RequestStart(t=0.1)]
    rp = Replayer(recs)
    assert all(x == x and x != float("inf") for x in rp.play_t)


# ----------------------------------------------------------------------------- a full cache dir
def test_a_full_disk_during_conversion_keeps_nothing_and_the_next_run_says_why(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gguf")
    import rakv.load.gguf as LG
    from tests.unit.test_gguf import _tiny_gguf

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    f, _ = _tiny_gguf(tmp_path / "src")
    real = LG._save_converted

    def full_disk(tmp, *a, **k):
        (tmp / "model.safetensors").write_bytes(b"\0" * 1000)          # half-written, then the disk is full
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(LG, "_save_converted", full_disk)
    args = ["generate", "--target", f, "--draft", "ngram", "--policy", "ar", "--prompt", "alpha", "--max-new-tokens", "2"]
    code, _, err = run(capsys, *args)
    line = one_error(err)
    assert code == 2 and "No space left on device" in line and "converts it again" in line
    models_dir = tmp_path / "cache" / "models"
    assert not [p for p in models_dir.iterdir() if p.is_dir()]            # no folder, complete or not
    monkeypatch.setattr(LG, "_save_converted", real)
    code, _, err = run(capsys, *args)
    assert code == 0 and "did not finish (Error while serializing" in err and "converting it again" in err
    code, _, err = run(capsys, *args)
    assert code == 0 and "converting" not in err


def test_a_killed_conversion_leaves_a_part_folder_that_the_next_run_names(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gguf")
    import rakv.load.slim as LS
    from tests.unit.test_gguf import _tiny_gguf

    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    f, _ = _tiny_gguf(tmp_path / "src")
    out = LS.cache_dir() / "models" / f"gguf-{LS.file_hash(f)}"
    part = out.parent / f".{out.name}.abc123.part"
    part.mkdir(parents=True)
    (part / "model.safetensors").write_bytes(b"\0" * 10)
    code, _, err = run(capsys, "generate", "--target", f, "--draft", "ngram", "--policy", "ar", "--prompt", "alpha",
                       "--max-new-tokens", "2")
    assert code == 0 and "was cut off" in err and not part.exists() and (out / LS.CONVERTED_MARK).is_file()


# ----------------------------------------------------------------------------- kernels.json
@pytest.mark.parametrize("text", ['["plain", "packed"]', '"packed"', "42", DEEP, "\xff{", '{"a": 1'])
def test_kernels_json_of_the_wrong_shape_is_ignored_with_one_line(tmp_path, capsys, text):
    from rakv.kernels.fastpath import remembered_kernels

    p = tmp_path / "kernels.json"
    p.write_text(text, encoding="latin-1")
    assert remembered_kernels(p) == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernels.json is damaged" in err and "measured again" in err
    p.write_text('{"id": {"kernel": "packed"}}')
    assert remembered_kernels(p) == {"id": {"kernel": "packed"}}


def test_kernels_json_list_through_the_kernel_choice(tmp_path, capsys, monkeypatch):
    """The real path: a model big enough to measure its one-row kernel, kernels.json a list: the
    choice is measured and the file rewritten as an object."""
    import torch

    from rakv.kernels import fastpath
    from rakv.util.meter import Timing

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    monkeypatch.setattr(fastpath, "ONE_ROW_MIN_PARAMS", 0)
    monkeypatch.setattr(fastpath, "_decode_steps", lambda m, forward=None: Timing([1.0, 1.0], [1.0, 1.0]))
    monkeypatch.setattr(fastpath, "is_enabled", lambda m: True)
    monkeypatch.setattr(fastpath, "set_one_row", lambda m, k: None)
    monkeypatch.setattr(fastpath, "linear_layers", lambda m: [model[0]])
    for bad in ('["a list"]', '"a string"'):
        (tmp_path / "kernels.json").write_text(bad)
        got = fastpath.choose_one_row(model, "k", tmp_path, rounds=2)
        assert got["how"] == "measured" and "kernels.json is damaged" in capsys.readouterr().err
        assert isinstance(json.loads((tmp_path / "kernels.json").read_text()), dict)
        assert fastpath.choose_one_row(model, "k", tmp_path, rounds=2)["how"] == "remembered"


# ----------------------------------------------------------------------------- trusted native code
def test_trust_rules(tmp_path):
    d = trust.private_dir(tmp_path / "k")
    assert (os.stat(d).st_mode & 0o777) == 0o700
    f = d / "lib.so"
    f.write_bytes(b"built here")
    assert "no record" in trust.untrusted(f)
    trust.record(f)
    assert trust.untrusted(f) is None
    f.write_bytes(b"built elsewhere")                         # replaced after the record
    assert "hash differs" in trust.untrusted(f)
    trust.record(f)
    os.chmod(f, 0o666)
    assert "writable by group or others" in trust.untrusted(f)
    os.chmod(f, 0o600)
    os.chmod(d, 0o777)
    assert "writable by group or others" in trust.untrusted(f)
    trust.private_dir(d)                      # this user's: tightened, and what others could have forged dropped
    assert (os.stat(d).st_mode & 0o777) == 0o700 and "no record" in trust.untrusted(f)
    trust.record(f)
    assert trust.untrusted(f) is None
    link = d / "link.so"
    link.symlink_to(f)
    assert "not a regular file" in trust.untrusted(link)
    assert "No such file" in trust.untrusted(d / "none.so")


PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("RAKV_PLANT_MARK"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int rakv_linear(void) { return 0; }
"""


def test_a_planted_kernel_is_never_loaded(tmp_path, monkeypatch, capsys):
    """A shared library planted under the kernel's own name in the cache dir's kernels/ (even with a
    hash record forged beside it and the folder left open) is never dlopened: the kernel is built
    again and the planted code never runs."""
    from rakv.kernels import blockq

    cc = blockq._compiler()
    if cc is None or sys.platform.startswith("win"):
        pytest.skip("no C compiler")
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    mark = tmp_path / "planted-ran"
    monkeypatch.setenv("RAKV_PLANT_MARK", str(mark))
    kdir = tmp_path / "cache" / "kernels"
    kdir.mkdir(parents=True)
    os.chmod(kdir, 0o777)                                  # as a careless or hostile setup leaves it
    out = kdir / f"blockq-{blockq._ident(cc)}.so"
    src = tmp_path / "plant.c"
    src.write_text("#include <stdlib.h>\n" + PLANT)
    assert subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)]).returncode == 0
    trust.record(out)                                      # a record forged beside it, while the folder was open
    for state in ("handle", "reason", "tried", "ident"):
        monkeypatch.setattr(blockq._Lib, state, getattr(blockq._Lib, state))
    blockq._Lib.handle, blockq._Lib.reason, blockq._Lib.tried, blockq._Lib.ident = None, "", False, ""
    lib = blockq.library()
    err = capsys.readouterr().err
    assert not mark.exists(), "the planted library ran"
    assert lib is not None and hasattr(lib, "rakv_decode_layers"), blockq.reason()
    assert f"not loading {out}" in err and "no record" in err and (os.stat(kdir).st_mode & 0o777) == 0o700
    assert trust.untrusted(out) is None
    # a second plant after the build, with its hash forged into the record: the folder is private
    # now, so only this user could; still the next process checks the file against the record
    shutil.copy(out, tmp_path / "good.so")
    assert subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)]).returncode == 0
    assert "hash differs" in trust.untrusted(out)


def test_a_planted_tokenizer_pickle_is_never_read(tmp_path, capsys):
    import rakv.load.tokenizer as LT

    mark = tmp_path / "pickle-ran"
    folder = trust.private_dir(tmp_path / "converted")
    tiny_tokenizer().save_pretrained(folder)

    class Plant:
        def __reduce__(self):
            return (open, (str(mark), "w"))

    import pickle

    with open(folder / LT.TOKENIZER_CACHE, "wb") as f:
        pickle.dump(Plant(), f)
    tok = LT.load_tokenizer(folder)
    assert not mark.exists() and tok("alpha")["input_ids"]
    assert "not reading the kept tokenizer" in capsys.readouterr().err
    assert trust.untrusted(folder / LT.TOKENIZER_CACHE) is None       # rebuilt, pickled and recorded
    reading = LT._TokenizerRead(folder)
    assert reading.result() is not None                              # ours is read again


# ----------------------------------------------------------------------------- settings
def test_settings_of_the_wrong_type_fall_back(tmp_path, capsys):
    from app.settings import Settings

    ini = tmp_path / "s.ini"
    ini.write_text("[window]\ngeometry=not a layout\nstate=42\n[controls]\nsampling=" + "[" * 3000 + "\n"
                   "budget_mib=lots\n[run]\nmax_new_tokens=1e999\n")
    s = Settings(ini)
    assert s.geometry() == (None, None)
    assert s.get("controls/sampling") == "{}" and s.get("controls/budget_mib") == 512
    assert s.get("run/max_new_tokens") == Settings.DEFAULTS["run/max_new_tokens"]
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("warning") >= 4


def test_load_json_depth():
    assert load_json("[[[]]]") == [[[]]]
    with pytest.raises(ValueError, match="nested"):
        load_json(DEEP)
    with pytest.raises(ValueError, match="nested"):
        load_json("[" * 70 + "]" * 70)


def test_explorer_prompt_flags_follow_the_text_rule(capsys):
    from app.main import main as explorer

    assert explorer(["--prompt", "fine", "--prompt", "a\udcff", "--autorun"]) == 2
    assert explorer(["--measure-prompt", "\ud800"]) == 2
    err = capsys.readouterr().err
    assert err.count("rakv-explorer: error: --prompt: not valid text") == 1
    assert err.count("rakv-explorer: error: --measure-prompt: not valid text") == 1 and "Traceback" not in err
