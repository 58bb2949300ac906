"""``rakv bench --load ... --load-alternate``: every server up at once, taking turns in blocks."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    d = tmp_path_factory.mktemp("load-alternate") / "target"
    save_tiny(d, "llama")
    return d


def test_servers_take_turns_in_blocks_of_the_same_prompts(tiny_dir, tmp_path):
    """Two real ``rakv serve`` processes (a tiny Llama, greedy), started afresh at each client count:
    they take turns in blocks of ``block_size`` requests, each block's prompts to both, the first
    server of a block rotating; each server's run holds every request once, its texts are the
    other's (a server kept up would serve the 2-client prompts as exact repeats of the 1-client run)."""
    from rakv.bench.load import block_size, markdown, rakv_server, run_alternating, summary_rows

    specs = [rakv_server(str(tiny_dir), "none", 2, pol, ["--max-new-tokens", "6"], name=pol) for pol in ("ar", "kv")]
    prompts = [f"the {w} is" for w in ("cat", "dog", "sun", "sea", "map", "cup", "box", "pen", "key", "car")]
    n = 10
    runs = run_alternating(specs, prompts, [1, 2], n, 6, 120, tmp_path, progress=lambda m: None)
    assert [(r.server, r.clients) for r in runs] == [("ar", 1), ("kv", 1), ("ar", 2), ("kv", 2)]
    for r in runs:
        assert all(a.ok for a in r.answers) and sorted(a.prompt for a in r.answers) == list(range(n))
        assert r.wall_s > 0 and r.tokens > 0
    texts = {(r.server, r.clients): {a.prompt: a.text for a in r.answers} for r in runs}
    assert texts[("ar", 1)] == texts[("kv", 1)] == texts[("ar", 2)] == texts[("kv", 2)]
    rows = summary_rows(runs)
    assert all(row["differ_from_one_client"] == 0 for row in rows) and "| ar | 2 |" in markdown(rows)
    blocks = json.loads((tmp_path / "load.json").read_text())["blocks"]
    assert block_size(1) == 4 and block_size(2) == 4
    per = [b for b in blocks if b["clients"] == 1]
    assert len(per) == 2 * 3                                   # 10 requests in blocks of 4, 4, 2
    assert [b["server"] for b in per[:4]] == ["ar", "kv", "kv", "ar"]      # the first server rotates
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert logs.count("] serving ") == 4                      # each server started afresh at each count
    # the steady window: every client busy; at one client it is the whole run (nothing to drain)
    for r in runs:
        assert 0 < r.steady_s <= r.wall_s + 1e-6 and 0 < r.steady_tokens <= r.tokens + 1e-6
        assert all(0 <= a.start_s <= a.end_s <= r.wall_s + 1e-6 for a in r.answers)
    for r in runs[:2]:
        assert r.steady_tokens == pytest.approx(r.tokens) and r.steady_s == pytest.approx(r.wall_s, rel=0.05)
    data = json.loads((tmp_path / "load.json").read_text())
    assert all("steady_tok_s" in b for b in data["blocks"])
    paired = data["paired"]
    assert {(p["clients"], p["server"], p["against"], p["key"]) for p in paired} == {
        (c, "ar", "kv", k) for c in (1, 2) for k in ("tok_s", "steady_tok_s")}
    assert all(p["ci95"][0] <= p["median"] <= p["ci95"][1] for p in paired)
    assert (tmp_path / "paired.md").is_file()


def test_each_prompt_asks_its_own_length(tiny_dir, tmp_path):
    """``max_tokens`` a list (``--load-lengths``): each request asks its prompt's length, so the same
    prompt gets the same answer at every client count."""
    from rakv.bench.load import rakv_server, run_alternating

    specs = [rakv_server(str(tiny_dir), "none", 2, "ar", ["--max-new-tokens", "8"], name="ar")]
    prompts = [f"the {w} is" for w in ("cat", "dog", "sun", "sea")]
    lengths = [2, 8, 5, 3]
    runs = run_alternating(specs, prompts, [1, 2], 4, lengths, 120, tmp_path, progress=lambda m: None)
    for r in runs:
        assert sorted((a.prompt, a.tokens) for a in r.answers) == list(enumerate(lengths))
    assert {a.prompt: a.text for a in runs[0].answers} == {a.prompt: a.text for a in runs[1].answers}
