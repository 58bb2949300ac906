"""The explorer watching a vLLM server (app/vllm_watch.py, app/panels/vllm.py), offscreen.

A real HTTP server on a free loopback port serves vLLM 0.32's /metrics text (tests/with_vllm/vllm_metrics.py:
vLLM's metric names, HELP/TYPE lines and labels, prometheus_client's layout); the counters advance
between polls, the server restarts, goes away and comes back. No vLLM runs here. Every request the
explorer made is checked to be a GET of /metrics."""

from __future__ import annotations

import json
import socket

import pytest

from app.settings import Settings
from app.window import MainWindow
from rakv.integrations.vllm_watch import crossover
from tests.with_vllm.vllm_metrics import MetricsServer, metrics_text, state

T = 20000
POLL = 0.1          # seconds between polls in these tests (the explorer's default is 1 s)

S0 = state(100, [60, 45, 30, 15], 4, queries=1000, hits=250, prompt=1000, generation=400, success=5, itl=[0.02] * 10)
S1 = state(150, [100, 80, 50, 20], 4, queries=1400, hits=550, prompt=1400, generation=650, success=8,
           itl=[0.02] * 10 + [0.03] * 10)
PROFILE = {"engine": "vllm", "vllm": "0.32.0", "target": "/models/x", "batch": 1, "eager": True,
           "t_ms": 20.0, "V_ms": {"1": 21.0, "2": 22.5, "4": 25.0, "8": 33.0}}


@pytest.fixture
def srv():
    s = MetricsServer(metrics_text(**S0))
    yield s
    s.close()


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "vllm-profile.json"
    p.write_text(json.dumps(PROFILE))
    return p


def window(qtbot, tmp_path) -> MainWindow:
    w = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.show()
    return w


def only_gets(srv) -> None:
    assert srv.requests and all(r == ("GET", "/metrics") for r in srv.requests), srv.requests[:5]


def wait_poll(qtbot, w, pred) -> dict:
    """Wait until the watch's latest record satisfies pred; the panels' snapshot then."""
    qtbot.waitUntil(lambda: w.vwatch is not None and w.vwatch.state.latest is not None
                    and pred(w.vwatch.state.latest), timeout=T)
    return w.panel_snapshot()["vllm"]


@pytest.mark.fast
def test_watch_shows_acceptance_alpha_hit_rate_and_the_crossover(qtbot, tmp_path, srv, profile, errors):
    w = window(qtbot, tmp_path)
    try:
        assert w.act_vllm_watch.shortcut().toString() == "Ctrl+Shift+W"
        assert w.watch_vllm(srv.url + "/v1", str(profile), interval=POLL)       # an OpenAI base URL is taken too
        assert w.act_vllm_detach.isEnabled()
        snap = wait_poll(qtbot, w, lambda r: r.poll >= 1)
        assert snap["per_position"] == [0.6, 0.45, 0.3, 0.15] and snap["bars"] == [0.6, 0.45, 0.3, 0.15]
        assert snap["conditional"] == [0.6, 0.75, 0.6667, 0.5]
        assert snap["alpha"] == round(150 / 235, 4) and snap["hit_rate"] == 0.25 and snap["k"] == 4
        assert "watching the vLLM server" in w.msg.text() and "Qwen2.5-0.5B-Instruct" in w.msg.text()
        # the crossover of the profile, the server's k = 4 bold and bounding the band where it pays
        cx = crossover(str(profile))
        assert snap["stars"] == cx.alpha_star
        assert snap["region"] == (round(cx.star(4), 4), 1.05)
        assert sorted(snap["star_lines"]) == sorted(round(v, 4) for k, v in cx.alpha_star.items()
                                                    if v is not None and int(k) <= 4)
        assert "t = 20 ms" in snap["costs"] and "V(4) = 25" in snap["costs"]
        assert f"α*({4}) = {cx.star(4):.3f}: k = 4 pays" in snap["costs"]       # 0.638 is above it
        assert "20.0 ms between tokens" in snap["counts"] and "150 accepted of 400 drafted" in snap["counts"]
        # the counters advance: the next interval's alpha and hit rate
        srv.text = metrics_text(**S1)
        snap = wait_poll(qtbot, w, lambda r: r.total.drafts == 150 and r.delta is not None)
        assert snap["alpha_series"][-1] == round(100 / 145, 4)
        assert snap["hit_series"][-1] == 0.75
        assert snap["per_position"] == [round(100 / 150, 4), round(80 / 150, 4), round(50 / 150, 4),
                                        round(20 / 150, 4)]
        assert snap["hit_rate"] == round(550 / 1400, 4)
        # the address and the profile are remembered
        assert w.settings.vllm_url() == srv.url + "/v1"
        assert w.settings.vllm_profile() == str(profile.resolve())
        assert w.vllm_dock.isVisible() and w.docks["acceptance"] is not None
        w.act_vllm_detach.trigger()
        assert w.vwatch is None and not w.act_vllm_detach.isEnabled()
        n = srv.polls()
        qtbot.wait(int(POLL * 1000 * 4))
        assert srv.polls() == n                                  # detached: no more polls
        assert w.panel_snapshot()["vllm"]["alpha"] == round(
            sum(S1["per_pos"]) / (150 + 100 + 80 + 50), 4)        # the last numbers stay
        only_gets(srv)
        assert not errors
    finally:
        w.shutdown()


