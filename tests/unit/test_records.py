"""Records: JSONL recordings flushed per line, round-trip, CSV derivation."""

from __future__ import annotations

import json

import pytest

from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.records import (CSV_COLUMNS, Recorder, RequestEnd, Round, read_recording,
                          request_rows, to_dict)
from tests.tiny import make_pair


def test_recording_is_flushed_per_line_and_round_trips(tmp_path):
    target, draft = make_pair("gpt2", "mostly")
    path = tmp_path / "r.jsonl"
    rec = Recorder(path)
    seen = []

    def cb(r):
        rec(r)
        # every record is on disk as soon as it is reported (nothing lost if the process dies)
        assert json.loads(path.read_text().splitlines()[-1])["type"] == r.type
        seen.append(r)

    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:3"), callback=cb)
    eng.header()
    p = list(range(20, 50))
    eng.generate(p, 10)
    eng.generate(p, 10)
    rec.close()
    back = read_recording(path)
    assert [to_dict(r) for r in back] == [json.loads(json.dumps(to_dict(r))) for r in seen]
    types = [r.type for r in back]
    assert types[0] == "header" and types.count("request_end") == 2 and "decision" in types
    rounds = [r for r in back if isinstance(r, Round) and r.kind == "spec"]
    assert rounds and sum(r.accepted for r in rounds) > 0
    last = {r.request_id: r.index for r in back if isinstance(r, Round)}
    for r in rounds:
        # a round emits its accepted drafts and one target token (the last round of a request may be
        # cut to max_new_tokens), each with its provenance
        want = (["draft"] * r.accepted + ["target"])
        assert len(r.emitted) == len(r.provenance) and r.provenance == want[: len(r.emitted)]
        assert 0 <= r.accepted <= r.drafted <= 3 and r.emitted
        if r.index != last[r.request_id]:
            assert len(r.emitted) == r.accepted + 1
    ends = [r for r in back if isinstance(r, RequestEnd)]
    for e in ends:                    # the rounds' emitted tokens are the request's output, in order
        assert [t for r in back if isinstance(r, Round) and r.request_id == e.request_id for t in r.emitted] \
            == e.output_ids
    rows = request_rows(back)
    assert len(rows) == 2 and list(rows[0]) == [c for c, _ in CSV_COLUMNS]
    assert rows[1]["exact_repeat"] == 1 and rows[1]["hit_tokens"] == 30
    ends = [r for r in back if isinstance(r, RequestEnd)]
    assert rows[0]["output_tokens"] == len(ends[0].output_ids) == 10


@pytest.mark.fast
def test_a_record_dict_is_asdicts_and_a_copy():
    """``to_dict`` (field by field) gives what ``dataclasses.asdict`` gives for every record an
    engine emits, nested lists and dicts copied: changing the dict leaves the record as it was."""
    from dataclasses import asdict

    from rakv.records import Decision, Step

    target, draft = make_pair("llama", "mostly")
    seen = []
    eng = Engine(target, ModelDraft(draft), RakvConfig(policy="joint:3"), callback=seen.append)
    eng.header()
    eng.generate(list(range(20, 50)), 12)
    seen.append(Step(step=1, requests=[[0, 3], [1, 1]], ms=1.5, shared=True))
    assert {r.type for r in seen} >= {"header", "decision", "round", "request_end", "step", "cache_lookup"}
    for r in seen:
        assert to_dict(r) == asdict(r)
    d = next(r for r in seen if isinstance(r, Decision) and r.candidates)
    out = to_dict(d)
    out["candidates"][0]["k"] = -1
    out["action"]["k"] = -1
    assert d.candidates[0]["k"] != -1 and d.action["k"] != -1
    s = seen[-1]
    to_dict(s)["requests"][0][1] = 99
    assert s.requests[0][1] == 3


def test_session_state_sums_exploration():
    """The explorer's status line shows what probes cost, per request and as a session share."""
    from app.state import SessionState
    from rakv.records import RequestEnd, RequestStart, Round

    st = SessionState()
    st.apply(RequestStart(request_id=0, prompt_tokens=4))
    st.apply(Round(request_id=0, index=1, kind="spec", k=4, drafted=4, accepted=0, emitted=[5], explore_ms=12.5))
    st.apply(Round(request_id=0, index=2, kind="ar", emitted=[6]))
    st.apply(RequestEnd(request_id=0, latency_ms=500.0, explore_ms=12.5))
    assert st.exploration() == (12.5, 0.025)
