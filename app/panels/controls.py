"""Live controls (act on the engine's next decision): memory budget, K set, force (r, k),
decision granularity, and sampling (temperature, top-k, top-p, min-p, seed, verification mode)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGridLayout, QHBoxLayout,
                               QLabel, QLineEdit, QSlider, QSpinBox, QVBoxLayout, QWidget)

from rakv.config import DEFAULT_K_SET, parse_k_set
from rakv.config import Sampling, problem

T_MAX = 2.0          # the temperature slider's range, in steps of T_STEP
T_STEP = 0.05

K_CHOICES = (0, 1, 2, 4, 6, 8)
BUDGET_MAX_MIB = 4096


def share_box(top: float, step: float, prefix: str, tip: str) -> QDoubleSpinBox:
    """A spin box for a share in [0, top], two decimals."""
    b = QDoubleSpinBox()
    b.setRange(0.0, top)
    b.setSingleStep(step)
    b.setDecimals(2)
    b.setPrefix(prefix)
    b.setToolTip(tip)
    return b


class ControlsPanel(QWidget):
    budgetChanged = Signal(float)       # MiB
    kSetChanged = Signal(tuple)
    forceChanged = Signal(object)       # (r, k) or None
    granularityChanged = Signal(str)
    samplingChanged = Signal(object)    # rakv.config.Sampling (valid), for the next request

    def __init__(self):
        super().__init__()
        # budget
        self.budget = QSlider(Qt.Orientation.Horizontal)
        self.budget.setRange(0, BUDGET_MAX_MIB)
        self.budget.setSingleStep(16)
        self.budget.setPageStep(256)
        self.budget.setTracking(False)          # valueChanged on release / keyboard, not per pixel
        self.budget.setToolTip("prefix-cache memory budget (LRU eviction); applied before the next request")
        self.budget_label = QLabel()
        self.budget_label.setMinimumWidth(70)
        self.budget.sliderMoved.connect(self._show_budget)
        self.budget.valueChanged.connect(self._budget_changed)
        # K set
        self.k_boxes: dict[int, QCheckBox] = {}
        kgrid = QGridLayout()
        kgrid.setSpacing(4)
        for i, k in enumerate(K_CHOICES):
            cb = QCheckBox(str(k))
            cb.setToolTip(f"allow k={k} drafts" + (" (no speculation)" if k == 0 else ""))
            cb.toggled.connect(self._k_toggled)
            self.k_boxes[k] = cb
            kgrid.addWidget(cb, 0, i)
        self.k_custom = QLineEdit()
        self.k_custom.setPlaceholderText("custom set, e.g. 0,3,5,12 (overrides the boxes)")
        self.k_custom.editingFinished.connect(self._k_custom)
        self.k_error = QLabel("")
        self.k_error.setStyleSheet("color: #b00;")
        # force
        self.force_on = QCheckBox("force")
        self.force_r = QComboBox()
        self.force_r.addItems(["r=0", "r=1"])
        self.force_k = QSpinBox()
        self.force_k.setRange(0, 64)
        self.force_k.setPrefix("k=")
        for w in (self.force_on,):
            w.toggled.connect(self._force)
        self.force_r.currentIndexChanged.connect(lambda _: self._force())
        self.force_k.valueChanged.connect(lambda _: self._force())
        frow = QHBoxLayout()
        frow.addWidget(self.force_on)
        frow.addWidget(self.force_r)
        frow.addWidget(self.force_k)
        frow.addStretch(1)
        # granularity
        self.granularity = QComboBox()
        self.granularity.addItem("per round (re-decide k)", "round")
        self.granularity.addItem("per request (paper)", "request")
        self.granularity.currentIndexChanged.connect(
            lambda _: self.granularityChanged.emit(self.granularity.currentData()))

        srow = self._sampling_controls()

        brow = QHBoxLayout()
        brow.addWidget(self.budget, 1)
        brow.addWidget(self.budget_label)
        form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        form.addRow("Budget", brow)
        kbox = QVBoxLayout()
        kbox.addLayout(kgrid)
        kbox.addWidget(self.k_custom)
        kbox.addWidget(self.k_error)
        form.addRow("K", kbox)
        form.addRow("Action", frow)
        form.addRow("Decide", self.granularity)
        form.addRow("Sampling", srow)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(form)
        lay.addStretch(1)
        self._quiet = False
        self.set_values(512, DEFAULT_K_SET, "round")

    # ------------------------------------------------------------------ values
    def set_values(self, budget_mib: int, k_set, granularity: str) -> None:
        self._quiet = True
        try:
            self.budget.setValue(int(budget_mib))
            self._show_budget(int(budget_mib))
            ks = tuple(k_set)
            if all(k in K_CHOICES for k in ks):
                for k, cb in self.k_boxes.items():
                    cb.setChecked(k in ks)
                self.k_custom.clear()
            else:
                self.k_custom.setText(",".join(map(str, ks)))
            i = self.granularity.findData(granularity)
            self.granularity.setCurrentIndex(max(0, i))
        finally:
            self._quiet = False

    def budget_mib(self) -> int:
        return self.budget.value()

    def k_set(self) -> tuple[int, ...]:
        text = self.k_custom.text().strip()
        if text:
            try:
                return parse_k_set(text)
            except ValueError:
                pass
        ks = tuple(k for k, cb in self.k_boxes.items() if cb.isChecked())
        return ks or (0,)

    def force(self):
        return (self.force_r.currentIndex(), self.force_k.value()) if self.force_on.isChecked() else None

    # ------------------------------------------------------------------ slots
    def _show_budget(self, v: int) -> None:
        self.budget_label.setText(f"{v} MiB")

    def _budget_changed(self, v: int) -> None:
        self._show_budget(v)
        if not self._quiet:
            self.budgetChanged.emit(float(v))

    def _k_toggled(self, _=None) -> None:
        if self._quiet or self.k_custom.text().strip():
            return
        self.kSetChanged.emit(self.k_set())

    def _k_custom(self) -> None:
        text = self.k_custom.text().strip()
        if not text:
            self.k_error.setText("")
            self.kSetChanged.emit(self.k_set())
            return
        try:
            ks = parse_k_set(text)
        except ValueError as e:
            self.k_error.setText(str(e).replace("--k-set", "K"))
            return
        self.k_error.setText("")
        self.kSetChanged.emit(ks)

    def _force(self, _=None) -> None:
        if not self._quiet:
            self.forceChanged.emit(self.force())

    # ------------------------------------------------------------------ sampling
    def _sampling_controls(self) -> QVBoxLayout:
        """Temperature slider (0 = greedy), top-k, top-p, min-p, seed (blank: drawn and recorded),
        verification mode; a bad combination shows its one-line reason instead of applying."""
        self.temperature = QSlider(Qt.Orientation.Horizontal)
        self.temperature.setRange(0, int(round(T_MAX / T_STEP)))
        self.temperature.setToolTip("temperature; 0 is greedy decoding (applies to the next request)")
        self.t_label = QLabel("greedy")
        self.t_label.setMinimumWidth(60)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100000)
        self.top_k.setPrefix("top-k ")
        self.top_k.setToolTip("keep the k likeliest tokens (0: off)")
        self.top_p = share_box(1.0, 0.05, "top-p ",
                               "nucleus: the smallest set of tokens with this much probability (1: off)")
        self.min_p = share_box(0.99, 0.01, "min-p ", "drop tokens below this share of the likeliest one (0: off)")
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("seed (blank: drawn, recorded)")
        self.seed.setToolTip("request i samples with seed + i; every policy gives the same tokens for a seed")
        self.verify = QComboBox()
        self.verify.addItem("seeded (same tokens as the target alone)", "seeded")
        self.verify.addItem("rejection (same distribution)", "rejection")
        self.sampling_error = QLabel("")
        self.sampling_error.setStyleSheet("color: #b00;")
        self.sampling_error.setWordWrap(True)
        self.temperature.valueChanged.connect(self._sampling_edited)
        for w in (self.top_k, self.top_p, self.min_p):
            w.valueChanged.connect(self._sampling_edited)
        self.seed.editingFinished.connect(self._sampling_edited)
        self.verify.currentIndexChanged.connect(self._sampling_edited)
        t_row = QHBoxLayout()
        t_row.addWidget(self.temperature, 1)
        t_row.addWidget(self.t_label)
        f_row = QGridLayout()              # two a row: the left dock stays readable in an 837 px window
        for i, w in enumerate((self.top_k, self.top_p, self.min_p)):
            f_row.addWidget(w, i // 2, i % 2)
        self.verify.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.verify.setMinimumContentsLength(14)
        v_row = QVBoxLayout()              # one under the other: the left dock stays narrow
        v_row.addWidget(self.seed)
        v_row.addWidget(self.verify)
        box = QVBoxLayout()
        for row in (t_row, f_row, v_row):
            box.addLayout(row)
        box.addWidget(self.sampling_error)
        self.set_sampling(Sampling())
        return box

    def sampling(self) -> Sampling | str:
        """The Sampling the controls show, or the one-line reason it is not valid."""
        text = self.seed.text().strip()
        try:
            seed = int(text) if text else None
        except ValueError:
            return f"seed must be an integer, got {text!r}"
        s = Sampling(temperature=round(self.temperature.value() * T_STEP, 4), top_k=self.top_k.value(),
                     top_p=round(self.top_p.value(), 4), min_p=round(self.min_p.value(), 4), seed=seed,
                     verify=self.verify.currentData())
        return problem(s) or s

    def set_sampling(self, s: Sampling) -> None:
        self._quiet = True
        try:
            self.temperature.setValue(int(round(s.temperature / T_STEP)))
            self.top_k.setValue(int(s.top_k))
            self.top_p.setValue(float(s.top_p))
            self.min_p.setValue(float(s.min_p))
            self.seed.setText("" if s.seed is None else str(s.seed))
            self.verify.setCurrentIndex(max(0, self.verify.findData(s.verify)))
            self._show_temperature()
        finally:
            self._quiet = False

    def _show_temperature(self) -> None:
        t = self.temperature.value() * T_STEP
        self.t_label.setText("greedy" if t == 0 else f"T = {t:.2f}")
        for w in (self.top_k, self.top_p, self.min_p, self.verify):
            w.setEnabled(t > 0)

    def _sampling_edited(self, _=None) -> None:
        self._show_temperature()
        s = self.sampling()
        self.sampling_error.setText(s if isinstance(s, str) else "")
        if not self._quiet and not isinstance(s, str):
            self.samplingChanged.emit(s)

