"""Text streams to stdout as the engine commits tokens (generate and chat, without --json)."""

from __future__ import annotations

import io
import json

import pytest

from rakv.cli import main
from rakv.util.textstream import REPLACEMENT, TextStream
from tests.tiny import tiny_tokenizer

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

MIXED = "héllo wörld — 日本語 🙂 The quick brown fox jumps over the lazy dog."


def test_incremental_decoding_holds_back_incomplete_characters():
    tok = tiny_tokenizer()
    ids = tok(MIXED, add_special_tokens=False)["input_ids"]
    ts = TextStream(tok)
    pieces = [ts.push([i]) for i in ids]
    pieces.append(ts.finish())
    assert "".join(pieces) == MIXED == ts.text() == tok.decode(ids)
    assert not any(REPLACEMENT in p for p in pieces)
    assert "" in pieces[:-1]            # a multi-byte character waited for its last byte
    # several ids at once, and special tokens skipped as the engine's text does
    ts = TextStream(tok)
    eos = tok.eos_token_id
    out = "".join(ts.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + ts.push([eos]) + ts.finish()
    assert out == tok.decode(ids + [eos], skip_special_tokens=True)


def test_an_incomplete_character_at_the_end_is_written_by_finish():
    tok = tiny_tokenizer()
    ids = tok("日", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    ts = TextStream(tok)
    assert ts.push(ids[:-1]) == ""
    assert ts.finish() == tok.decode(ids[:-1])


class WatchedStdout(io.StringIO):
    """stdout that notes, at every write, whether the recording already holds the request's end."""

    def __init__(self, recording):
        super().__init__()
        self.recording = recording
        self.writes: list[tuple[str, int, int]] = []     # (text, request_start records, request_end records)

    def write(self, s):
        if s:
            types = [json.loads(x)["type"] for x in self.recording.read_text().splitlines() if x.strip()] \
                if self.recording.exists() else []
            self.writes.append((s, types.count("request_start"), types.count("request_end")))
        return super().write(s)


def test_generate_streams_while_the_request_runs(model_dir, monkeypatch, capsys, tmp_path):
    rec = tmp_path / "r.jsonl"
    out = WatchedStdout(rec)
    monkeypatch.setattr("sys.stdout", out)
    code = main(["generate", "--target", str(model_dir), "--draft", "none", "--policy", "ar",
                 "--prompt", "Write a haiku about the sea.", "--prompt", "Name a colour.",
                 "--max-new-tokens", "24", "--record", str(rec)])
    err = capsys.readouterr().err
    assert code == 0, err
    ends = [json.loads(x) for x in rec.read_text().splitlines() if '"request_end"' in x]
    # text was written while each request was still running (its end not yet recorded)
    during = [(s, starts, n_end) for s, starts, n_end in out.writes if n_end == starts - 1]
    assert {starts for _, starts, _ in during} == {1, 2}
    assert sum(1 for _, starts, _ in during if starts == 1) > 1        # in pieces, not all at once
    # and the pieces of each request add up to its text, one line each
    assert out.getvalue() == "".join(e["text"] + "\n" for e in ends)
    assert err.count("[rakv] request") == 2


def test_chat_streams_each_answer(model_dir, monkeypatch, capsys, tmp_path):
    rec = tmp_path / "c.jsonl"
    out = WatchedStdout(rec)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd what did I just say?\n"))
    code = main(["chat", "--target", str(model_dir), "--draft", "none", "--policy", "kv",
                 "--max-new-tokens", "16", "--record", str(rec)])
    err = capsys.readouterr().err
    assert code == 0, err
    ends = [json.loads(x) for x in rec.read_text().splitlines() if '"request_end"' in x]
    assert len(ends) == 2 and out.getvalue() == "".join(e["text"] + "\n" for e in ends)
    assert any(starts == 2 and n_end == 1 for _, starts, n_end in out.writes)
    assert "turn 2:" in err


def test_json_does_not_stream(model_dir, monkeypatch, capsys):
    code = main(["generate", "--target", str(model_dir), "--draft", "none", "--policy", "ar",
                 "--prompt", "Name a colour.", "--max-new-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.splitlines()) == 1 and json.loads(out)["text"] is not None
