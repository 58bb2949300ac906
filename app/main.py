"""``rakv-explorer``: the GUI entry point, with a scripted mode for demos, screenshots and CI.

    rakv-explorer [--target M] [--draft M] [--prompt TEXT --autorun [--conversation]] [--replay FILE]
                  [--screenshot PNG] [--exit-after-run] [--policy P] [--max-new-tokens N]
                  [--k-set 0,2,4] [--measure-all [--measure-prompt TEXT] [--repeats R]]
                  [--device auto|cpu|cuda|mps] [--no-fast] [--attach URL]
                  [--watch-vllm URL [--vllm-profile FILE]]
"""

from __future__ import annotations

import argparse
import os
import sys

# rakv is imported inside the functions: it imports torch (seconds), and the splash screen comes first


def build_parser() -> argparse.ArgumentParser:
    from rakv import argtypes as A
    from rakv.common import add_device_args, add_sampling_args
    from rakv.config import POLICIES_HELP

    ap = A.OneLineParser(prog="rakv-explorer",
                                 description="Watch and steer exact speculative decoding with prefix KV reuse.")
    ap.add_argument("--target", help="hub id, local dir, .gguf file, or 'demo'")
    ap.add_argument("--draft", help="model (same forms), 'int8', 'ngram' or 'none'")
    ap.add_argument("--numerics", choices=("auto", "q8", "fp32"), default=None,
                    help="the linears' arithmetic (default auto: q8 for a GGUF-backed model)")
    ap.add_argument("--prompt", action="append",
                    help="prompt text for the editor (repeatable: --autorun runs them in order, one engine)")
    ap.add_argument("--autorun", action="store_true", help="run the prompt(s) at start")
    ap.add_argument("--conversation", action=argparse.BooleanOptionalAction, default=None,
                    help="conversation mode: each prompt is the next turn of one conversation "
                         "(--no-conversation: separate requests; default: as last time)")
    ap.add_argument("--policy", type=A.policy, help=POLICIES_HELP)
    ap.add_argument("--max-new-tokens", type=A.int_range(1, 4096))
    ap.add_argument("--raw", action=argparse.BooleanOptionalAction, default=None,
                    help="prompts as they are, no chat template (--no-raw: through the template; "
                         "default: as last time)")
    ap.add_argument("--k-set", help="allowed k, e.g. 0,2,4 (the K control)")
    add_sampling_args(ap)       # given: the sampling controls start there; else as last time
    ap.add_argument("--measure-all", action="store_true",
                    help="after the autorun prompts (if any): Measure every action on the prompt")
    ap.add_argument("--measure-prompt", metavar="TEXT",
                    help="the prompt --measure-all measures (default: the last --prompt)")
    ap.add_argument("--repeats", type=A.int_range(1, 20), default=3,
                    help="--measure-all: timed runs per action (default 3)")
    ap.add_argument("--replay", metavar="FILE", help="replay a JSONL recording at start")
    ap.add_argument("--attach", metavar="URL", type=attach_url,
                    help="show a running `rakv serve`'s requests live, read-only (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--watch-vllm", metavar="URL",
                    help="poll a vLLM server's /metrics, read-only (e.g. http://127.0.0.1:8000; with --screenshot: "
                         "taken after the fifth poll)")
    ap.add_argument("--vllm-profile", metavar="FILE",
                    help="--watch-vllm: a vLLM cost profile (rakv calibrate --engine vllm) for the crossover alpha*(k)")
    ap.add_argument("--screenshot", metavar="PNG", help="save the window after the run / replay")
    ap.add_argument("--exit-after-run", action="store_true", help="quit after the run / replay (and screenshot)")
    ap.add_argument("--threads", type=A.threads,
                    help=f"torch threads, 1 to {A.max_threads()} (default: torch's choice, as the CLI: one cost profile for both)")
    ap.add_argument("--size", default=None, type=window_size, help="window size WxH (e.g. 1500x940)")
    add_device_args(ap)
    return ap


def window_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH like 1500x940, got {text!r}") from None
    if not (200 <= w <= 20000 and 200 <= h <= 20000):
        raise argparse.ArgumentTypeError(f"width and height must be 200 to 20000, got {text!r}")
    return w, h


window_size.__name__ = "size"


