"""The main window's layout: the left docks' forms (as wide as their controls need, scrolling
vertically only), the docks' first sizes in proportion to the window, and the window's size on
the screen.

A narrow window (the 837 x 760 the explorer opens with offscreen and for ``--screenshot``) gives
the left docks their forms' width first: the central tabs and the plots give way, never a label
or button of the model pickers, Run or the live controls (tests/test_gui_first_screen.py).
"""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QApplication, QFrame, QScrollArea, QWidget

LEFT, RIGHT = 0.26, 0.28         # the side docks' share of the window's width (where it has room)


class FormScroll(QScrollArea):
    """A form in a dock: it scrolls vertically, never sideways, and asks for its form's minimum
    width (plus a vertical scroll bar's), so the dock area cannot squeeze it below that."""

    def __init__(self, form: QWidget):
        super().__init__()
        self.setWidget(form)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    def form_width(self) -> int:
        """The width the form needs, with room for the vertical scroll bar whether it shows or not."""
        w = self.widget()
        need = max(w.minimumSizeHint().width(), w.minimumWidth()) if w is not None else 0
        return need + self.verticalScrollBar().sizeHint().width() + 2 * self.frameWidth()

    def minimumSizeHint(self) -> QSize:
        s = super().minimumSizeHint()
        return QSize(max(s.width(), self.form_width()), s.height())

    def sizeHint(self) -> QSize:
        s = super().sizeHint()
        return QSize(max(s.width(), self.form_width()), s.height())


def default_docks(win) -> None:
    """The docks' first layout, in proportion to the window (left, right, bottom); the left docks
    never narrower than their forms need (the centre gives way)."""
    W, H = max(800, win.width()), max(500, win.height())
    Hz, V = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
    docks = win.docks
    left = max(int(W * LEFT), *(docks[n].minimumSizeHint().width() for n in ("run", "controls")))
    win.resizeDocks([docks["run"], docks["cache"]], [left, int(W * RIGHT)], Hz)
    win.resizeDocks([docks["acceptance"], docks["timeline"]], [1, 1], Hz)
    win.resizeDocks([docks["acceptance"]], [int(H * 0.36)], V)
    win.resizeDocks([docks["run"], docks["controls"]], [int(H * 0.7), int(H * 0.3)], V)
    win.resizeDocks([docks["cache"], docks["costs"]], [int(H * 0.5), int(H * 0.5)], V)


def screen_rect(win) -> tuple[int, int, int, int] | None:
    scr = win.screen() or QApplication.primaryScreen()
    if scr is None:
        return None
    r = scr.availableGeometry()
    return r.x(), r.y(), r.width(), r.height()


def fits_screen(win) -> bool:
    from app.desktop import on_screen

    scr = screen_rect(win)
    g = win.geometry()
    return scr is None or on_screen((g.x(), g.y(), g.width(), g.height()), scr)


def fit_to_screen(win) -> None:
    """The first window (or a saved one that no longer fits): as large as the default where the
    screen has room, else the screen less room for a frame, centred."""
    from app.desktop import DEFAULT_SIZE, fit

    scr = screen_rect(win)
    if scr is None:
        win.resize(*DEFAULT_SIZE)
        return
    x, y, w, h = fit(scr)
    win.setGeometry(x, y, w, h)
