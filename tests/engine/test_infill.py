"""Editor completion: ``POST /infill`` as llama.vim / llama.vscode send it, and ``suffix`` on
``/v1/completions``, through a real ``rakv serve`` on 127.0.0.1 over a tiny random llama whose
tokenizer has Qwen2.5-Coder's FIM tokens (and one without them: 400). Loopback only.

Exactness: the answer's ids are target-only greedy decoding of the same FIM prompt ids
(transformers' ``generate`` on the model as saved), up to the first FIM end token."""

from __future__ import annotations

import pytest

from rakv.cli import Run
from rakv.fim import LineRules, build, find_tokens, heal, split_blanks
from rakv.serve import Server
from rakv.util.textstream import TextStream
from tests.engine.test_serve import post, get, serve_args
from tests.tiny import oracle, save_tiny

N = 16
PREFIX = "def add(a, b):\n"
LINE = "    return "
SUFFIX = "\n\nfor i in range(10):\n    print(i)\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


def vim_body(**over) -> dict:
    """An /infill request with the fields llama.vim sends."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": LINE,
            "n_predict": N, "n_indent": 0, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 0,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                                "tokens_cached"]}
    body.update(over)
    return body


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fim-model") / "target"
    save_tiny(d, "llama", fim=True)
    return d


def _server(model_dir, tmp_path_factory, *extra):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAKV_CACHE", str(tmp_path_factory.getbasetemp() / "rakv-cache"))
        mp.setenv("RAKV_CONTENTION_CHECK", "0")
        args = serve_args(model_dir, "--max-new-tokens", str(N), *extra)
        return Server(args, lambda on_record: Run(args, on_record=on_record)).start()


@pytest.fixture(scope="module")
def fim_server(fim_dir, tmp_path_factory):
    s = _server(fim_dir, tmp_path_factory)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(fim_dir):
    """(tokenizer, untouched model) loaded from the saved folder: the exactness reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(fim_dir), AutoModelForCausalLM.from_pretrained(fim_dir).eval()


def expected(reference, prefix, suffix, line="", extra=(), n=N, rules=None, ms=lambda i: 0.0):
    """(ids kept, content) of target-only greedy decoding of the FIM prompt, cut at the first FIM
    end token (or EOS) and where ``rules`` end it; the whole decoding's ids too."""
    tok, model = reference
    fim = find_tokens(tok)
    line, blanks = split_blanks(line)
    ids = build(tok, prefix, suffix, line, [(c["filename"], c["text"]) for c in extra], n_predict=n,
                n_ctx=model.config.max_position_embeddings).ids
    ends = fim.ends | {tok.eos_token_id}
    out = oracle(model, ids, n, eos=ends)
    rules = rules or LineRules()
    text, kept = TextStream(tok), []
    for i, t in enumerate(out):
        if t in ends:
            break
        kept.append(t)
        if not rules.push(text.push([t]), ms(i)):
            break
    else:
        rules.push(text.finish(), 0.0)
    return kept, heal(rules.text, blanks), out, ids


