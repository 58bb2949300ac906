"""The CLI contract and its errors (tiny local models, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rakv.cli import main
from rakv.records import CSV_COLUMNS, read_recording
from tests.tiny import oracle, tiny_tokenizer

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_contract(saved_pair, capsys, tmp_path):
    d, t = saved_pair
    rec = tmp_path / "run.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog."}) + "\n"
                       + json.dumps({"prompt": "The quick brown fox jumps over the lazy dog."}) + "\n"
                       + json.dumps({"prompt": "def add(a, b):\n    return a + b"}) + "\n")
    code, out, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", str(d / "draft"),
                         "--prompts-file", str(prompts), "--max-new-tokens", "12", "--json",
                         "--record", str(rec))
    assert code == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 3
    need = {"request_id", "prompt_tokens", "output_ids", "text", "hit_tokens", "exact_repeat", "action",
            "candidates", "latency_ms", "ttft_ms", "tokens_per_s", "drafted", "accepted", "alpha_ewma"}
    for o in lines:
        assert need <= set(o)
        assert {(c["reuse"], c["k"]) for c in o["candidates"]} == {(r, k) for r in (0, 1) for k in (0, 1, 2, 4, 6, 8)}
        assert all({"predicted_ms", "feasible"} <= set(c) for c in o["candidates"])
        assert set(o["action"]) == {"reuse", "k"}
        assert len(o["output_ids"]) <= 12
    tok = tiny_tokenizer()
    ids = tok("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    assert lines[0]["output_ids"] == oracle(t, ids, 12) == lines[1]["output_ids"]
    assert lines[1]["exact_repeat"] and lines[1]["hit_tokens"] == len(ids)
    # the repeat is priced as the copy the gate then makes: its passes beside the rounds taken
    assert lines[1]["copy"] and not lines[0]["copy"]
    assert abs(lines[1]["predicted_passes"] - lines[1]["rounds"]) <= 1 < lines[0]["rounds"]
    (tmp_path / "run.json").write_text(out)
    script = Path(__file__).resolve().parents[2] / "scripts" / "prediction_error.py"
    rep = subprocess.run([sys.executable, str(script), str(tmp_path / "run.json")],
                         capture_output=True, text=True)
    assert rep.returncode == 0 and "exact repeats: median error" in rep.stdout, rep.stderr
    recs = read_recording(rec)
    assert recs[0].type == "header" and recs[-1].type == "request_end"
    csv_out = tmp_path / "t.csv"
    assert run(capsys, "replay", str(rec), "--csv", str(csv_out))[0] == 0
    rows = csv_out.read_text().splitlines()
    assert rows[0].split(",") == [c for c, _ in CSV_COLUMNS] and len(rows) == 4


@pytest.mark.parametrize("policy", ["ar", "kv", "spec:3", "joint:4"])
def test_fixed_policies(saved_pair, capsys, policy):
    d, t = saved_pair
    code, out, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", "ngram", "--policy", policy,
                         "--prompt", "alpha beta gamma delta alpha beta gamma", "--max-new-tokens", "10", "--json")
    assert code == 0, err
    o = json.loads(out)
    assert o["action"]["k"] == int(policy.split(":")[1]) if ":" in policy else o["action"]["k"] == 0
    tok = tiny_tokenizer()
    ids = tok("alpha beta gamma delta alpha beta gamma", add_special_tokens=False)["input_ids"]
    assert o["output_ids"] == oracle(t, ids, 10)


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "   "], "empty"),
    (["--prompt", "hi", "--policy", "spec:-1"], "k must be >= 0"),
    (["--prompt", "hi", "--k-set", "0,-2"], "k must be >= 0"),
    (["--prompt", "hi", "--policy", "fast"], "unknown policy"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "not found"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt", "hi", "--max-new-tokens", "100000"], "exceeds the model's context"),
])
def test_bad_input_one_line_nonzero(saved_pair, capsys, argv, words):
    d, _ = saved_pair
    code, out, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", "ngram", *argv)
    assert code != 0
    lines = [x for x in err.splitlines() if x.startswith("rakv: error")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err


def test_unreadable_prompts_file(saved_pair, capsys, tmp_path):
    d, _ = saved_pair
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    code, _, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", "ngram", "--prompts-file", str(bad))
    assert code == 2 and "not valid JSON" in err
    binf = tmp_path / "bin.txt"
    binf.write_bytes(b"\xff\xfe\x00\x81")
    code, _, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", "ngram", "--prompts-file", str(binf))
    assert code == 2 and "cannot read" in err


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nope"), "--prompt", "hi")
    assert code == 2 and "not found" in err


def test_mismatched_tokenizers_refused(saved_pair, capsys):
    d, _ = saved_pair
    code, _, err = run(capsys, "generate", "--target", str(d / "target"), "--draft", str(d / "other-tok"),
                       "--prompt", "hi")
    assert code == 2 and "tokenizer" in err


def test_corrupt_recording(capsys, tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"type": "header", "schema": 1}\n{"type": "round", "index": \n')
    code, _, err = run(capsys, "replay", str(f), "--csv", str(tmp_path / "o.csv"))
    assert code == 2 and "x.jsonl:2" in err


def test_console_script_exit_code(saved_pair, tmp_path):
    """The real process: one line on stderr, non-zero exit, no traceback."""
    d, _ = saved_pair
    p = subprocess.run([sys.executable, "-m", "rakv", "generate", "--target", str(d / "target"), "--draft", "ngram",
                        "--prompt", ""], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "empty" in p.stderr
