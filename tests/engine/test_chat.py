"""Chat template by default, --raw as is; recordings keep the user text and the ids fed."""

from __future__ import annotations

import os

import json

import pytest

from rakv.cli import main
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.prompts import encode_prompt, template_prefix
from rakv.records import RequestStart, read_recording, request_rows
from tests.tiny import oracle, save_tiny, tiny_tokenizer

TEXT = "Write a function that adds two numbers."


def upto_eos(ids: list[int], eos) -> list[int]:
    """The engine stops at EOS (and keeps it); so does ``oracle`` of a wrapped model, not of a plain
    one whose config names no EOS (the CLI's model takes the tokenizer's)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def ids_of(out) -> list[int]:
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.fast
def test_encode_prompt_applies_the_template():
    tok = tiny_tokenizer(chat=True)
    want = ids_of(tok.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True))
    enc = encode_prompt(tok, TEXT)
    assert enc.templated and enc.ids == want
    rendered = tok.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered.startswith("<pad>system: ") and rendered.endswith("assistant: ")
    # the shared prefix: the system line and the user header, identical for any user text
    other = encode_prompt(tok, "Translate 'good morning' into French.")
    S = enc.template_prefix
    assert 0 < S < len(enc.ids) and enc.ids[:S] == other.ids[:S] == template_prefix(tok)[:S]
    assert tok.decode(enc.ids[:S]).startswith("<pad>system: You answer briefly")


def test_raw_and_no_template():
    tok = tiny_tokenizer(chat=True)
    raw = encode_prompt(tok, TEXT, raw=True)
    assert not raw.templated and raw.template_prefix == 0
    assert raw.ids == tok(TEXT, add_special_tokens=False)["input_ids"]
    plain = tiny_tokenizer()                  # no template: raw, whatever is asked
    assert encode_prompt(plain, TEXT).ids == raw.ids and not encode_prompt(plain, TEXT).templated


@pytest.mark.parametrize("policy", ["ar", "kv", "spec:4", "joint:4"])
def test_templated_generation_is_exact(chat_pair, policy):
    target, draft = chat_pair
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), recs.append)
    ids = encode_prompt(target.tokenizer, TEXT).ids
    for text in (TEXT, "List three prime numbers.", TEXT):
        want = upto_eos(oracle(target.model, encode_prompt(target.tokenizer, text).ids, 16), target.eos_ids)
        assert eng.generate(text, 16).output_ids == want
    starts = [r for r in recs if isinstance(r, RequestStart)]
    assert starts[0].prompt == TEXT and starts[0].prompt_ids == ids and starts[0].templated
    assert starts[0].template_prefix == encode_prompt(target.tokenizer, TEXT).template_prefix > 0
    if policy in ("kv", "joint:4"):
        # the second prompt shares the template's prefix with the first; the third repeats it
        from rakv.records import RequestEnd
        ends = [r for r in recs if isinstance(r, RequestEnd)]
        assert ends[1].hit_tokens >= starts[1].template_prefix and ends[2].exact_repeat


@pytest.mark.fast
def test_engine_raw_switch(chat_pair):
    target, _ = chat_pair
    eng = Engine(target, NgramDraft(), RakvConfig(policy="ar", chat_template=False))
    raw = target.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert eng.encode(TEXT) == raw
    assert eng.generate(TEXT, 8).output_ids == upto_eos(oracle(target.model, raw, 8), target.eos_ids)
    eng.set_chat_template(True)
    assert eng.encode(TEXT) == encode_prompt(target.tokenizer, TEXT).ids
    assert eng.encode([5, 6, 7]) == [5, 6, 7]            # ids pass through untouched


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chatmodel")
    t = save_tiny(d / "target", "llama", chat=True)
    return d / "target", t


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_template_default_and_raw(chat_dir, capsys, tmp_path):
    path, t = chat_dir
    tok = tiny_tokenizer(chat=True)
    rec = tmp_path / "r.jsonl"
    code, out, err = run(capsys, "generate", "--target", str(path), "--draft", "ngram", "--policy", "kv",
                         "--prompt", TEXT, "--prompt", "Name a colour.", "--max-new-tokens", "10", "--json",
                         "--record", str(rec))
    assert code == 0, err
    a, b = [json.loads(x) for x in out.splitlines()]
    enc = encode_prompt(tok, TEXT)
    assert a["templated"] and a["prompt_tokens"] == len(enc.ids) and a["template_prefix"] == enc.template_prefix
    eos = {tok.eos_token_id}
    assert a["output_ids"] == upto_eos(oracle(t, enc.ids, 10), eos)
    assert b["hit_tokens"] >= b["template_prefix"] > 0        # the template's prefix is reused
    recs = read_recording(rec)
    start = next(r for r in recs if isinstance(r, RequestStart))
    assert start.prompt == TEXT and start.prompt_ids == enc.ids and start.templated
    rows = request_rows(recs)
    assert rows[0]["templated"] == 1 and rows[0]["template_prefix"] == enc.template_prefix
    code, out, err = run(capsys, "generate", "--target", str(path), "--draft", "ngram", "--policy", "ar",
                         "--prompt", TEXT, "--max-new-tokens", "10", "--json", "--raw")
    assert code == 0, err
    o = json.loads(out)
    raw = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert not o["templated"] and o["prompt_tokens"] == len(raw) and o["output_ids"] == upto_eos(oracle(t, raw, 10), eos)


# ----------------------------------------------------------------------------- explorer
def test_explorer_raw_box_and_template_in_cache_panel(qtbot, tmp_path, chat_pair, monkeypatch):
    pytest.importorskip("pytestqt")
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    target, draft = chat_pair
    w = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    try:
        assert not w.run_panel.raw.isChecked() and w.worker.controls.chat_template
        with qtbot.waitSignal(w.modelsLoaded, timeout=30_000):
            w.use_models(target, ModelDraft(draft), None)
        rp = w.run_panel
        rp.policy.setCurrentText("kv")
        rp.max_new.setValue(6)
        for text in (TEXT, "List three prime numbers."):
            rp.prompt.setPlainText(text)
            with qtbot.waitSignal(w.runFinished, timeout=30_000):
                w.run()
        w.redraw()
        st = w.live
        enc = encode_prompt(target.tokenizer, "List three prime numbers.")
        assert st.templated and st.prompt_tokens == len(enc.ids) and st.template_prefix == enc.template_prefix
        q, S = st.cache.hit_tokens, enc.template_prefix
        assert q >= S > 0
        note = w.panel_snapshot()["cache"]["template"]
        assert f"S = {S}" in note and "chat template's shared prefix" in note and f"hit q = {q}" in note
        # the raw box: the next request goes in as it is, and the choice persists
        rp.raw.setChecked(True)
        assert not w.worker.controls.chat_template and not w.worker.engine.chat_template
        with qtbot.waitSignal(w.runFinished, timeout=30_000):
            w.run()
        w.redraw()
        assert not w.live.templated and w.live.prompt_tokens == len(encode_prompt(target.tokenizer, rp.prompt_text(),
                                                                                  raw=True).ids)
        assert w.panel_snapshot()["cache"]["template"] == "raw prompt (no chat template)"
        w.save_settings()
    finally:
        w.shutdown()
    w2 = MainWindow(Settings(tmp_path / "s.ini"), tmp_path / "sessions2")
    qtbot.addWidget(w2)
    try:
        assert w2.run_panel.raw.isChecked() and not w2.worker.controls.chat_template
    finally:
        w2.shutdown()


# ----------------------------------------------------------------------------- conversations
from rakv.engine.chat import Conversation, run_turn  # noqa: E402

TURNS = ["Hi!", "And what did I just say?", "Name three prime numbers."]


def templated_ids(tok, msgs) -> list[int]:
    return ids_of(tok.apply_chat_template(msgs, add_generation_prompt=True))


def starts_of(recs) -> list[RequestStart]:
    return [r for r in recs if isinstance(r, RequestStart)]


@pytest.mark.parametrize("policy", ["ar", "kv", "spec:4", "joint:4"])
def test_conversation_turns_are_exact(chat_pair, policy):
    """Every turn's output is target-only greedy decoding of the ids fed; those ids are the whole
    conversation through the template (as text; as ids too where the answer re-tokenizes alike)."""
    target, draft = chat_pair
    tok = target.tokenizer
    recs = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy=policy), recs.append)
    conv = Conversation.for_engine(eng)
    for i, text in enumerate(TURNS):
        end = run_turn(eng, conv, text, 12)
        start = starts_of(recs)[-1]
        fed = start.prompt_ids
        assert end.output_ids == upto_eos(oracle(target.model, fed, 12), target.eos_ids)
        whole = templated_ids(tok, conv.messages()[:-1])      # the template over the conversation so far
        info = start.conversation
        assert start.templated and start.prompt == text and info["turn"] == i + 1
        assert tok.decode(fed) == tok.decode(whole)
        assert info["same_as_template"] == (fed == whole)
        if i:
            assert info["ids_from"] == "append" and fed[:info["previous_tokens"]] == conv.turns[i - 1].prompt_ids + \
                conv.turns[i - 1].output_ids
        if policy in ("kv", "joint:4") and i:
            # the previous turn's prompt and answer are all reused
            assert end.hit_tokens == info["previous_tokens"] == len(conv.turns[i - 1].prompt_ids) + len(
                conv.turns[i - 1].output_ids)


def test_no_reuse_policy_stores_no_answer(chat_pair):
    target, _ = chat_pair
    eng = Engine(target, NgramDraft(), RakvConfig(policy="ar"))
    conv = Conversation.for_engine(eng)
    for text in TURNS[:2]:
        run_turn(eng, conv, text, 6)
    assert len(eng.store) == 0


def test_answer_kv_is_stored(chat_pair):
    """keep_answer: after a turn the store holds prompt + answer (all of it, the last token fed)."""
    target, _ = chat_pair
    eng = Engine(target, NgramDraft(), RakvConfig(policy="kv"))
    conv = Conversation.for_engine(eng)
    end = run_turn(eng, conv, TURNS[0], 8)
    lengths = sorted(len(e.ids) for e in eng.store.entries())
    assert lengths == [end.prompt_tokens, end.prompt_tokens + len(end.output_ids)]
    full = max(eng.store.entries(), key=lambda e: len(e.ids))
    assert full.ids.tolist() == conv.ids and full.logits is not None


def canonical_turn(conv: Conversation, tok, text: str, answer: str, eos: bool = True):
    conv.prepare(text)
    out = tok(answer, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return conv.commit(out)


@pytest.mark.fast
def test_append_equals_template_when_the_answer_tokenizes_alike():
    tok = tiny_tokenizer(chat=True)
    conv = Conversation(tok, frozenset({tok.eos_token_id}))
    first = conv.prepare("Hi!")
    assert first.conversation["ids_from"] == "first" and first.ids == templated_ids(tok, conv.messages("Hi!"))
    assert first.keep_answer and first.templated and first.template_prefix > 0
    out = tok("Hello there.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    conv.commit(out)
    assert conv.messages()[-1] == {"role": "assistant", "content": "Hello there."}
    enc = conv.prepare("And what did I just say?")
    info = enc.conversation
    assert info["ids_from"] == "append" and info["same_as_template"] and info["first_diff"] == -1
    assert enc.ids == templated_ids(tok, conv.messages("And what did I just say?"))
    # the model's EOS is the template's end of turn: it is kept, so all of the previous turn is a prefix
    assert enc.ids[:len(conv.ids)] == conv.ids and info["previous_tokens"] == info["kept_tokens"] == len(conv.ids)


def test_append_keeps_the_models_own_ids():
    """Ids the tokenizer would not produce for the answer's text stay as generated (the hit covers
    them); the text is still the templated conversation's."""
    tok = tiny_tokenizer(chat=True)
    conv = Conversation(tok, frozenset({tok.eos_token_id}))
    conv.prepare("Hi!")
    canon = tok("The quick brown fox", add_special_tokens=False)["input_ids"]
    odd = [i for ch in "The quick brown fox" for i in tok(ch, add_special_tokens=False)["input_ids"]]  # one a letter
    assert odd != canon
    conv.commit(odd)                          # stopped at max_new_tokens: no EOS
    enc = conv.prepare("More.")
    info = enc.conversation
    whole = templated_ids(tok, conv.messages("More."))
    assert info["ids_from"] == "append" and not info["same_as_template"] and enc.ids != whole
    assert enc.ids[:len(conv.ids)] == conv.ids and tok.decode(enc.ids) == tok.decode(whole)
    assert info["first_diff"] == lcp_of(enc.ids, whole)