# ----------------------------------------------------------------------------- /infill
@pytest.mark.fast
def test_infill_answers_llama_vim_in_llama_cpp_shape(fim_server, reference):
    status, r = post(fim_server.url, vim_body(), "/infill")
    assert status == 200, r
    assert set(r) == set(vim_body()["response_fields"])           # response_fields: flat paths
    kept, content, out, ids = expected(reference, PREFIX, SUFFIX, LINE, EXTRA)
    assert r["content"] == content
    assert r["tokens_cached"] == len(ids) and r["timings/prompt_n"] <= len(ids)
    assert r["timings/predicted_n"] in (len(kept), len(kept) + 1) and r["truncated"] is False

    status, full = post(fim_server.url, vim_body(response_fields=None), "/infill")   # the whole object
    assert status == 200
    assert {"content", "tokens_cached", "tokens_evaluated", "timings", "stop", "truncated", "stop_type",
            "tokens_predicted", "generation_settings", "rakv"} <= set(full)
    assert full["content"] == content and full["tokens_evaluated"] == len(ids) and full["stop"] is True
    assert {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"} <= set(full["timings"])
    got = full["rakv"]["output_ids"]
    assert got[: len(kept)] == kept and out[: len(got)] == got[: len(out)]      # target-only greedy
    assert full["rakv"]["exact_repeat"] and full["timings"]["prompt_n"] == 0     # the same prompt: all reused


def test_warm_up_fills_the_cache_and_a_keystroke_reuses_it(fim_server, reference):
    line = "    ret"
    status, w = post(fim_server.url, vim_body(prompt=line, n_predict=0, response_fields=None), "/infill")
    assert status == 200 and w["content"] == "" and w["tokens_predicted"] == 0 and w["stop_type"] == "none"
    _, _, _, ids = expected(reference, PREFIX, SUFFIX, line, EXTRA)
    assert w["tokens_cached"] == len(ids) and w["rakv"]["stopped"] == "warm"

    status, r = post(fim_server.url, vim_body(prompt=line, response_fields=None), "/infill")
    assert status == 200 and r["rakv"]["exact_repeat"] and r["timings"]["cache_n"] == len(ids)
    kept, content, _, _ = expected(reference, PREFIX, SUFFIX, line, EXTRA)
    assert r["content"] == content

    status, k = post(fim_server.url, vim_body(prompt=line + " ", response_fields=None), "/infill")   # a space:
    assert status == 200 and k["rakv"]["exact_repeat"]                                                 # no new prompt

    status, k = post(fim_server.url, vim_body(prompt=line + "u", response_fields=None), "/infill")   # a keystroke
    _, content, _, ids2 = expected(reference, PREFIX, SUFFIX, line + "u", EXTRA)
    stable = ids.index(find_tokens(reference[0]).mid) + 1          # all up to the middle token
    assert status == 200 and k["content"] == content
    assert k["rakv"]["hit_tokens"] >= stable and k["timings"]["prompt_n"] <= len(ids2) - stable + 1

    recs = get(fim_server.url, "/rakv/records?since=1")[1]["records"]     # the explorer sees the warm-up
    ends = [x for x in recs if x["type"] == "request_end"]
    assert any(x["stopped"] == "warm" and x["hit_tokens"] >= 0 for x in ends)
    assert any(x["type"] == "cache_lookup" and x["request_id"] == w["rakv"]["request_id"] for x in recs)


def test_line_rules_through_the_server(fim_server, reference):
    body = vim_body(prompt="", input_prefix="    " + PREFIX, n_indent=4, response_fields=None)
    status, r = post(fim_server.url, body, "/infill")
    assert status == 200
    _, content, _, _ = expected(reference, "    " + PREFIX, SUFFIX, "", EXTRA, rules=LineRules(n_indent=4))
    assert r["content"] == content

    status, r = post(fim_server.url, vim_body(t_max_predict_ms=1e-6, response_fields=None), "/infill")
    assert status == 200
    _, content, _, _ = expected(reference, PREFIX, SUFFIX, LINE, EXTRA, rules=LineRules(t_max_ms=1e-6),
                                ms=lambda i: 0.0 if i == 0 else 1.0)
    assert r["content"] == content


@pytest.mark.parametrize("body, says", [
    ([1, 2], "must be a JSON object"),
    ({"input_suffix": ""}, '"input_prefix" is required'),
    ({"input_prefix": "", "input_suffix": "", "t_max_predict_ms": "soon"}, "t_max_predict_ms must be"),
    ({"input_prefix": "", "input_suffix": "", "response_fields": "content"}, "response_fields must be"),
    ({"input_prefix": 1, "input_suffix": ""}, '"input_prefix" must be a string'),
    ({"input_prefix": "", "input_suffix": "", "prompt": 3}, '"prompt" must be a string'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": "x"}, '"input_extra" must be an array'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, 'must have a "text" string'),
    ({"input_prefix": "", "input_suffix": "", "n_predict": "many"}, "n_predict must be an integer"),
    ({"input_prefix": "", "input_suffix": "", "n_indent": -1}, "n_indent must be an integer >= 0"),
    ({"input_prefix": "", "input_suffix": "", "stream": True}, "stream is not supported"),
    ({"input_prefix": "", "input_suffix": "", "prompt": "x = 1; " * 200}, "does not fit"),
])
def test_infill_bad_input_is_one_line(fim_server, body, says):
    status, r = post(fim_server.url, body, "/infill")
    assert status == 400 and says in r["error"]["message"] and "\n" not in r["error"]["message"]


def test_past_the_context_the_answer_is_truncated(fim_server):
    status, r = post(fim_server.url, vim_body(n_predict=1000, response_fields=None), "/infill")
    assert status == 200 and r["truncated"] is True
    assert r["tokens_evaluated"] + r["generation_settings"]["n_predict"] == 256     # the tiny model's context


def test_a_model_without_fim_tokens_is_refused(model_dir, tmp_path_factory):
    s = _server(model_dir, tmp_path_factory)
    try:
        status, r = post(s.url, vim_body(), "/infill")
        assert status == 400 and "cannot fill in the middle" in r["error"]["message"]
        status, r = post(s.url, {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}, "/v1/completions")
        assert status == 400 and "<|fim_prefix|>" in r["error"]["message"]
        status, r = post(s.url, {"prompt": PREFIX, "max_tokens": 4}, "/v1/completions")
        assert status == 200                    # (a plain completion still works)
    finally:
        s.close()


# ----------------------------------------------------------------------------- /v1/completions suffix
@pytest.mark.fast
def test_completion_with_suffix_fills_the_middle(fim_server, reference):
    body = {"prompt": PREFIX + LINE, "suffix": SUFFIX, "max_tokens": N}
    status, r = post(fim_server.url, body, "/v1/completions")
    assert status == 200, r
    kept, content, out, _ = expected(reference, PREFIX + LINE, SUFFIX)
    assert r["choices"][0]["text"] == content
    assert r["rakv"]["output_ids"][: len(kept)] == kept
    assert r["choices"][0]["finish_reason"] == ("length" if len(kept) == N else "stop")

    import json
    import urllib.request

    req = urllib.request.Request(fim_server.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [ln[6:] for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == content

    status, r = post(fim_server.url, {"prompt": [5, 6], "suffix": "x"}, "/v1/completions")
    assert status == 400 and "prompt as text" in r["error"]["message"]
    status, r = post(fim_server.url, {"messages": [{"role": "user", "content": "x"}], "suffix": "x"})
    assert status == 400 and "suffix" in r["error"]["message"]


# ----------------------------------------------------------------------------- the pure parts
@pytest.mark.fast
def test_fim_prompt_order_and_truncation():
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer(fim=True)
    f = find_tokens(tok)
    p = build(tok, PREFIX, SUFFIX, LINE, [("util.py", "x = 1\n")])
    ids = p.ids
    assert ids[0] == f.rep and ids.count(f.sep) == 2                  # repository context first
    assert ids.index(f.pre) < ids.index(f.suf) < ids.index(f.mid)
    assert tok.decode(ids[ids.index(f.mid) + 1:]) == LINE              # the current line last
    assert split_blanks("    return \t") == ("    return", " \t") and split_blanks("  ") == ("", "  ")
    assert heal(" a + b", " ") == "a + b" and heal("(a)", " ") == "(a)" and heal("  x", "    ") == "x"
    assert not p.truncated
    long = build(tok, "a = 1\n" * 200, "b = 2\n" * 200, "", [("u.py", "c = 3\n" * 200)], n_predict=8, n_ctx=256)
    assert long.truncated and long.prefix_tokens == 48 and long.suffix_tokens == 14 == 64 // 4 - 2
    assert len(long.ids) <= 256 - 2 * 8 + 4
    with pytest.raises(ValueError, match="cannot fill in the middle"):
        find_tokens(tiny_tokenizer())


@pytest.mark.fast
def test_line_rules_as_llama_cpp_applies_them():
    r = LineRules(n_indent=4)          # the first line is never judged; a later one indented less is cut
    for piece in ["a + b", "\n", "    c", "\n", "d", "e"]:
        if not r.push(piece, 0.0):
            break
    assert r.text == "a + b\n    c\n" and r.why == "indent"
    r = LineRules(t_max_ms=10)         # past the time, the next token with a newline is the last
    assert r.push("x", 50) and r.push("y\n", 5) and not r.push("z\n", 50)
    assert r.text == "xy\nz\n" and r.why == "time"
    r = LineRules()
    assert all(r.push(p, 1e9) for p in ["a\n", "b\n", "c"]) and r.text == "a\nb\nc"


# ----------------------------------------------------------------------------- the explorer
def test_explorer_attached_shows_completions_and_warm_ups(fim_server, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        assert w.attach_server(fim_server.url)
        qtbot.waitUntil(lambda: w.state.header is not None, timeout=30000)
        seen = len(w.state.ends)
        warm = post(fim_server.url, vim_body(prompt="    re", n_predict=0, response_fields=None), "/infill")[1]
        qtbot.waitUntil(lambda: any(e.request_id == warm["rakv"]["request_id"] for e in w.state.ends[seen:]),
                        timeout=30000)
        r = post(fim_server.url, vim_body(prompt="    re", response_fields=None), "/infill")[1]
        rid = r["rakv"]["request_id"]
        qtbot.waitUntil(lambda: any(e.request_id == rid for e in w.state.ends[seen:]), timeout=30000)
        end = next(e for e in w.state.ends if e.request_id == rid)
        assert end.hit_tokens == r["tokens_evaluated"] and end.exact_repeat        # the warm-up's KV, reused
        snap = w.panel_snapshot()
        assert w.state.request_id == rid and w.state.decision is not None and snap["costs"]["bars"]
        assert not w.errors
    finally:
        w.shutdown()


def test_a_prompt_built_by_the_client_ends_with_the_middle(fim_server, reference):
    """Continue / Tabby / Twinny send the FIM prompt as text: it is read with its FIM tokens, and
    the answer ends where the middle ends, as /infill's does."""
    tok = reference[0]
    _, _, _, ids = expected(reference, PREFIX + LINE, SUFFIX)
    text = tok.decode(ids, skip_special_tokens=False)
    status, r = post(fim_server.url, {"prompt": text, "max_tokens": N}, "/v1/completions")
    assert status == 200
    kept, content, _, _ = expected(reference, PREFIX + LINE, SUFFIX)
    assert r["rakv"]["prompt_tokens"] == len(ids) and r["choices"][0]["text"] == content
    assert r["rakv"]["output_ids"][: len(kept)] == kept


@pytest.mark.fast
def test_the_answer_ends_at_the_first_fim_end_token():
    """Tokens after the middle's end (a FIM end token) in the same round are not the answer, and the
    engine is asked to stop at the end of that round."""
    from types import SimpleNamespace

    from rakv.records import RequestStart, Round
    from rakv.serve.state import Current
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer(fim=True)
    f = find_tokens(tok)
    stopped = []
    eng = SimpleNamespace(target=SimpleNamespace(tokenizer=tok), stop=lambda: stopped.append(1))
    sent = []
    cur = Current(eng, [], emit=sent.append, ends=f.ends | {0}, rules=LineRules())
    a, b = tok("a + b", add_special_tokens=False)["input_ids"][:2]
    cur.see(RequestStart(request_id=3))
    cur.see(Round(request_id=3, index=0, emitted=[a]))
    assert not stopped
    cur.see(Round(request_id=3, index=1, emitted=[b, f.pad, a, b]))
    cur.finish()
    assert cur.kept == [a, b] and cur.ended == "fim_end" and stopped
    assert "".join(sent) == cur.rules.text == tok.decode([a, b])


def test_a_seeded_fill_is_the_seeded_decoding_of_its_prompt(fim_server, reference):
    """Sampled with a seed: the fill's ids are those of a plain completion of the same FIM prompt ids
    with that seed (whose ids equal rakv generate --seed, tests/engine/test_serve.py)."""
    body = vim_body(temperature=0.9, seed=77, response_fields=None)
    a = post(fim_server.url, body, "/infill")[1]
    b = post(fim_server.url, body, "/infill")[1]
    assert a["content"] == b["content"] and a["rakv"]["output_ids"] == b["rakv"]["output_ids"]
    _, _, _, ids = expected(reference, PREFIX, SUFFIX, LINE, EXTRA)
    status, c = post(fim_server.url, {"prompt": ids, "max_tokens": N, "temperature": 0.9, "top_k": 40,
                                      "top_p": 0.99, "seed": 77}, "/v1/completions")
    assert status == 200
    kept = a["rakv"]["output_ids"][: a["tokens_predicted"]]
    assert c["rakv"]["output_ids"][: len(kept)] == kept
