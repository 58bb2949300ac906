"""Model pair picker, prompt editor, policy, max new tokens, Run / Stop."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QMenu,
                               QPlainTextEdit, QPushButton, QSizePolicy, QSpinBox, QToolButton, QVBoxLayout,
                               QWidget)

from rakv.config import POLICIES_HELP, Policy
from rakv.load.presets import PRESETS

TARGETS = ["demo", *PRESETS]
DRAFTS = ["ngram", "int8", "none", *PRESETS]
POLICIES = ["adaptive", "adaptive:gate", "adaptive:tree", "ar", "kv", "spec:4", "joint:4", "tree:8"]


class RunPanel(QWidget):
    loadRequested = Signal(str, str)
    newConversationRequested = Signal()
    runRequested = Signal()
    stopRequested = Signal()
    measureRequested = Signal()

    def __init__(self):
        super().__init__()
        self.target = self._combo(TARGETS, "target: 'demo', a preset (qwen-coder-1.5b, qwen-coder-0.5b: "
                                              "fetched and assembled once), a hub id, a model folder or a .gguf file")
        self.draft = self._combo(DRAFTS, "draft: a model (same forms; qwen-coder-0.5b for the qwen-coder-1.5b "
                                         "target), 'int8' (int8 copy of the target), "
                                         "'ngram' (prompt lookup) or 'none'")
        self.load = QPushButton("Load")
        self.load.setToolTip("load the pair on the worker (calibrates costs once per machine and pair)")
        self.load.clicked.connect(lambda: self.loadRequested.emit(*self.pair()))
        self.numerics = QComboBox()
        self.numerics.addItems(["auto", "q8", "fp32"])
        self.numerics.setToolTip("the linears' arithmetic: q8 (8-bit activations times the weight codes, integer "
                                 "dot products, llama.cpp's kind), fp32 (transformers' ids); auto: q8 for a "
                                 "GGUF-backed model. Applies at the next Load.")
        self.loaded = QLabel("no models loaded")
        self.loaded.setWordWrap(True)
        self.loaded.setStyleSheet("color: #555;")
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("Prompt ...")
        self.prompt.setMinimumHeight(56)
        # the editor takes what room is left (its size hint would make the scrolling dock taller than the screen)
        self.prompt.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Ignored)
        self.policy = QComboBox()
        self.policy.setEditable(True)
        self.policy.addItems(POLICIES)
        self.policy.setToolTip(POLICIES_HELP + "  (tree:N and adaptive:tree verify token trees; use the ngram draft)")
        self.max_new = QSpinBox()
        self.max_new.setRange(1, 4096)
        self.max_new.setValue(256)
        self.raw = QCheckBox("Raw prompt (no chat template)")
        self.raw.setToolTip("send the text as it is; unchecked, a model whose tokenizer has a chat template "
                            "gets the prompt as one user turn (an instruct model then answers)")
        self.conversation = QCheckBox("Conversation")
        self.conversation.setToolTip("each Run sends the prompt as the next turn of one conversation: the model sees "
                                     "the whole conversation,\nand the prefix cache serves all of it but the new "
                                     "message (the turns before, prompts and answers)")
        self.new_conv = QPushButton("New conversation")
        self.new_conv.setToolTip("the next Run starts a new conversation (the prefix cache keeps what it holds)")
        self.new_conv.clicked.connect(self.newConversationRequested)
        self.conv_info = QLabel("")
        self.conv_info.setStyleSheet("color: #555;")
        self.conv_info.setWordWrap(True)
        self.conversation.toggled.connect(self._conversation_toggled)
        self.run = QPushButton("Run")
        self.run.setToolTip("Run (Ctrl+R)")
        self.run.setDefault(True)
        self.stop = QPushButton("Stop")
        self.stop.setToolTip("Stop (Esc): ends the request within one round")
        self.stop.setEnabled(False)
        self.run.clicked.connect(self.runRequested)
        self.stop.clicked.connect(self.stopRequested)
        self.measure = QPushButton("Measure every action")
        self.measure.setToolTip("Measure every action (Ctrl+M): run every (r, k) of {0,1} x K on this prompt from "
                                "the same cache state,\nR times each, and draw the measured cost beside each "
                                "prediction (the oracle and the controller's regret)")
        self.measure.clicked.connect(self.measureRequested)
        self.repeats = QSpinBox()
        self.repeats.setRange(1, 20)
        self.repeats.setValue(3)
        self.repeats.setPrefix("R = ")
        self.repeats.setToolTip("timed runs per action (median, min-max whisker)")

        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("Target", self._with_browse(self.target, "target"))
        form.addRow("Draft", self._with_browse(self.draft, "draft"))
        form.addRow("Numerics", self.numerics)
        form.addRow("", self.load)
        form.addRow(self.loaded)
        form.addRow("Policy", self.policy)
        form.addRow("Max new tokens", self.max_new)
        form.addRow(self.raw)
        crow = QHBoxLayout()
        crow.setContentsMargins(0, 0, 0, 0)
        crow.addWidget(self.conversation)
        crow.addWidget(self.new_conv, 1)
        form.addRow(crow)
        form.addRow(self.conv_info)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run)
        buttons.addWidget(self.stop)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(form)
        self.prompt_label = QLabel("Prompt")
        lay.addWidget(self.prompt_label)
        lay.addWidget(self.prompt, 1)
        lay.addLayout(buttons)
        mrow = QHBoxLayout()
        mrow.addWidget(self.measure, 1)
        mrow.addWidget(self.repeats)
        lay.addLayout(mrow)
        self._conversation_toggled(False)

    def _combo(self, items, tip) -> QComboBox:
        c = QComboBox()
        c.setEditable(True)
        c.addItems(items)
        c.setToolTip(tip)
        c.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        c.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        c.setMinimumContentsLength(10)
        return c

    def _with_browse(self, combo: QComboBox, role: str) -> QHBoxLayout:
        b = QToolButton()
        b.setText("…")
        b.setToolTip("choose a model folder or a .gguf file")
        b.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        m = QMenu(b)
        m.addAction("Model folder ...", lambda: self._browse(combo, folder=True))
        m.addAction(".gguf file ...", lambda: self._browse(combo, folder=False))
        b.setMenu(m)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(combo, 1)
        row.addWidget(b)
        return row

    def _browse(self, combo: QComboBox, folder: bool) -> None:
        if folder:
            path = QFileDialog.getExistingDirectory(self, "Model folder")
        else:
            path, _ = QFileDialog.getOpenFileName(self, "GGUF model", "", "GGUF (*.gguf);;All files (*)")
        if path:
            combo.setCurrentText(path)

    def _conversation_toggled(self, on: bool) -> None:
        self.new_conv.setEnabled(on)
        self.prompt_label.setText("Next message" if on else "Prompt")
        self.run.setText("Send" if on else "Run")
        self.conv_info.setVisible(on)

    def set_conversation_info(self, text: str) -> None:
        self.conv_info.setText(text)

    # ------------------------------------------------------------------ values
    def pair(self) -> tuple[str, str]:
        return self.target.currentText().strip() or "demo", self.draft.currentText().strip() or "none"

    def set_pair(self, target: str, draft: str) -> None:
        self.target.setCurrentText(target)
        self.draft.setCurrentText(draft)

    def add_recent(self, combo: QComboBox, items) -> None:
        for it in items:
            if combo.findText(it) < 0:
                combo.addItem(it)

    def policy_text(self) -> str:
        return self.policy.currentText().strip()

    def check_policy(self) -> str | None:
        try:
            Policy.parse(self.policy_text())
            return None
        except ValueError as e:
            return str(e)

    def set_running(self, running: bool, busy: bool = False) -> None:
        self.run.setEnabled(not running and not busy)
        self.measure.setEnabled(not running and not busy)
        self.load.setEnabled(not running and not busy)
        self.new_conv.setEnabled(not running and self.conversation.isChecked())
        self.stop.setEnabled(running)
        for w in (self.target, self.draft):
            w.setEnabled(not running and not busy)

    def prompt_text(self) -> str:
        return self.prompt.toPlainText()

    def set_loaded(self, text: str) -> None:
        self.loaded.setText(text)
        self.loaded.setTextFormat(Qt.TextFormat.PlainText)