def lcp_of(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_template_that_rewrites_earlier_turns_falls_back():
    """A template that renders earlier turns differently once a turn is added cannot be appended
    to: the turn takes the template's own ids, and the record says why."""
    tok = tiny_tokenizer(chat=True)
    tok.chat_template = ("{{ '<pad>system: turn ' + (messages | length | string) + '\n' }}"
                         "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<eos>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    conv = Conversation(tok, frozenset({tok.eos_token_id}))
    canonical_turn(conv, tok, "Hi!", "Hello there.")
    enc = conv.prepare("And now?")
    info = enc.conversation
    assert info["ids_from"] == "template" and "renders the earlier turns differently" in info["reason"]
    assert enc.ids == templated_ids(tok, conv.messages("And now?")) and info["same_as_template"]
    assert info["kept_tokens"] < info["previous_tokens"]


def test_raw_conversation_is_plain_text():
    tok = tiny_tokenizer(chat=True)
    conv = Conversation(tok, frozenset({tok.eos_token_id}), raw=True)
    enc = conv.prepare("The quick brown fox")
    assert not enc.templated and enc.ids == tok("The quick brown fox", add_special_tokens=False)["input_ids"]
    conv.commit(tok(" jumps over the lazy dog.", add_special_tokens=False)["input_ids"])
    enc = conv.prepare("def add(a, b):")
    text = "The quick brown fox jumps over the lazy dog.\ndef add(a, b):"
    assert enc.conversation["ids_from"] == "append" and tok.decode(enc.ids) == text
    assert enc.ids[:len(conv.ids)] == conv.ids


def test_reset_and_abandon():
    tok = tiny_tokenizer(chat=True)
    conv = Conversation(tok, frozenset({tok.eos_token_id}))
    canonical_turn(conv, tok, "Hi!", "Hello.")
    conv.prepare("This one fails.")
    conv.abandon()
    assert len(conv.turns) == 1 and conv.prepare("Again.").conversation["turn"] == 2
    conv.reset()
    enc = conv.prepare("Hi!")
    assert enc.conversation == {**enc.conversation, "conversation": 2, "turn": 1, "ids_from": "first",
                                "previous_tokens": 0}
    with pytest.raises(ValueError):
        conv.prepare("   ")


def test_cli_chat_pipe_json_two_turns(chat_dir, capsys, monkeypatch, tmp_path):
    """printf 'Hi!\\nAnd what did I just say?\\n' | rakv chat --json: two objects; the second turn's
    hit covers the whole first turn (prompt and answer)."""
    import io

    path, t = chat_dir
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd what did I just say?\n"))
    rec = tmp_path / "chat.jsonl"
    code, out, err = run(capsys, "chat", "--target", str(path), "--draft", "ngram", "--max-new-tokens", "10",
                         "--json", "--record", str(rec))
    assert code == 0, err
    a, b = [json.loads(x) for x in out.splitlines()]
    need = {"request_id", "prompt_tokens", "output_ids", "text", "hit_tokens", "exact_repeat", "action",
            "candidates", "latency_ms", "ttft_ms", "tokens_per_s", "drafted", "accepted", "alpha_ewma"}
    assert need <= set(a) and need <= set(b)
    assert (a["turn"], b["turn"]) == (1, 2) and b["conversation"]["ids_from"] == "append"
    assert b["hit_tokens"] >= a["prompt_tokens"] + len(a["output_ids"]) == b["conversation"]["previous_tokens"]
    tok = tiny_tokenizer(chat=True)
    assert a["output_ids"] == upto_eos(oracle(t, encode_prompt(tok, "Hi!").ids, 10), {tok.eos_token_id})
    starts = [r for r in read_recording(rec) if isinstance(r, RequestStart)]
    assert [s.conversation["turn"] for s in starts] == [1, 2] and starts[1].prompt == "And what did I just say?"
    assert b["output_ids"] == upto_eos(oracle(t, starts[1].prompt_ids, 10), {tok.eos_token_id})


def test_cli_chat_commands_and_text(chat_dir, capsys, monkeypatch):
    import io

    path, _ = chat_dir
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n\n/stats\n/reset\nHello again.\n/exit\nnever sent\n"))
    code, out, err = run(capsys, "chat", "--target", str(path), "--draft", "none", "--policy", "kv",
                         "--max-new-tokens", "5")
    assert code == 0, err
    assert len(out.splitlines()) >= 2 and "never sent" not in err
    assert "conversation 1: 1 turns" in err and "new conversation (2)" in err
    assert "turn 1 of conversation 2" in err and "Traceback" not in err


def test_cli_chat_bad_input(chat_dir, capsys, monkeypatch):
    import io

    path, _ = chat_dir
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n"))
    code, out, err = run(capsys, "chat", "--target", str(path), "--draft", "none", "--policy", "spec:2")
    assert code == 2 and err.count("\n") == 1 and "needs a draft" in err and out == ""
    # a conversation that outgrows the model's context: one line, exit 2
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n"))
    code, out, err = run(capsys, "chat", "--target", str(path), "--draft", "none", "--policy", "kv",
                         "--max-new-tokens", "250", "--json")
    assert code == 2 and "exceeds the model's context" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- the conversation workload
def test_conversation_workload_streams():
    from rakv import workloads as W

    tok = tiny_tokenizer(chat=True)
    main_, held = W.conversations("conversation"), W.conversations("conversation-heldout")
    assert len(main_) >= 10 and len(held) >= 5 and all(len(c) >= 3 for c in main_ + held)
    assert not {m for c in main_ for m in c} & {m for c in held for m in c}      # held-out turns kept apart
    st = W.conversation_stream(main_, tok, 7, 16, seed=1)
    assert st == W.conversation_stream(main_, tok, 7, 16, seed=1) and len(st) == 7
    assert st[0].turn == 1 and st[0].kind == "unrelated" and st[0].ids
    for a, b in zip(st, st[1:]):
        assert b.turn == 1 or (b.turn == a.turn + 1 and b.context_id == a.context_id and b.kind == "shared"
                               and not b.ids)
    conv = main_[int(st[0].context_id.split("/")[1])]
    assert [r.user for r in st[:len(conv)]] == conv[:7]
    assert st[0].ids == tuple(encode_prompt(tok, conv[0]).ids)
    assert W.conversation_tokens(st, tok) >= len(st[0].ids) + 16


def test_bench_conversation_workload(tmp_path):
    """rakv bench --workload conversation: every policy gets the same turns (exact), a turn's ids
    continue the previous turn's prompt and answer, and the reuse policies hit all of them."""
    import csv

    out = tmp_path / "conv"
    assert main(["bench", "--tiny", "--workload", "conversation", "--policies", "ar,kv", "--n-prompts", "3",
                 "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out / "executions.csv")))
    assert len(rows) == 6 and all(r["match"] == "1" for r in rows)
    kv = sorted((r for r in rows if r["policy"] == "kv"), key=lambda r: int(r["index"]))
    assert [int(r["turn"]) for r in kv] == [1, 2, 3]
    for prev, cur in zip(kv, kv[1:]):
        before = int(prev["prompt_tokens"]) + int(prev["output_tokens"])
        assert int(cur["previous_tokens"]) == before and cur["ids_from"] in ("append", "template")
        # appended: the hit covers the whole turn before; re-templated (a random model's answer need not
        # survive decoding to text): as far as the new ids keep it
        assert int(cur["hit_tokens"]) == (before if cur["ids_from"] == "append" else int(cur["kept_tokens"]))
    assert any(r["ids_from"] == "append" for r in kv)
    assert all(r["hit_tokens"] == "0" for r in rows if r["policy"] == "ar")
    summary = (out / "summary.md").read_text()
    assert "## Conversations: reuse and latency per turn" in summary and "| conversation | 3 | kv |" in summary


def test_cli_chat_repl_on_a_pty_terminal(chat_dir, tmp_path):
    """On a terminal: a prompt, Ctrl-C stops the answer (or finds it done) and the chat goes on,
    /stats, Ctrl-C at the prompt clears the line, Ctrl-D ends with status 0.

    Deterministic on a loaded machine: each key and each Ctrl-C at the prompt goes out only once the
    chat is idle at its prompt (blocked in the line editor's select/poll, as /proc/PID/wchan tells,
    with all it wrote read here and the last of it the prompt). CPython's readline notices a Ctrl-C
    only while it waits in that select: one that comes between drawing the prompt and waiting is held
    until the next line, which it then drops; so the Ctrl-C sent during the answer, which may find the
    answer done and land there, is followed by a /stats that is sent again if it was dropped. Readline
    runs with TERM=dumb and an empty INPUTRC (no terminal escapes, no user key bindings). Every wait
    is bounded (TIMEOUT seconds)."""
    import re
    import select
    import signal
    import sys
    import time

    pty = pytest.importorskip("pty")
    TIMEOUT = 120.0
    path, _ = chat_dir
    env = {**os.environ, "RAKV_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path), "TERM": "dumb",
           "INPUTRC": os.devnull}
    pid, fd = pty.fork()
    if pid == 0:           # the child: rakv chat on the pty
        os.execve(sys.executable, [sys.executable, "-m", "rakv", "chat", "--target", str(path), "--draft", "none",
                                   "--policy", "kv", "--max-new-tokens", "190"], env)
    buf = bytearray()

    def read(timeout: float) -> bool:
        if not select.select([fd], [], [], timeout)[0]:
            return False
        try:
            data = os.read(fd, 4096)
        except OSError:    # EIO: the chat closed the terminal
            return False
        buf.extend(data)
        return bool(data)

    def failed(what: str) -> str:
        return f"{what} within {TIMEOUT:.0f} s; the terminal's last output: {bytes(buf)[-400:]!r}"

    def until(pattern: bytes, start: int) -> int:
        """Read until ``pattern`` shows after ``start``; where it ends."""
        first_of((pattern,), start)
        return buf.find(pattern, start) + len(pattern)

    def first_of(patterns: tuple[bytes, ...], start: int) -> int:
        """Read until one of ``patterns`` shows after ``start``; which one came first."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            found = [(i, buf.find(p, start)) for i, p in enumerate(patterns) if buf.find(p, start) >= 0]
            if found:
                return min(found, key=lambda x: x[1])[0]
            left = deadline - time.monotonic()
            assert left > 0, failed(f"none of {patterns!r}")
            read(min(left, 1.0))

    def waiting_for_input() -> bool:
        """The chat's main thread blocks in select/poll (the line editor waiting for a key); where
        /proc does not tell, a pause stands in."""
        try:
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            wchan = ""
        if wchan in ("", "0"):
            time.sleep(0.5)
            return True
        return "poll" in wchan or "select" in wchan

    def idle_at_prompt() -> int:
        """Wait until the chat waits for a line at its prompt; where its output ends."""
        deadline = time.monotonic() + TIMEOUT
        while not (buf.endswith(b">>> ") and waiting_for_input() and not read(0.5)):
            assert time.monotonic() < deadline, failed("the chat did not wait at its prompt")
            read(0.05)
        return len(buf)

    try:
        at = idle_at_prompt()
        os.write(fd, b"Hi!\n")
        at = until(b"Hi!\r\n", at)
        deadline = time.monotonic() + TIMEOUT
        while len(buf) == at:                            # the answer has started streaming
            assert time.monotonic() < deadline, failed("no answer")
            read(1.0)
        os.kill(pid, signal.SIGINT)                      # Ctrl-C while the answer runs (or just after)
        until(b"[rakv] turn 1:", at)
        at = idle_at_prompt()
        line = re.search(rb"\[rakv\] turn 1: (\d+) tokens[^\n]*", bytes(buf))
        assert line and (b"stopped" in line.group(0) or int(line.group(1)) == 190), line
        for attempt in range(2):                         # the second only if a held Ctrl-C dropped the first
            os.write(fd, b"/stats\n")
            dropped = first_of((b"conversation 1: 1 turns", b"(Ctrl-D or /exit ends the chat)"), at)
            at = idle_at_prompt()
            if not dropped:
                break
            assert attempt == 0, failed("/stats dropped twice")
        os.write(fd, b"\x03")                            # Ctrl-C at the prompt: the line editor waits in
        until(b"(Ctrl-D or /exit ends the chat)", at)    # select, so it is interrupted at once
        at = idle_at_prompt()                            # the next prompt: line editing reads again
        os.write(fd, b"\x04")                            # Ctrl-D
        done, status = 0, 0
        deadline = time.monotonic() + TIMEOUT
        while not done and time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                read(0.2)
        assert done, failed("rakv chat did not end on Ctrl-D")
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0 and b"Traceback" not in buf, bytes(buf)[-400:]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
