"""The load bench's arms and its load that changes (rakv.bench.load, rakv.bench.peers.serving):
fixed-k rakv arms (rakv-kN: rakv serve --policy joint:N, rakv-k0: kv), a trace of phases (clients over requests)
parsed, refused with one line when malformed, and reported per phase and over the whole trace.
No server is started here (tests/engine/test_batching.py runs one)."""

from __future__ import annotations

import pytest

from rakv.bench.load import Answer, LoadRun, parse_trace, trace_rows
from rakv.bench.peers.serving import known_server, rakv_policy

pytestmark = pytest.mark.fast


def test_the_rakv_arms_and_their_policies():
    assert rakv_policy("rakv", "adaptive") == "adaptive"
    assert rakv_policy("rakv-ar", "adaptive") == "ar"
    assert rakv_policy("rakv-k4", "adaptive") == "joint:4"
    assert rakv_policy("rakv-k12", "adaptive") == "joint:12"
    assert rakv_policy("rakv-k0", "adaptive") == "kv"                  # reuse, no drafting
    assert rakv_policy("llama", "adaptive") is None
    assert all(known_server(s) for s in ("rakv", "rakv-ar", "rakv-k2", "llama", "llama-md"))
    assert not any(known_server(s) for s in ("rakv-k01", "rakv-k", "rakv-kx", "rakv-k100", "vllm", "rakv-k2 "))


def test_a_trace_parses_and_bad_ones_say_why():
    assert parse_trace("1:8,8:32,2:8") == [(1, 8), (8, 32), (2, 8)]
    assert parse_trace(" 4:2 ") == [(4, 2)]
    for bad in ("", "1", "1:2:3", "a:b", "0:4", "65:4", "2:0", ","):
        with pytest.raises(ValueError, match="--load-trace"):
            parse_trace(bad)