def show_splash(app):
    """The splash screen shown while torch, the engine and the window load."""
    from PySide6.QtGui import QColor, QPainter, QPixmap
    from PySide6.QtWidgets import QSplashScreen

    from app import icons

    pm = QPixmap(420, 150)
    pm.fill(QColor("#f4f6fa"))
    p = QPainter(pm)
    p.drawPixmap(20, 35, icons.icon("app").pixmap(80, 80))
    f = p.font()
    f.setPointSize(f.pointSize() + 6)
    f.setBold(True)
    p.setFont(f)
    p.drawText(120, 70, "RAKV Explorer")
    p.end()
    splash = QSplashScreen(pm)
    splash.show()
    splash_say(splash, app, "starting the engine (torch) ...")
    return splash


def splash_say(splash, app, text: str) -> None:
    if splash is None:
        return
    from PySide6.QtCore import Qt

    splash.showMessage(text, Qt.AlignmentFlag.AlignBottom | Qt.AlignmentFlag.AlignHCenter)
    app.processEvents()


def attach_url(text: str) -> str:
    from rakv.serve.api import server_url

    try:
        return server_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


attach_url.__name__ = "URL"


def check_paths(args) -> None:
    """The screenshot must not overwrite the recording being replayed; prompt text on the command
    line must be valid Unicode (the one rule, rakv.util.text_in: refused, not replaced)."""
    from rakv import argtypes as A
    from rakv.util.text_in import checked_text

    for flag in ("prompt", "measure_prompt"):
        for i, text in enumerate(_listed(getattr(args, flag, None))):
            checked_text(text, "--" + flag.replace("_", "-"))
    if args.screenshot and args.replay:
        A.refuse_overwrite(args.screenshot, "--screenshot", {"--replay": args.replay})


def _listed(v) -> list:
    return [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    splash = early_splash(argv)       # before torch is imported: the window takes seconds to come up
    try:
        return run_main(argv, splash)
    finally:
        if splash is not None:
            splash.close()


def early_splash(argv: list[str]):
    """A splash screen at once for an interactive start on a desktop that can show it (None in
    scripted mode, offscreen, for --help, or where the desktop checks would refuse to start)."""
    scripted = {"--screenshot", "--exit-after-run", "-h", "--help"}
    if any(a.split("=")[0] in scripted for a in argv) or os.environ.get("QT_QPA_PLATFORM", "").strip():
        return None
    from app.desktop import check, no_display, x_server_problem

    if no_display() or x_server_problem() or check():
        return None                   # (said in one line after the flags are checked)
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0]])
    return show_splash(app)