def test_a_low_acceptance_is_below_the_crossover(qtbot, tmp_path, srv, profile, errors):
    srv.text = metrics_text(**state(100, [20, 4, 1, 0], 4, queries=10, hits=0))
    w = window(qtbot, tmp_path)
    try:
        assert w.watch_vllm(srv.url, str(profile), interval=POLL)
        snap = wait_poll(qtbot, w, lambda r: r.poll >= 1)
        assert snap["alpha"] < crossover(str(profile)).star(4)
        assert "k = 4 costs more than plain steps" in snap["costs"]
        assert snap["hit_rate"] == 0.0
    finally:
        w.shutdown()
    only_gets(srv)


def test_restart_lost_and_back(qtbot, tmp_path, srv, errors):
    w = window(qtbot, tmp_path)
    try:
        assert w.watch_vllm(srv.url, "", interval=POLL)                 # no profile: no crossover lines
        wait_poll(qtbot, w, lambda r: r.poll >= 1)
        srv.text = metrics_text(**S1)
        snap = wait_poll(qtbot, w, lambda r: r.total.drafts == 150)
        assert snap["stars"] == {} and snap["star_lines"] == [] and "no cost profile" in snap["costs"]
        assert snap["points"] >= 2
        # the server restarts: its counters start again from nothing
        srv.text = metrics_text(**state(4, [3, 2, 1, 0], 4, queries=40, hits=10))
        snap = wait_poll(qtbot, w, lambda r: r.restarted)
        assert snap["restarts"] == 1 and snap["points"] == 1              # fresh series
        assert snap["per_position"] == [0.75, 0.5, 0.25, 0.0] and snap["hit_rate"] == 0.25
        assert "restarted" in w.msg.text()
        srv.text = metrics_text(**state(8, [6, 4, 2, 0], 4, queries=80, hits=30))
        snap = wait_poll(qtbot, w, lambda r: r.total.drafts == 8)
        assert snap["hit_series"][-1] == 0.5 and snap["restarts"] == 1    # a delta after the restart, not across
        # it goes away: the status bar says so, and it keeps trying
        srv.down = True
        qtbot.waitUntil(lambda: "lost the vLLM server" in w.msg.text(), timeout=T)
        assert "503" in w.msg.text() and "trying again" in w.msg.text()
        assert w.vwatch is not None and not errors
        n = srv.polls()
        qtbot.waitUntil(lambda: srv.polls() >= n + 2, timeout=T)          # retrying
        srv.down = False
        qtbot.waitUntil(lambda: "answers again" in w.msg.text(), timeout=T)
        w.unwatch_vllm()
        assert w.vwatch is None and "detached" in w.msg.text()
    finally:
        w.shutdown()
    with srv.lock:
        assert all(m == "GET" for m, _ in srv.requests) and all(p == "/metrics" for _, p in srv.requests)


