"""Fixtures of the explorer's tests (tests/gui/); the models are in tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def errors(monkeypatch):
    """Capture error dialogs instead of showing them: the texts, in order."""
    from PySide6.QtWidgets import QMessageBox

    shown = []
    monkeypatch.setattr(QMessageBox, "open", lambda self: shown.append(self.text()))
    return shown
