"""The edit trace (rakv/workloads/edits.py) and its bench (``rakv bench --edits``, rakv/bench/edits.py):
the trace deterministic and shaped like an editor's requests, the sets disjoint, the client against
an /infill server on loopback (a stand-in speaking llama-server's answer, and a tiny ``rakv serve``),
the table's reuse and mismatch counts. No network, no timing asserted."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rakv.bench import edits as B
from rakv.cli import main
from rakv.workloads import edits as E


def _module(name: str, n_funcs: int = 12) -> str:
    """A made-up module: functions that repeat each other, as library code does."""
    out = [f'"""{name}: a module for the trace\'s tests."""', "", "import os", "import re", ""]
    for i in range(n_funcs):
        out += [f"def func_{i}(path, flags=0, strict=False):", f'    """Return the {i}th form of path."""',
                f"    value = os.path.join(path, 'part_{i}')", "    if strict and not re.match(r'\\w+', value):",
                "        raise ValueError(value)", f"    return value + str(flags * {i})", ""]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("stdlib")
    for name, _ in E.TUNING + E.HELD_OUT:
        (d / name).write_text(_module(name), encoding="utf-8")
    return d


@pytest.mark.fast
def test_the_trace_is_deterministic_and_shaped_like_an_editor(root):
    a = E.edit_trace("tuning", root)
    assert a == E.edit_trace("tuning", root)
    assert list(a) == [n for n, _ in E.TUNING]
    for name, reqs in a.items():
        lines = (root / name).read_text().splitlines()
        points = sorted({r.point for r in reqs})
        assert points == list(range(E.POINTS))
        for p in points:
            rs = [r for r in reqs if r.point == p]
            warm, keys = rs[0], rs[1:]
            # a cursor move: a warm-up first (nothing predicted), then the line typed at its pauses
            assert warm.kind == "warmup" and warm.n_predict == 0 and warm.prompt == ""
            assert 1 <= len(keys) <= E.KEYS and all(r.kind == "key" and r.n_predict == E.N_PREDICT for r in keys)
            assert [r.key for r in keys] == list(range(1, len(keys) + 1))
            line = lines[warm.line]
            assert all(r.prompt + r.truth == line and r.prompt.strip() and r.truth.strip() for r in keys)
            assert [len(r.prompt) for r in keys] == sorted({len(r.prompt) for r in keys})
            # the windows: lines above, lines below, the same for every request of the point
            assert all(r.input_prefix == warm.input_prefix and r.input_suffix == warm.input_suffix for r in keys)
            above = warm.input_prefix.splitlines()
            assert above == lines[max(0, warm.line - E.N_PREFIX):warm.line]
            assert warm.input_suffix.splitlines()[1:] == lines[warm.line + 1:warm.line + 1 + E.N_SUFFIX]
            assert all(r.n_indent == len(line) - len(line.lstrip()) for r in rs)
        # the ring buffer: chunks of other files of the set, never the file typed
        assert reqs[0].input_extra and all(f != name for f, _ in reqs[0].input_extra)
        body = reqs[1].body()
        assert body["cache_prompt"] is True and body["temperature"] == 0 and body["stream"] is False
        assert set(body) >= {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "n_indent"}
        assert "t_max_predict_ms" not in body and "t_max_prompt_ms" not in body   # no time limits
    assert E.edit_trace("tuning", root, points=1, keys=2, n_predict=8, files=1) == {
        "shlex.py": [r for r in E.file_trace("shlex.py", (root / "shlex.py").read_text().splitlines(),
                                               a["shlex.py"][0].input_extra, 1, 2, 8)]}


@pytest.mark.fast
def test_the_held_out_set_is_disjoint_and_every_file_has_a_reason(root):
    tune, held = {n for n, _ in E.TUNING}, {n for n, _ in E.HELD_OUT}
    assert tune and held and not tune & held
    assert all(len(why) > 20 for _, why in E.TUNING + E.HELD_OUT)
    h = E.edit_trace("heldout", root)
    assert set(h) == held and not {f for rs in h.values() for r in rs for f, _ in r.input_extra} & tune


