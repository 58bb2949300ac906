"""Keep ``None`` alive under PySide6's reference leak (CPython before 3.12).

PySide6 6.12 on CPython 3.11 drops one reference to ``None`` on every call of a Qt method that
returns nothing (``QLabel.setText``, ``setVisible``, ...: one reference lost a call, as measured in
docs/gui.md). ``None`` starts with ~60,000 references once the explorer is imported, so after
about that many calls its count reaches zero and the interpreter aborts with "Fatal Python error:
none_dealloc: deallocating None" (a live session redraws dozens of labels a tick: minutes of
generating; the GUI test suite reaches it too). CPython 3.12 made ``None`` immortal (PEP 683); here
its count is raised once by 2**40, which no session can use up, to the same effect.
"""

from __future__ import annotations

import sys

PINNED = 1 << 40


def pin_none() -> bool:
    """Raise None's reference count by PINNED once (CPython < 3.12 only); whether it did."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or getattr(pin_none, "done", False):
        return False
    import ctypes

    ctypes.c_ssize_t.from_address(id(None)).value += PINNED
    pin_none.done = True
    return True
