"""The main window's exports: the session's timings as CSV, the latest answer to the clipboard, the
transcript as Markdown or JSON, the plots as PNG (``MainWindow.export_csv`` and the others call these)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QApplication, QFileDialog


def export_csv(win, path: str | None = None) -> int | None:
    from rakv.records import write_csv

    if path is None:
        path, _ = QFileDialog.getSaveFileName(win, "Export session timings", "session.csv", "CSV (*.csv)")
        if not path:
            return None
    from rakv.records import OracleResult, oracle_csv_path, write_oracle_csv

    extra = ""
    try:
        n = write_csv(win.state.records, path)
        if any(isinstance(r, OracleResult) for r in win.state.records):
            op = oracle_csv_path(path)
            m = write_oracle_csv(win.state.records, op)
            extra = f", {m} measured-action rows to {op}"
    except OSError as e:
        win.show_error("Cannot write CSV", str(e))
        return None
    win.msg.setText(f"wrote {n} request rows to {path}{extra}")
    return n


def copy_answer(win) -> str | None:
    """The latest answer of the shown session to the clipboard (plain text)."""
    from app.transcript import last_answer

    text = last_answer(win.state.exchanges, win.tokens.pieces)
    if text is None:
        win.msg.setText("no answer to copy yet")
        return None
    QApplication.clipboard().setText(text)
    win.msg.setText(f"copied the answer of request {win.state.exchanges[-1].request_id} ({len(text)} characters)")
    return text


def export_conversation(win, path: str | None = None) -> str | None:
    """The transcript of the shown session as Markdown (.md) or JSON (.json; other names: by the
    filter picked), written atomically; with *Show template* ticked, the prompts as fed."""
    from app.transcript import to_json, to_markdown
    from rakv.util.paths import write_atomic

    if not win.state.exchanges:
        win.show_error("Nothing to export", "the session has no request yet")
        return None
    if path is None:
        path, flt = QFileDialog.getSaveFileName(win, "Export conversation", "conversation.md",
                                                "Markdown (*.md);;JSON (*.json)")
        if not path:
            return None
        if not Path(path).suffix:
            path += ".json" if flt.startswith("JSON") else ".md"
    h = win.state.header
    meta = {"models": {"target": (h.target or {}).get("name", ""), "draft": (h.draft or {}).get("name", "")}
            if h is not None else {}}
    tpl = win.chat.show_template.isChecked()
    fmt = to_json if Path(path).suffix.lower() == ".json" else to_markdown
    try:
        write_atomic(Path(path), fmt(win.state.exchanges, win.tokens.pieces, meta, tpl))
    except OSError as e:
        win.show_error("Cannot export the conversation", f"{path}: {e.strerror or e}")
        return None
    win.msg.setText(f"exported {len(win.state.exchanges)} requests to {path}")
    return str(path)


def export_plots(win, folder: str | None = None) -> list[str]:
    import pyqtgraph.exporters as pex

    if folder is None:
        folder = QFileDialog.getExistingDirectory(win, "Export plots to folder")
        if not folder:
            return []
    out = []
    win.redraw()
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, panel in (("cache", win.cache), ("costs", win.costs), ("acceptance", win.acceptance),
                        ("timeline", win.timeline)):
        p = str(Path(folder) / f"rakv-{name}.png")
        try:
            ex = pex.ImageExporter(panel.plot.getPlotItem())
            ex.parameters()["width"] = max(800, int(panel.plot.width() * 2))
            ex.export(p)
            if not Path(p).is_file():
                raise OSError("nothing was written")
            out.append(p)
        except Exception as e:  # noqa: BLE001
            win.show_error("Cannot export plot", f"{p}: {e}")
            break
    win.msg.setText(f"exported {len(out)} plots to {folder}")
    return out