def test_the_named_files_are_on_this_machine():
    d = E.stdlib_dir()
    if not (d / "shlex.py").is_file():
        pytest.skip(f"no standard library sources in {d}")
    for which in E.SETS:
        t = E.edit_trace(which, d)
        assert len(t) == 3 and all(sum(r.kind == "key" for r in rs) >= E.POINTS for rs in t.values())


def test_a_missing_file_or_set_is_one_clear_error(tmp_path, root):
    with pytest.raises(ValueError, match="standard library"):
        E.edit_trace("tuning", tmp_path)
    with pytest.raises(ValueError, match="choose from"):
        E.edit_trace("nope", root)


# ----------------------------------------------------------------------------- the client
class _LlamaLike(BaseHTTPRequestHandler):
    """Answers /infill as llama-server does: content, tokens_cached, timings (cache_n, prompt_n);
    the prompt's tokens are its characters, reuse the longest common prefix with the last prompt."""

    last: list[str] = [""]
    bodies: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if self.path != "/infill":
            self.send_response(404)
            self.end_headers()
            return
        extra = "".join(c["text"] for c in body["input_extra"])
        p = extra + body["input_prefix"] + body["prompt"] + body["input_suffix"]
        lcp = next((i for i, (x, y) in enumerate(zip(p, self.last[0])) if x != y), min(len(p), len(self.last[0])))
        self.last[0] = p
        out = json.dumps({"content": "x" * body["n_predict"],
                          "tokens_cached": len(p) + body["n_predict"], "tokens_evaluated": len(p),
                          "timings": {"cache_n": lcp, "prompt_n": len(p) - lcp, "predicted_n": body["n_predict"]}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *a):
        pass


@pytest.fixture
def llama_like():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _LlamaLike)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _LlamaLike.last[0] = ""
    _LlamaLike.bodies.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.fast
def test_the_client_replays_a_file_and_reads_the_reuse(llama_like, root, tmp_path):
    reqs = E.edit_trace("tuning", root, points=2, keys=3, files=1)["shlex.py"]
    rs = B.replay(llama_like, "llama", reqs)
    assert [r.id for r in rs] == [q.id for q in reqs] and all(r.ok for r in rs)
    assert [b["prompt"] for b in _LlamaLike.bodies] == [q.prompt for q in reqs]
    warm = [r for r in rs if r.kind == "warmup"]
    keys = [r for r in rs if r.kind == "key"]
    assert warm[0].reused_tokens == 0 and all(r.text == "x" * E.N_PREDICT for r in keys)
    # a keystroke after its warm-up: everything before the typed text is reused
    first = [r for r in keys if r.key == 1]
    assert all(0.5 < r.reused_share < 1 for r in first)
    assert all(r.prompt_tokens == r.reused_tokens + (r.prompt_tokens - r.reused_tokens) for r in keys)
    # the table: a reference arm's texts against another arm's
    other = [B.EditResult(**{**r.__dict__, "arm": B.REFERENCE}) for r in rs]
    other[1].text = "different"
    rows = {r["arm"]: r for r in B.summary_rows(rs + other)}
    assert rows["llama"]["mismatches"] == 1 and rows["llama"]["compared"] == len(keys)
    assert rows[B.REFERENCE]["mismatches"] == 0 and rows["llama"]["p50_vs_best_llama"] == 1.0
    assert rows["llama"]["first_key_reused_min"] == round(min(r.reused_share for r in first), 3)
    B.write_results(rs + other, tmp_path)
    saved = json.loads((tmp_path / "edits.json").read_text())
    assert len(saved["results"]) == 2 * len(rs) and saved["rows"][0]["arm"] == "llama"
    assert (tmp_path / "edits.csv").read_text().count("\n") == 2 * len(rs) + 1
    assert (tmp_path / "edits.md").read_text().startswith("| arm |")


