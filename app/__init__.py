"""RAKV Explorer desktop GUI (PySide6 + pyqtgraph) over the Qt-free ``rakv`` engine."""

from rakv import __version__  # noqa: F401