def test_a_url_that_does_not_answer_is_one_line_and_nothing_is_watched(qtbot, tmp_path, errors):
    w = window(qtbot, tmp_path)
    with socket.socket() as s:                                 # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        with qtbot.waitSignal(w.errorShown, timeout=T) as sig:
            assert w.watch_vllm(f"127.0.0.1:{port}", "", interval=POLL)
        assert sig.args[0].startswith(f"cannot watch http://127.0.0.1:{port}/metrics")
        assert "\n" not in sig.args[0] and errors == [sig.args[0]]
        assert w.vwatch is None and not w.act_vllm_detach.isEnabled()
        # a bad address: at once, nothing started
        assert not w.watch_vllm("ftp://somewhere", "") and w.errors[-1].startswith("only http://")
        assert w.vwatch is None
    finally:
        w.shutdown()


def test_a_server_that_is_not_vllm_is_refused(qtbot, tmp_path, errors):
    other = MetricsServer("# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines 9\n")
    w = window(qtbot, tmp_path)
    try:
        with qtbot.waitSignal(w.errorShown, timeout=T) as sig:
            assert w.watch_vllm(other.url, "", interval=POLL)
        assert "no vllm: metrics" in sig.args[0] and w.vwatch is None
    finally:
        w.shutdown()
        other.close()
    assert other.requests == [("GET", "/metrics")]


def test_the_remembered_profile_is_used_again(qtbot, tmp_path, srv, profile, errors):
    w = window(qtbot, tmp_path)
    try:
        assert w.watch_vllm(srv.url, str(profile), interval=POLL)
        wait_poll(qtbot, w, lambda r: r.poll >= 1)
    finally:
        w.shutdown()
    w2 = window(qtbot, tmp_path)                                # the same settings file
    try:
        assert w2.settings.vllm_url() == srv.url
        assert w2.watch_vllm(srv.url, interval=POLL)             # profile None: the remembered one
        snap = wait_poll(qtbot, w2, lambda r: r.poll >= 1)
        assert snap["stars"] == crossover(str(profile)).alpha_star and snap["region"][0] < 1.0
        # a file that is not a profile: a dialog, the watch goes on without changing the crossover
        bad = tmp_path / "bad.json"
        bad.write_text("[1, 2]")
        from app.vllm_watch import choose_profile

        assert not choose_profile(w2, str(bad)) and "not a vLLM cost profile" in errors[-1]
        assert w2.vwatch is not None and w2.vwatch.state.crossover is not None
    finally:
        w2.shutdown()
    only_gets(srv)


def test_command_line_watch_and_screenshot(tmp_path, monkeypatch, srv, profile):
    """`rakv-explorer --watch-vllm URL --vllm-profile FILE --screenshot PNG --exit-after-run` (what
    scripts/vllm_watch_shot.sh runs against a real vLLM): the shot after the fifth poll."""
    import sys

    import torch

    from app import main as app_main

    monkeypatch.setenv("RAKV_SETTINGS", str(tmp_path / "s.ini"))
    monkeypatch.setenv("RAKV_SESSIONS", str(tmp_path / "sessions"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr("app.vllm_watch.POLL_S", 0.2)
    threads = torch.get_num_threads()
    png = tmp_path / "vllm.png"
    try:
        rc = app_main.main(["--watch-vllm", srv.url, "--vllm-profile", str(profile), "--screenshot", str(png),
                            "--exit-after-run"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0 and png.stat().st_size > 10_000
    assert srv.polls() >= 5
    only_gets(srv)