def test_together_sends_each_request_to_every_arm_in_turn(llama_like, root, tmp_path):
    """--edits-together: every arm's server up at once, each request to each in a rotated order."""
    from rakv.bench.load import ServerSpec

    reqs = E.edit_trace("tuning", root, points=1, keys=2, files=1)
    calls = []

    class Up(ServerSpec):
        def start(self, log_dir):
            calls.append(self.name)
            return None, llama_like

    rs = B.run_edits([Up("a", []), Up("b", [])], reqs, tmp_path, progress=lambda m: None, together=True,
                     meta={"x": 1})
    # (the stand-in's reuse is per connection order: only the arms and their order are checked)
    assert calls == ["a", "b"] and [r.arm for r in rs][:4] == ["a", "b", "b", "a"]
    assert len(rs) == 2 * len(reqs["shlex.py"]) and all(r.ok for r in rs)
    saved = json.loads((tmp_path / "edits.json").read_text())["meta"]
    assert saved["interleave"] == "request" and saved["x"] == 1 and set(saved["servers"]) == {"a", "b"}


def test_a_server_error_is_kept_as_an_error_row(llama_like, root):
    reqs = E.edit_trace("tuning", root, points=1, keys=1, files=1)["shlex.py"]
    rs = B.replay(llama_like + "/nope", "llama", reqs)
    assert all(not r.ok and "404" in r.error for r in rs)
    assert B.summary_rows(rs)[0]["errors"] == len(rs)


@pytest.mark.parametrize("argv, msg", [
    (["--edits", "nope"], "unknown arm"),
    (["--edits", "rakv:spec:x"], "bad policy"),
    (["--edits", ""], "--edits is empty"),
    (["--edits", "rakv", "--edits-set", "other"], "invalid choice"),
])
def test_bad_edits_flags_are_one_line(tmp_path, capsys, argv, msg):
    rc = main(["bench", "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0]


# ----------------------------------------------------------------------------- a real rakv serve
@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    d = tmp_path_factory.mktemp("edits-fim-model") / "target"
    save_tiny(d, "llama", fim=True)
    return d


def test_rakv_serve_answers_the_trace_as_target_only_greedy(fim_dir, root, tmp_path):
    """A tiny FIM model behind rakv serve (a server per arm, as the bench starts them), each policy
    arm against ar: every completion the same text, the decisions read from the answers."""
    from dataclasses import replace

    from rakv.bench.load import rakv_server

    model_dir = fim_dir
    # the windows cut to fit the tiny model's 256 positions: two lines above, one below, no ring
    trace = {f: [replace(r, input_prefix="".join(r.input_prefix.splitlines(True)[-2:]),
                         input_suffix="".join(r.input_suffix.splitlines(True)[:2]), input_extra=((r.input_extra[0][0], "x = 1\n"),))
                 for r in rs] for f, rs in E.edit_trace("tuning", root, points=1, keys=2, n_predict=6, files=1).items()}
    specs = [rakv_server(str(model_dir), "ngram", 1, pol, name=name)
             for name, pol in ((B.REFERENCE, "ar"), ("rakv", "adaptive"), ("rakv:joint:2", "joint:2"))]
    res = B.run_edits(specs, trace, tmp_path, progress=lambda m: None)
    rows = {r["arm"]: r for r in B.summary_rows(res)}
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert set(rows) == {B.REFERENCE, "rakv", "rakv:joint:2"}
    assert all(r["mismatches"] == 0 and r["compared"] == 2 and r["reference"] == B.REFERENCE for r in rows.values())
    assert rows["rakv:joint:2"]["actions"] == "r1 k2 fixed: 2" and "argmin" in rows["rakv"]["actions"]
    # a keystroke after its warm-up reuses the prompt's cached part (ar reuses nothing)
    assert rows[B.REFERENCE]["reused_p50"] == 0
    assert all(rows[a]["first_key_reused_min"] > 0.5 for a in ("rakv", "rakv:joint:2")), rows