def run_main(argv: list[str], splash) -> int:
    from rakv.common import CliError, quiet_libs, sampling_of
    from rakv.config import Sampling

    try:     # every flag is checked here, before anything is shown or saved to the settings
        args = build_parser().parse_args(argv)
        check_paths(args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except ValueError as e:
        print(f"rakv-explorer: error: {e}", file=sys.stderr)
        return 2
    try:
        sampling = sampling_of(args)
    except CliError as e:
        print(f"rakv-explorer: error: {e}", file=sys.stderr)
        return 2
    sampling_given = sampling != Sampling()
    k_set = None
    if args.k_set:
        from rakv.config import parse_k_set

        try:
            k_set = parse_k_set(args.k_set)
        except ValueError as e:
            print(f"rakv-explorer: error: {e}", file=sys.stderr)
            return 2
    from rakv.util.device import DeviceError, resolve

    try:
        device = resolve(args.device)
    except DeviceError as e:
        print(f"rakv-explorer: error: {e}", file=sys.stderr)
        return 2
    from app.desktop import check, no_display, x_server_problem

    problem = no_display() or check()      # before Qt: its own failure here is an abort
    if problem:
        print(f"rakv-explorer: error: {problem}", file=sys.stderr)
        return 1
    problem = x_server_problem()           # a DISPLAY no X server answers: Qt would abort naming its plugin
    if problem:
        print(f"rakv-explorer: error: {problem}", file=sys.stderr)
        return 2

    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("RAKV Explorer")
    app.setOrganizationName("RAKV")
    quiet_libs()
    import torch

    # the CLI's thread count (torch's default) unless told, so both share one cost profile; a shorter
    # GIL switch interval keeps the event loop responsive
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.setswitchinterval(0.002)
    splash_say(splash, app, "building the window ...")
    from app.window import MainWindow

    win = MainWindow()
    win.worker.device, win.worker.fast = device, args.fast
    win.worker.threads = args.threads
    rp = win.run_panel
    if args.numerics:
        rp.numerics.setCurrentText(args.numerics)
        win.worker.numerics = args.numerics
    if args.target or args.draft:       # a restored draft that does not fit --target gives way (one notice)
        win.set_command_line_pair(args.target, args.draft)
    prompts = list(args.prompt or [])
    if prompts:
        rp.prompt.setPlainText(prompts[0])
    if args.policy:
        rp.policy.setCurrentText(args.policy)
    if args.max_new_tokens:
        rp.max_new.setValue(args.max_new_tokens)
    if args.raw is not None:
        rp.raw.setChecked(args.raw)
    if args.conversation is not None:
        rp.conversation.setChecked(args.conversation)
    if k_set is not None:
        win.controls.set_values(win.controls.budget_mib(), k_set, win.controls.granularity.currentData())
        win.worker.set_controls(k_set=k_set)
    if sampling_given:
        win.controls.set_sampling(sampling)
        win.worker.set_controls(sampling=sampling)
    if args.size:
        win.resize(*args.size)
        if win.settings.geometry()[1] is None:     # no saved dock layout: lay the docks out for this size
            win.default_docks()
    sys.excepthook = win.excepthook
    win.show()
    if splash is not None:
        splash.finish(win)

    scripted = bool(args.autorun or args.replay or args.screenshot or args.exit_after_run or args.measure_all)
    rc = {"code": 0}

    def done(*_):
        win.redraw()
        QTimer.singleShot(400, finish)

    def finish():
        win.redraw()
        app.processEvents()
        if args.screenshot:
            os.makedirs(os.path.dirname(os.path.abspath(args.screenshot)), exist_ok=True)
            ok = win.grab().save(args.screenshot)
            print(f"rakv-explorer: screenshot {'saved to' if ok else 'FAILED:'} {args.screenshot}", file=sys.stderr)
            if not ok:
                rc["code"] = 1
        if args.exit_after_run:
            win.close()
            app.quit()

    def measure():
        if args.measure_prompt:
            rp.prompt.setPlainText(args.measure_prompt)
        win.measureFinished.connect(done)
        win.measure_all(args.repeats)

    def on_error(msg: str):
        rc["code"] = 1
        if args.exit_after_run and not win.running:
            QTimer.singleShot(0, finish)

    win.errorShown.connect(on_error)
    if args.attach:
        QTimer.singleShot(0, lambda: win.attach_server(args.attach))
    if args.watch_vllm:
        def start_watch():
            if not win.watch_vllm(args.watch_vllm, args.vllm_profile or ""):
                return
            if (args.screenshot or args.exit_after_run) and not (args.replay or args.autorun or args.measure_all):
                fired = []

                def polled(rec):
                    if rec.poll >= 5 and not fired:
                        fired.append(1)
                        done()
                win.vwatch.applied.connect(polled)
        QTimer.singleShot(0, start_watch)
    if args.replay:
        def start_replay():
            if not win.open_recording(args.replay, play=False):
                return
            win.replayFinished.connect(done)
            if args.exit_after_run or args.screenshot:     # scripted: to the end at once
                win.replay_bar.speed.setCurrentText("max")
            win.replayer.play()                            # else at the replay speed (never max at start)
        QTimer.singleShot(0, start_replay)
    elif args.autorun:
        queue = prompts[1:]

        def next_or_done(end):
            if end is not None and queue:
                rp.prompt.setPlainText(queue.pop(0))
                QTimer.singleShot(0, win.run)
            elif end is not None and args.measure_all:
                QTimer.singleShot(0, measure)
            else:
                done()
        win.runFinished.connect(next_or_done)
        QTimer.singleShot(0, win.run)
    elif args.measure_all:
        QTimer.singleShot(0, measure)
    elif (args.screenshot or args.exit_after_run) and not args.watch_vllm:
        QTimer.singleShot(800, done)
    code = app.exec()
    # closing the last window posted a Quit event that this loop never handled: left queued, it would
    # end the next event loop this process runs (an embedding application, the next test) at once
    from PySide6.QtCore import QCoreApplication, QEvent

    QCoreApplication.removePostedEvents(app, QEvent.Type.Quit)
    if scripted:
        print(f"rakv-explorer: {win.lag.report()}; slowest redraw {win.redraw_ms_max:.1f} ms", file=sys.stderr)
    return rc["code"] or code


if __name__ == "__main__":
    sys.exit(main())