def test_the_cli_refuses_a_bad_arm_or_trace_in_one_line(capsys):
    from rakv.cli import main

    assert main(["bench", "--load", "rakv-kq", "--target", "demo"]) == 2
    assert main(["bench", "--load", "rakv", "--load-trace", "8", "--target", "demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "rakv-kq" in err[0] and "--load-trace" in err[1]
    assert "Traceback" not in "".join(err)


def _run(clients, answers, wall):
    return LoadRun("x", clients, wall, [Answer(p, t, n, 0.1, 1.0) for p, t, n in answers])


def test_trace_rows_per_phase_and_over_the_trace():
    phases = [(1, 2), (4, 4)]
    runs = [("a", 0, _run(1, [(0, "x", 10), (1, "y", 10)], 2.0)),
            ("a", 1, _run(4, [(2, "z", 10), (3, "w", 10), (4, "v", 10), (5, "u", 10)], 1.0)),
            ("b", 0, _run(1, [(0, "x", 10), (1, "Y", 10)], 4.0)),
            ("b", 1, _run(4, [(2, "z", 10), (3, "w", 10), (4, "v", 10), (5, "u", 10)], 4.0))]
    rows = {(r["server"], r["phase"]): r for r in trace_rows(runs, phases)}
    assert rows["a", 1]["tok_s"] == 10.0 and rows["a", 2]["tok_s"] == 40.0
    assert rows["a", "all"]["tok_s"] == pytest.approx(60 / 3, abs=0.01) and rows["a", "all"]["clients"] == "1-4"
    assert rows["b", "all"]["tok_s"] == pytest.approx(60 / 8, abs=0.01)
    assert rows["a", "all"]["differ_from_first_server"] == 0
    assert rows["b", 1]["differ_from_first_server"] == 1 and rows["b", "all"]["differ_from_first_server"] == 1


def test_the_ttft_after_the_opening_wave_leaves_each_client_s_first_request_out():
    """A closed loop's first requests (one a client) arrive together; the later columns are the rest."""
    from rakv.bench.load import summary_rows

    answers = [Answer(i, "t", 4, ttft, 1.0, sent=i) for i, ttft in enumerate([1.0, 1.0, 0.2, 0.3, 0.4, 0.5])]
    row = summary_rows([LoadRun("x", 2, 3.0, answers)])[0]
    assert row["ttft_p50_later_s"] == pytest.approx(0.35) and row["ttft_p99_later_s"] == pytest.approx(0.497)
    assert row["ttft_p99_s"] == pytest.approx(1.0)


def test_the_steady_window_counts_the_tokens_that_arrived_by_its_end():
    """Each answer's tokens spread evenly over its chunks (a chunk may carry several)."""
    from rakv.bench.load import steady_window

    marks = [[1.0, 2.0, 3.0, 4.0], [1.5, 5.0], []]
    assert steady_window(marks, [8, 4, 3], 2.5) == pytest.approx(4 + 2)
    assert steady_window(marks, [8, 4, 3], 10.0) == pytest.approx(12)
    assert steady_window(marks, [8, 4, 3], 0.5) == 0.0
    r = LoadRun("x", 2, 10.0, [], steady_tokens=30.0, steady_s=6.0)
    assert r.steady_tok_s == pytest.approx(5.0) and LoadRun("y", 1, 1.0).steady_tok_s == 0.0


def test_paired_blocks_compare_the_first_server_with_each_other_one_block_by_block():
    from rakv.bench.load import paired_blocks

    blocks = []
    for b, (a, k0, k2) in enumerate([(10, 8, 12), (20, 16, 25), (11, 10, 10), (9, 9, 9)]):
        blocks += [{"server": "a", "clients": 4, "block": b, "tok_s": a, "steady_tok_s": 2 * a},
                   {"server": "k0", "clients": 4, "block": b, "tok_s": k0, "steady_tok_s": k0},
                   {"server": "k2", "clients": 4, "block": b, "tok_s": k2, "steady_tok_s": k2}]
    blocks.append({"server": "a", "clients": 8, "block": 0, "tok_s": 5, "steady_tok_s": 5})   # k0 missing: skipped
    rows = paired_blocks(blocks)
    assert [(r["clients"], r["against"]) for r in rows] == [(4, "k0"), (4, "k2")]
    r0 = rows[0]
    assert r0["blocks"] == 4 and r0["median"] == pytest.approx((1.1 + 1.25) / 2, abs=1e-4)
    assert r0["ci95"][0] <= r0["median"] <= r0["ci95"][1] and r0["ci95"] == paired_blocks(blocks)[0]["ci95"]
    assert paired_blocks(blocks, "steady_tok_s")[0]["median"] == pytest.approx((2.2 + 2.5) / 2, abs=1e-4)
    assert paired_blocks([]) == []


def test_answer_lengths_are_seeded_per_prompt_and_bad_ones_say_why():
    """``--load-lengths MIN:MAX``: one max_tokens a prompt, the same for every server (a seeded draw)."""
    from rakv.bench.load import answer_lengths

    a = answer_lengths("32:96", 50, seed=3)
    assert a == answer_lengths(" 32:96 ", 50, seed=3) and len(a) == 50
    assert all(32 <= x <= 96 for x in a) and len(set(a)) > 10
    assert answer_lengths("8:8", 3) == [8, 8, 8]
    for bad in ("", "32", "a:b", "0:4", "9:8", "1:2:3", "4:200000"):
        with pytest.raises(ValueError, match="--load-lengths"):
            answer_lengths(bad, 4)


def test_the_cli_refuses_bad_lengths_in_one_line(capsys):
    from rakv.cli import main

    assert main(["bench", "--load", "rakv", "--load-lengths", "9:8", "--target", "demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--load-lengths" in err[0] and "Traceback" not in err[0]


def test_blocks_of_more_waves():
    from rakv.bench.load import block_size

    assert block_size(1) == 4 and block_size(4) == 8 and block_size(8) == 16
    assert block_size(4, 6) == 24 and block_size(1, 6) == 6 and block_size(2, 1) == 4 and block_size(3, 0) == 4
