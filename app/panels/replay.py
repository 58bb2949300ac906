"""Replay bar: play / pause, step, speed, scrubber."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QSlider, QWidget

SPEEDS = [("0.25x", 0.25), ("0.5x", 0.5), ("1x", 1.0), ("2x", 2.0), ("4x", 4.0), ("10x", 10.0), ("max", 0.0)]


class ReplayBar(QWidget):
    closeRequested = Signal()

    def __init__(self):
        super().__init__()
        self.replayer = None
        self.name = QLabel("")
        self.name.setStyleSheet("font-weight: 600;")
        self.play = QPushButton("Play")
        self.play.setToolTip("play / pause (Space)")
        self.step = QPushButton("Step")
        self.step.setToolTip("apply the next record")
        self.speed = QComboBox()
        for label, v in SPEEDS:
            self.speed.addItem(label, v)
        self.speed.setToolTip("replay speed (max = as fast as the redraw allows)")
        self.scrub = QSlider(Qt.Orientation.Horizontal)
        self.scrub.setToolTip("scrub through the recording (records)")
        self.pos = QLabel("0 / 0")
        self.pos.setMinimumWidth(90)
        self.close = QPushButton("Back to live")
        self.close.setToolTip("leave the replay and show the live session")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 2, 6, 2)
        lay.addWidget(QLabel("Replay"))
        lay.addWidget(self.name)
        lay.addWidget(self.play)
        lay.addWidget(self.step)
        lay.addWidget(self.speed)
        lay.addWidget(self.scrub, 1)
        lay.addWidget(self.pos)
        lay.addWidget(self.close)
        self.play.clicked.connect(lambda: self.replayer and self.replayer.toggle())
        self.step.clicked.connect(lambda: self.replayer and self.replayer.step())
        self.speed.currentIndexChanged.connect(self._speed)
        self.scrub.valueChanged.connect(self._scrubbed)
        self.close.clicked.connect(self.closeRequested)
        self._quiet = False

    def attach(self, replayer, name: str, speed_label: str = "2x") -> None:
        self.replayer = replayer
        self.name.setText(name)
        self._quiet = True
        self.scrub.setRange(0, replayer.total)
        self.scrub.setValue(0)
        self._quiet = False
        i = self.speed.findText(speed_label)
        self.speed.setCurrentIndex(i if i >= 0 else 3)
        self._speed()
        replayer.positionChanged.connect(self._moved)
        replayer.playingChanged.connect(lambda p: self.play.setText("Pause" if p else "Play"))
        self._moved(replayer.pos)

    def _speed(self, _=None) -> None:
        if self.replayer is not None:
            self.replayer.set_speed(self.speed.currentData())

    def _moved(self, n: int) -> None:
        self._quiet = True
        self.scrub.setValue(n)
        self._quiet = False
        r = self.replayer
        self.pos.setText(f"{n} / {r.total}" if r else "")

    def _scrubbed(self, n: int) -> None:
        if not self._quiet and self.replayer is not None:
            self.replayer.seek(n)
