"""Icons from resources/icons (SVG), with the style's standard icons as a fallback."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QStyle

ICON_DIR = Path(__file__).resolve().parent.parent / "resources" / "icons"
_FALLBACK = {
    "run": QStyle.StandardPixmap.SP_MediaPlay,
    "stop": QStyle.StandardPixmap.SP_MediaStop,
    "open": QStyle.StandardPixmap.SP_DialogOpenButton,
    "export": QStyle.StandardPixmap.SP_DialogSaveButton,
    "measure": QStyle.StandardPixmap.SP_FileDialogDetailedView,
    "app": QStyle.StandardPixmap.SP_ComputerIcon,
}


def icon(name: str) -> QIcon:
    p = ICON_DIR / f"{name}.svg"
    if p.is_file():
        ic = QIcon(str(p))
        if not ic.isNull():
            return ic
    app = QApplication.instance()
    if app is not None and name in _FALLBACK:
        return app.style().standardIcon(_FALLBACK[name])
    return QIcon()
