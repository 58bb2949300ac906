"""Chat template by default, --raw as is; recordings keep the user text and the ids fed."""

from __future__ import annotations

import json

import pytest

from rakv.cli import main
from rakv.config import RakvConfig
from rakv.drafts import ModelDraft, NgramDraft
from rakv.engine import Engine
from rakv.models import wrap
from rakv.prompts import encode_prompt, template_prefix
from rakv.records import RequestStart, read_recording, request_rows
from tests.tiny import make_model, oracle, perturbed, save_tiny, tiny_tokenizer

TEXT = "Write a function that adds two numbers."


def upto_eos(ids: list[int], eos) -> list[int]:
    """The oracle runs past EOS; the engine stops at it (and keeps it)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def ids_of(out) -> list[int]:
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


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


@pytest.fixture(scope="module")
def chat_pair():
    tok = tiny_tokenizer(chat=True)
    t = make_model("llama", seed=0)
    return wrap(t, tok, name="tiny-chat"), wrap(perturbed(t, 0.01), tok, name="tiny-chat-draft")


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
