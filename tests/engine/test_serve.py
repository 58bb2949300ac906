"""``rakv serve``: a real HTTP server on 127.0.0.1 (a free port) over a tiny random model, driven by
the standard OpenAI client, by curl and by urllib; the explorer attached to it. Loopback only."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rakv.cli import Run, build_parser, main
from rakv.records import read_recording
from rakv.serve import Server, StopText

ROOT = Path(__file__).resolve().parents[2]
TEXT = "The quick brown fox jumps over the lazy dog."
N = 12


def serve_args(model_dir, *extra):
    return build_parser().parse_args(["serve", "--target", str(model_dir), "--draft", "ngram", "--port", "0",
                                      "--max-new-tokens", str(N), *extra])


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    rec = tmp_path_factory.mktemp("serve-rec") / "server.jsonl"
    with pytest.MonkeyPatch.context() as mp:      # (a module fixture runs before conftest's per-test cache dir)
        mp.setenv("RAKV_CACHE", str(tmp_path_factory.getbasetemp() / "rakv-cache"))
        mp.setenv("RAKV_CONTENTION_CHECK", "0")
        args = serve_args(model_dir, "--record", str(rec))
        s = Server(args, lambda on_record: Run(args, on_record=on_record)).start()
        s.recording = rec
        yield s
        s.close()


def post(url: str, body, path: str = "/v1/chat/completions", raw: bytes | None = None):
    """(status, JSON answer) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, path: str):
    try:
        with urllib.request.urlopen(url + path, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate_json(capsys, model_dir, *argv) -> dict:
    code = main(["generate", "--target", str(model_dir), "--draft", "ngram", "--max-new-tokens", str(N),
                 "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[-1])


# ----------------------------------------------------------------------------- the OpenAI client
@pytest.mark.fast
def test_openai_client_chat_and_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [server.service.model]

    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": TEXT}], max_tokens=N)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= N
    info = r.model_extra["rakv"]
    assert {"hit_tokens", "exact_repeat", "action", "candidates", "decisions", "drafted", "accepted",
            "alpha"} <= set(info)
    assert info["decisions"][0]["round"] == -1 and info["decisions"][0]["candidates"]
    assert len(info["candidates"]) == 12           # adaptive: every (r, k) of {0,1} x K

    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": TEXT}],
                                                 max_tokens=N, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    last = chunks[-1]
    assert last.choices[0].finish_reason == r.choices[0].finish_reason
    assert last.model_extra["rakv"]["output_ids"] == info["output_ids"]
    assert last.model_extra["rakv"]["exact_repeat"]          # the same prompt again: stored logits

    c = client.completions.create(model="any", prompt=TEXT, max_tokens=N)
    assert c.model_extra["rakv"]["templated"] is False
    pieces = list(client.completions.create(model="any", prompt=TEXT, max_tokens=N, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == c.choices[0].text
    assert pieces[-1].model_extra["rakv"]["output_ids"] == c.model_extra["rakv"]["output_ids"]

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": TEXT}], n=2)
    assert "n must be 1" in str(e.value)


# ----------------------------------------------------------------------------- exactness against generate
def test_greedy_ids_equal_generate(server, model_dir, capsys):
    status, chat = post(server.url, {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": N})
    assert status == 200
    want = generate_json(capsys, model_dir, "--prompt", "Name a colour.")
    assert chat["rakv"]["output_ids"] == want["output_ids"] and chat["rakv"]["templated"]
    assert chat["usage"]["prompt_tokens"] == want["prompt_tokens"]

    status, comp = post(server.url, {"prompt": TEXT, "max_tokens": N}, "/v1/completions")
    want = generate_json(capsys, model_dir, "--prompt", TEXT, "--raw")
    assert comp["rakv"]["output_ids"] == want["output_ids"] and comp["choices"][0]["text"] == want["text"]

    # a seed in the request is the seed its tokens use: rakv generate --seed S gives the same
    body = {"prompt": TEXT, "max_tokens": N, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = post(server.url, body, "/v1/completions")[1]["rakv"]
    b = post(server.url, body, "/v1/completions")[1]["rakv"]
    assert a["output_ids"] == b["output_ids"] and a["sampling"]["seed"] == 1234
    want = generate_json(capsys, model_dir, "--prompt", TEXT, "--raw", "--temperature", "0.9", "--top-p", "0.95",
                         "--seed", "1234")
    assert a["output_ids"] == want["output_ids"]


def test_conversation_turns_hit_the_cache(server):
    msgs = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hello there."}]
    first = post(server.url, {"messages": msgs, "max_tokens": 8})[1]
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And again?"}]
    status, r = post(server.url, {"messages": msgs, "max_tokens": 1000})      # past the context: refused ...
    assert status == 400 and r["error"]["code"] == "context_length_exceeded"
    second = post(server.url, {"messages": msgs, "max_tokens": 8})[1]["rakv"]  # ... and the conversation goes on
    conv = second["conversation"]
    assert conv["turn"] == 2 and conv["ids_from"] == "append"
    assert conv["conversation"] == first["rakv"]["conversation"]["conversation"]
    # the whole conversation before this turn (its prompt and answer) came from the prefix cache
    assert second["hit_tokens"] >= conv["previous_tokens"] > first["usage"]["prompt_tokens"]

    # a history this server did not answer starts a conversation of its own (and still answers)
    other = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "made up"},
             {"role": "user", "content": "Go on."}]
    r = post(server.url, {"messages": other, "max_tokens": 4})[1]["rakv"]
    assert r["conversation"]["turn"] == 2 and r["conversation"]["conversation"] != conv["conversation"]
    # messages that are no conversation (two user messages in a row): one templated prompt
    status, r = post(server.url, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                  "max_tokens": 4})
    assert status == 200 and r["rakv"]["conversation"] is None and r["rakv"]["templated"]


# ----------------------------------------------------------------------------- stop strings
@pytest.mark.fast
def test_stop_text_holds_back_a_stop_string_split_across_pieces():
    s = StopText(["END"])
    assert [s.push(p) for p in ("abc E", "N", "D tail")] == ["abc ", "", ""]
    assert s.hit and s.text() == "abc "
    s = StopText(["xyz"])
    assert s.push("ab x") == "ab " and s.push("a") == "xa" and s.finish() == "" and s.text() == "ab xa"
    s = StopText([])
    assert s.push("hello") == "hello" and s.finish() == ""


def test_stop_strings_cut_and_stop(server):
    full = post(server.url, {"prompt": TEXT, "max_tokens": 40}, "/v1/completions")[1]
    text = full["choices"][0]["text"]
    assert len(text) >= 4, text
    stop = text[2:4]
    want = text[: text.find(stop)]
    for stream in (False, True):
        body = {"prompt": TEXT, "max_tokens": 40, "stop": [stop, "never-seen"], "stream": stream}
        if stream:
            got, finish, last = sse(server.url + "/v1/completions", body)
        else:
            r = post(server.url, body, "/v1/completions")[1]
            got, finish, last = r["choices"][0]["text"], r["choices"][0]["finish_reason"], r
        assert got == want and finish == "stop" and last["rakv"]["stop_string"]
        # generating stopped in the round that met the stop string (unless that round met EOS too)
        ended = last["rakv"]["stopped"]
        assert ended == "stop" or (ended == "eos" and last["rakv"]["output_ids"] == full["rakv"]["output_ids"])


def sse(url: str, body: dict):
    """(text, finish_reason, last chunk) of a streamed request read as raw server-sent events."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        for line in r.read().decode().split("\n\n"):
            if line.strip():
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"], chunks[-1]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", {"model": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, "last message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n must be 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top-p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "batch"),
    ("/v1/completions", {"prompt": [999999]}, "out of range"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "context"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "log-probabilities"),
])
def test_bad_input_is_a_400(server, path, body, words):
    status, r = post(server.url, None if isinstance(body, bytes) else body, path,
                     raw=body if isinstance(body, bytes) else None)
    assert status == 400, r
    assert words in r["error"]["message"] and r["error"]["type"] == "invalid_request_error"


def test_wrong_paths_and_a_garbled_request_then_the_server_still_answers(server):
    assert get(server.url, "/v2/nothing")[0] == 404
    assert get(server.url, "/v1/chat/completions")[0] == 405
    assert get(server.url, "/v1/models/not-this-one")[0] == 404
    assert get(server.url, f"/v1/models/{server.service.model}")[1]["id"] == server.service.model
    assert get(server.url, "/rakv/records?since=x")[0] == 400
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:    # not HTTP at all
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        answer = read_all(s)
    assert answer.startswith("HTTP/1.1 400") and '"error"' in answer
    with socket.create_connection((host, port), timeout=10) as s:    # a POST without a body length
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all(s).startswith("HTTP/1.1 411")
    status, r = post(server.url, {"prompt": TEXT, "max_tokens": 2}, "/v1/completions")
    assert status == 200 and len(r["rakv"]["output_ids"]) <= 2


def read_all(s: socket.socket) -> str:
    """What the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out.decode("latin-1")


# ----------------------------------------------------------------------------- the records endpoint
def test_records_endpoint_and_long_poll(server):
    status, first = get(server.url, "/rakv/records?since=0&limit=1")
    assert status == 200 and first["records"][0]["type"] == "header" and first["next"] >= 1
    since = get(server.url, "/rakv/records?since=1")[1]["next"]
    got = {}

    def poll():
        got["answer"] = get(server.url, f"/rakv/records?since={since}&wait=20")[1]

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.3)
    r = post(server.url, {"prompt": TEXT, "max_tokens": 4}, "/v1/completions")[1]
    t.join(60)
    recs = got["answer"]["records"]
    assert recs and recs[0]["type"] == "request_start"
    rid = r["rakv"]["request_id"]
    everything = get(server.url, f"/rakv/records?since={since}")[1]
    types = [x["type"] for x in everything["records"] if x.get("request_id") == rid]
    assert types[0] == "request_start" and types[-1] == "request_end"
    assert {"cache_lookup", "decision", "round"} <= set(types)
    end = everything["records"][-1]
    assert end["output_ids"] == r["rakv"]["output_ids"]
    assert all(str(i) in everything["pieces"] for i in end["output_ids"])   # text for a viewer without the tokenizer
    assert everything["next"] == since + len(everything["records"])
    assert get(server.url, f"/rakv/records?since={everything['next']}")[1]["records"] == []


def test_the_recording_holds_generates_records(server):
    post(server.url, {"prompt": TEXT, "max_tokens": 3}, "/v1/completions")
    recs = read_recording(server.recording)
    assert recs[0].type == "header" and recs[-1].type == "request_end"
    assert {"request_start", "cache_lookup", "decision", "round"} <= {r.type for r in recs}


# ----------------------------------------------------------------------------- curl
def test_curl(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    p = subprocess.run([curl, "-sS", server.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                        "-d", json.dumps({"model": "m", "messages": [{"role": "user", "content": TEXT}],
                                          "max_tokens": 6, "user": "u" * 2000})],     # > 1 KB: curl expects 100-continue
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["object"] == "chat.completion" and "rakv" in r
    p = subprocess.run([curl, "-sSN", server.url + "/v1/completions", "-d",
                        json.dumps({"prompt": TEXT, "max_tokens": 6, "stream": True})],
                       capture_output=True, text=True, timeout=120)
    events = [e for e in p.stdout.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and "rakv" in json.loads(events[-2][len("data: "):])
    p = subprocess.run([curl, "-sS", server.url + "/v1/completions", "-d", "{oops"], capture_output=True,
                       text=True, timeout=60)
    assert "not valid JSON" in json.loads(p.stdout)["error"]["message"]


# ----------------------------------------------------------------------------- the command
def rakv_cmd(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [sys.executable, "-m", "rakv", *argv], env


@pytest.mark.fast
def test_version():
    cmd, env = rakv_cmd("--version")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    from rakv.cli import package_version

    assert p.returncode == 0 and p.stdout.strip() == f"rakv {package_version()}"


def test_port_in_use_is_one_line_before_any_model_loads(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cmd, env = rakv_cmd("serve", "--target", str(model_dir), "--port", str(port))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("rakv: error: cannot listen on 127.0.0.1")
    assert "Traceback" not in p.stderr and "loaded" not in p.stderr


def test_serve_command_logs_records_and_stops_cleanly_on_ctrl_c(model_dir, tmp_path):
    rec = tmp_path / "cmd.jsonl"
    cmd, env = rakv_cmd("serve", "--target", str(model_dir), "--draft", "ngram", "--policy", "kv", "--port", "0",
                        "--max-new-tokens", "4", "--record", str(rec))
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        lines = []
        deadline = time.time() + 240
        while url is None and time.time() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r" on (http://[0-9.]+:[0-9]+)", line)
            if m:
                url = m.group(1)
        assert url, "".join(lines)
        status, r = post(url, {"prompt": TEXT}, "/v1/completions")
        assert status == 200 and len(r["rakv"]["output_ids"]) <= 4
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "shutting down after 1 requests" in err, err
    assert '"POST /v1/completions HTTP/1.1" 200' in err, err                # one line per request
    recs = read_recording(rec)
    assert recs[0].type == "header" and recs[-1].type == "request_end"


# ----------------------------------------------------------------------------- the explorer, attached
def test_explorer_attaches_and_shows_a_request_sent_by_urllib(server, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        assert w.attach_server(server.url + "/v1")          # an OpenAI base URL is taken too
        qtbot.waitUntil(lambda: w.state.header is not None, timeout=30000)
        assert w.state is w.attachment.state and "attached to" in w.windowTitle()
        seen = len(w.state.ends)
        r = post(server.url, {"messages": [{"role": "user", "content": "Attached?"}], "max_tokens": 6})[1]
        rid = r["rakv"]["request_id"]
        qtbot.waitUntil(lambda: any(e.request_id == rid for e in w.state.ends[seen:]), timeout=30000)
        snap = w.panel_snapshot()
        assert w.state.request_id == rid and w.state.decision is not None
        assert snap["costs"]["bars"] and snap["tokens"]["n"] > 0
        table = w.attachment.pieces.table                   # the tokens' text came with the records
        assert all(table.get(i, f"<{i}>") != f"<{i}>" for i in r["rakv"]["output_ids"])
        assert "attached to" in w.run_panel.loaded.text()
        w.detach_server()
        assert w.attachment is None and w.state is w.live and not w.act_detach.isEnabled()
        assert not w.attach_server("ftp://nowhere") and w.errors[-1].startswith("only http://")
    finally:
        w.shutdown()


def test_explorer_attach_to_nothing_is_a_dialog(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        with qtbot.waitSignal(w.errorShown, timeout=30000) as sig:
            assert w.attach_server(f"127.0.0.1:{port}")
        assert sig.args[0].startswith(f"cannot reach http://127.0.0.1:{port}")
        assert w.attachment is None and w.state is w.live
    finally:
        w.shutdown()


def test_concurrent_requests_decode_together_and_each_equals_its_solo_run(server):
    answers = {}

    def ask(i):
        body = {"prompt": f"{TEXT} {i}", "max_tokens": 6}
        if i % 2:
            answers[i] = sse(server.url + "/v1/completions", {**body, "stream": True})[2]["rakv"]
        else:
            status, r = post(server.url, body, "/v1/completions")
            answers[i] = r["rakv"] if status == 200 else r

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ids = {a["request_id"] for a in answers.values()}
    assert len(ids) == 4
    recs = get(server.url, "/rakv/records?since=1")[1]["records"]
    steps = [r for r in recs if r["type"] == "step" and {q for q, _ in r["requests"]} & ids]
    assert steps and max(len(r["requests"]) for r in steps) >= 2          # they shared forwards
    for i, a in answers.items():                                         # ... and each is its solo run
        alone = post(server.url, {"prompt": f"{TEXT} {i}", "max_tokens": 6}, "/v1/completions")[1]["rakv"]
        assert alone["output_ids"] == a["output_ids"]


def test_a_client_that_goes_away_stops_its_request(server):
    from rakv.serve.api import parse_ask

    calls = []

    def gone(piece):
        calls.append(piece)
        raise BrokenPipeError("the client closed the connection")

    res = server.service.complete(parse_ask({"prompt": "alpha beta gamma delta", "max_tokens": 40, "stream": True},
                                            chat=False), emit=gone)
    assert len(calls) == 1 and res.end.stopped == "stop" and len(res.end.output_ids) < 40
    status, r = post(server.url, {"prompt": TEXT, "max_tokens": 3}, "/v1/completions")   # the next one runs
    assert status == 200 and r["rakv"]["stopped"] != "stop"
