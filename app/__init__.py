"""RAKV Explorer desktop GUI (PySide6 + pyqtgraph) over the Qt-free ``rakv`` engine."""

from rakv import __version__  # noqa: F401

from app.noneguard import pin_none as _pin_none

_pin_none()       # PySide6's None reference leak on CPython 3.11 (app/noneguard.py)
