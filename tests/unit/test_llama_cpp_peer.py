"""llama.cpp's tools as a bench peer (rakv.bench.peers.llamacpp, rakv bench --peer-llama-cpp).

Parsing is tested on real output captured from llama.cpp (llama-cpp-python 0.3.36's vendored tree,
built by scripts/build_llama_cpp.sh on a 2-core Xeon VM, 2026-12-06; trimmed of nothing but run
while a build took the other core, hence the slow figures) in tests/data/llama_cpp/. The flag
plumbing and the interleaving run the tiny bench with fake tools that replay those files. A real
run needs the built tools and a GGUF: skipped (with the reason) where they are absent.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from rakv.bench.peers import llamacpp as L

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

DATA = Path(__file__).resolve().parents[1] / "data" / "llama_cpp"


def read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- parsing real output
def test_parse_completion_real_output():
    t = L.parse_completion(read("completion.stderr"))
    assert (t.prompt_ms, t.prompt_tokens, t.eval_ms, t.eval_runs) == (4095.98, 58, 26149.31, 23)
    assert t.latency_ms == pytest.approx(4095.98 + 26149.31)
    assert t.decode_tps == pytest.approx(23 / 26.14931)
    assert L._strip_tail(read("completion.stdout")).startswith("```python\ndef gcd(a: int, b: int) -> int:")


def test_parse_speculative_real_output():
    t = L.parse_speculative(read("speculative.stderr"))
    want = json.loads(read("speculative.expected.json"))
    assert (t.encoded_tokens, t.decoded_tokens, t.n_draft, t.n_predict, t.n_drafted, t.n_accept) == tuple(
        want[k] for k in ("encoded", "decoded", "n_draft", "n_predict", "n_drafted", "n_accept"))
    assert t.decode_s == pytest.approx(want["decode_s"]) and t.encode_s == pytest.approx(want["encode_s"])
    assert t.decode_tps == pytest.approx(want["speed"]) and t.accept_pct == pytest.approx(want["accept_pct"])
    assert t.acceptance == pytest.approx(want["n_accept"] / want["n_drafted"])
    assert t.latency_ms == pytest.approx((want["encode_s"] + want["decode_s"]) * 1e3)


def test_parse_failures_are_one_line():
    with pytest.raises(L.LlamaCppFailed, match="no timing lines.*last words") as e:
        L.parse_completion("load: something\nlast words\n")
    assert "\n" not in str(e.value)
    with pytest.raises(L.LlamaCppFailed, match="no encoded/decoded lines"):
        L.parse_speculative(read("completion.stderr"))


def test_the_prompt_eval_line_is_not_taken_for_eval():
    log = "prompt eval time =  10.00 ms /  5 tokens\n       eval time =  20.00 ms /  3 runs\n"
    t = L.parse_completion(log)
    assert (t.prompt_ms, t.eval_ms, t.eval_runs) == (10.0, 20.0, 3)


def test_texts_agree_as_far_as_the_shorter_goes():
    from rakv.bench.runner import same_text

    assert same_text("def f():\n    return 1\n", "def f():\n    return 1") and same_text("abc", "abcd")
    assert not same_text("abx", "abcd") and not same_text("", "a") and same_text(" ", "")


def test_speculative_text_drops_the_echoed_prompt():
    assert L._spec_text("\n\nPROMPT and the answer\n\n", "PROMPT") == " and the answer"


# ----------------------------------------------------------------------------- flags
def test_flags_parse_and_default():
    from rakv.bench import build_parser

    a = build_parser().parse_args(["--peer-llama-cpp", "--llama-cpp-dir", "/x", "--llama-cpp-draft-lengths", "8,2"])
    assert a.peer_llama_cpp and a.llama_cpp_dir == "/x" and L.parse_lengths(a.llama_cpp_draft_lengths) == (2, 8)
    a = build_parser().parse_args([])
    assert not a.peer_llama_cpp and L.configure(a) is None and L.parse_lengths(None) == (2, 4, 8, 16)
    with pytest.raises(ValueError, match="1 to 64"):
        L.parse_lengths("0,4")
    with pytest.raises(ValueError, match="need --peer-llama-cpp"):
        L.configure(build_parser().parse_args(["--llama-cpp-dir", "/x"]))


def test_missing_tools_exit_2_naming_the_build_script(tmp_path, capsys):
    from rakv.cli import main

    g = tmp_path / "t.gguf"
    g.write_bytes(b"GGUF")
    rc = main(["bench", "--target", str(g), "--peer-llama-cpp", "--llama-cpp-dir", str(tmp_path / "none"),
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "scripts/build_llama_cpp.sh" in err[0] and "llama-speculative-simple" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_target_that_is_no_gguf_is_refused(tmp_path, capsys):
    from rakv.cli import main

    tools = fake_tools(tmp_path)
    rc = main(["bench", "--peer-llama-cpp", "--llama-cpp-dir", str(tools), "--out", str(tmp_path / "out")])
    assert rc == 2 and "needs a GGUF target" in capsys.readouterr().err


def test_sampling_is_refused(tmp_path, capsys):
    from rakv.cli import main

    rc = main(["bench", "--peer-llama-cpp", "--temperature", "0.7", "--out", str(tmp_path / "out")])
    assert rc == 2 and "greedy" in capsys.readouterr().err


def test_tools_are_found_by_name(tmp_path):
    tools = fake_tools(tmp_path)
    t = L.find_tools(tools)
    assert t.completion.name == "llama-completion" and t.speculative.name == "llama-speculative-simple"
    os.rename(tools / "llama-completion", tools / "llama-cli")      # an older tree's name
    assert L.find_tools(tools).completion.name == "llama-cli"


def test_commands_carry_the_settings(tmp_path):
    t = L.find_tools(fake_tools(tmp_path))
    c = L.completion_cmd(t, "T.gguf", "p.txt", 32, 2)
    for flag, v in (("-m", "T.gguf"), ("-f", "p.txt"), ("-n", "32"), ("--temp", "0"), ("-t", "2"), ("-c", "4096")):
        assert c[c.index(flag) + 1] == v
    assert "-no-cnv" in c and "--no-escape" in c
    s = L.speculative_cmd(t, "T.gguf", "D.gguf", "p.txt", 32, 2, 8)
    for flag, v in (("-m", "T.gguf"), ("-md", "D.gguf"), ("--spec-type", "draft-simple"), ("--spec-draft-n-max", "8"),
                    ("-n", "32"), ("--temp", "0"), ("-t", "2"), ("-td", "2")):
        assert s[s.index(flag) + 1] == v


# ----------------------------------------------------------------------------- the bench, with fake tools
def fake_tools(tmp_path: Path) -> Path:
    """llama-completion and llama-speculative-simple that replay the captured output and log each call
    (its arm and the prompt file's text) to calls.jsonl."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, base in (("llama-completion", "completion"), ("llama-speculative-simple", "speculative")):
        p = d / name
        p.write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv
prompt = open(a[a.index("-f") + 1], encoding="utf-8").read()
with open({str(d / "calls.jsonl")!r}, "a") as f:
    f.write(json.dumps({{"tool": {name!r}, "prompt": prompt, "argv": a[1:]}}) + "\\n")
out = open({str(DATA / (base + ".stdout"))!r}, encoding="utf-8").read()
if {name!r} == "llama-speculative-simple":
    out = out.replace("@PROMPT@", prompt)
sys.stdout.write(out)
sys.stderr.write(open({str(DATA / (base + ".stderr"))!r}, encoding="utf-8").read())
""")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return d


def test_the_bench_interleaves_llama_cpp_with_our_policies(tmp_path):
    from rakv.cli import main

    tools = fake_tools(tmp_path)
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    t.write_bytes(b"GGUF")
    d.write_bytes(b"GGUF")
    out = tmp_path / "out"
    rc = main(["bench", "--tiny", "--target", str(t), "--draft", str(d), "--workload", "code", "--n-prompts", "3",
               "--max-new-tokens", "6", "--policies", "ar,spec:2", "--no-peers", "--peer-llama-cpp",
               "--llama-cpp-dir", str(tools), "--llama-cpp-draft-lengths", "2", "--out", str(out), "--no-progress",
               "--threads", "1"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "executions.csv", encoding="utf-8")))
    assert {r["policy"] for r in rows} == {"ar", "spec:2", "llama.cpp:ar", "llama.cpp:spec:2"}
    lc = [r for r in rows if r["policy"].startswith("llama.cpp:")]
    assert all(r["match"] == "-1" and r["text_match"] in ("0", "1") and r["cpu_share"] == "" for r in lc)
    ar = next(r for r in lc if r["policy"] == "llama.cpp:ar")
    assert float(ar["latency_ms"]) == pytest.approx(4095.98 + 26149.31) and float(ar["ttft_ms"]) == 4095.98
    assert ar["output_tokens"] == "24" and ar["peer_prompt_tokens"] == "58"
    want = json.loads(read("speculative.expected.json"))
    sp = next(r for r in lc if r["policy"] == "llama.cpp:spec:2")
    assert int(sp["drafted"]) == want["n_drafted"] and int(sp["accepted"]) == want["n_accept"]
    assert sp["ttft_ms"] == "" and float(sp["decode_tps"]) == pytest.approx(want["speed"])
    # request by request: every call for request i comes before any for request i + 1, 2 tools each
    calls = [json.loads(x) for x in open(tools / "calls.jsonl", encoding="utf-8")]
    prompts_by_index = {}
    for r in rows:
        if r["policy"] == "ar":
            prompts_by_index[int(r["index"])] = None
    assert len(calls) == 2 * (len(prompts_by_index) + 1)          # + the warm-up request
    seq = [c["prompt"] for c in calls[2:]]
    assert all(seq[2 * i] == seq[2 * i + 1] for i in range(len(seq) // 2))
    assert [c["argv"][c["argv"].index("-n") + 1] for c in calls[2:]] == ["6"] * len(seq)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["llama_cpp"]["draft_lengths"] == [2] and meta["llama_cpp"]["target_gguf"] == str(t.resolve())
    summary = (out / "summary.md").read_text()
    assert "## llama.cpp on the same files" in summary and "/ our counterpart" in summary
    table = json.loads((out / "llama_cpp.json").read_text())
    spec = next(x for x in table if x["policy"] == "llama.cpp:spec:2")
    assert spec["vs_counterpart_policy"] == "spec:2" and spec["vs_ar"] is not None
    assert spec["acceptance"] == pytest.approx(want["n_accept"] / want["n_drafted"])


def test_a_draft_that_is_no_file_runs_llama_cpp_ar_alone(tmp_path):
    from rakv.cli import main

    tools = fake_tools(tmp_path)
    t = tmp_path / "t.gguf"
    t.write_bytes(b"GGUF")
    out = tmp_path / "out"
    rc = main(["bench", "--tiny", "--target", str(t), "--draft", "ngram", "--workload", "code", "--n-prompts", "2",
               "--max-new-tokens", "4", "--policies", "ar", "--no-peers", "--peer-llama-cpp",
               "--llama-cpp-dir", str(tools), "--out", str(out), "--no-progress"])
    assert rc == 0
    pols = {r["policy"] for r in csv.DictReader(open(out / "executions.csv", encoding="utf-8"))}
    assert pols == {"ar", "llama.cpp:ar"}


# ----------------------------------------------------------------------------- the real thing
def _real_tools() -> Path | None:
    d = os.environ.get("RAKV_LLAMA_CPP_DIR")
    cands = [Path(d)] if d else sorted((Path.home() / ".cache" / "rakv" / "llama.cpp").glob("*/build/bin"))
    for c in cands:
        try:
            return L.find_tools(c).folder
        except L.LlamaCppMissing:
            continue
    return None


def _real_gguf() -> Path | None:
    g = os.environ.get("RAKV_TEST_GGUF")
    cands = [Path(g)] if g else [Path.home() / ".cache" / "rakv" / "models" / "presets" /
                                 "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
    return next((c for c in cands if c.is_file()), None)


@pytest.mark.skipif(_real_tools() is None, reason="llama.cpp's tools are not built here "
                    "(bash scripts/build_llama_cpp.sh, or RAKV_LLAMA_CPP_DIR=DIR)")
@pytest.mark.skipif(_real_gguf() is None, reason="no GGUF to run them on (the qwen-coder-0.5b preset's file in "
                    "~/.cache/rakv/models/presets, or RAKV_TEST_GGUF=FILE)")
def test_a_real_llama_cpp_run():
    tools = L.find_tools(_real_tools())
    gguf = str(_real_gguf())
    prompt = "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n"
    r = L.run_completion(tools, gguf, prompt, 8, 2)
    assert 1 <= r.output_tokens <= 8 and r.prompt_tokens > 10 and r.latency_ms > 0 and r.text
    s = L.run_speculative(tools, gguf, gguf, prompt, 8, 2, 4)          # its own draft
    assert s.drafted and 0 <= s.accepted <= s.drafted and s.text.strip() and s.output_tokens >= 1
