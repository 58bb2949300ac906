"""What the desktop needs before a window opens: the X11 platform plugin's system libraries (checked
without loading Qt, so a missing one gives one line instead of Qt's abort) and a window size that
fits the screen.

Qt's xcb plugin (the X11 platform) links against system libraries that a minimal Linux install may
lack (libxcb-icccm4, libxcb-keysyms1, libxcb-cursor0, ...); Qt then aborts with "Could not load
the Qt platform plugin". ``missing_libraries`` runs ``ldd`` on the plugin PySide6 ships and
``message`` names what is missing and the command that installs it (Debian/Ubuntu and Fedora
package names). ``python -m app.desktop`` prints that line (scripts/setup.sh runs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# soname -> (Debian/Ubuntu package, Fedora package): the xcb plugin's system libraries
PACKAGES = {
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libSM.so.6": ("libsm6", "libSM"),
    "libICE.so.6": ("libice6", "libICE"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
}
# always worth installing with the others: Qt 6.5+ needs it for the xcb plugin
ALWAYS = ("libxcb-cursor.so.0",)
DEFAULT_SIZE = (1500, 940)     # the first window, where the screen has room for it


def xcb_plugin() -> Path | None:
    """The X11 platform plugin of the installed PySide6 (found without importing Qt's GUI)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("PySide6")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return p if p.is_file() else None


def wants_xcb(env=None, platform: str | None = None) -> bool:
    """Will Qt try its xcb (X11) plugin: Linux, QT_QPA_PLATFORM unset or xcb, and an X display
    (a Wayland session without DISPLAY uses Qt's wayland plugin)."""
    env = os.environ if env is None else env
    if not (platform or sys.platform).startswith("linux"):
        return False
    qpa = env.get("QT_QPA_PLATFORM", "").strip()
    if qpa:
        return qpa.split(":")[0].split(";")[0] == "xcb"
    return bool(env.get("DISPLAY"))


def ldd_missing(lib: Path, run=subprocess.run) -> list[str]:
    """The sonames ``ldd`` reports "not found" for ``lib`` ([] when ldd is not there)."""
    if shutil.which("ldd") is None:
        return []
    try:
        out = run(["ldd", str(lib)], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    missing = []
    for line in out.splitlines():
        if "not found" in line:
            name = line.split("=>")[0].strip()
            if name and name not in missing:
                missing.append(name)
    return missing


def message(missing: list[str]) -> str:
    """One line: what is missing and the command that installs it (Debian/Ubuntu, Fedora)."""
    names = list(dict.fromkeys(missing))
    deb = list(dict.fromkeys([PACKAGES[m][0] for m in names if m in PACKAGES]
                             + [PACKAGES[m][0] for m in ALWAYS]))
    fed = list(dict.fromkeys([PACKAGES[m][1] for m in names if m in PACKAGES]
                             + [PACKAGES[m][1] for m in ALWAYS]))
    unknown = [m for m in names if m not in PACKAGES]
    return (f"Qt cannot load its X11 platform plugin (xcb): missing system libraries {', '.join(names)}; "
            f"install them with: sudo apt-get install {' '.join(deb)} (Debian/Ubuntu) or "
            f"sudo dnf install {' '.join(fed)} (Fedora)"
            + (f"; {', '.join(unknown)}: install the package your distribution has it in" if unknown else "")
            + " (or run headless with QT_QPA_PLATFORM=offscreen)")


def missing_libraries(env=None, plugin: Path | None = None, run=subprocess.run) -> list[str]:
    """The system libraries Qt's xcb plugin lacks, when Qt is going to use it; [] otherwise."""
    if not wants_xcb(env):
        return []
    plugin = plugin or xcb_plugin()
    if plugin is None:
        return []
    return ldd_missing(plugin, run)


def check(env=None) -> str | None:
    """The one-line message when the desktop cannot start for want of system libraries, else None."""
    missing = missing_libraries(env)
    return message(missing) if missing else None


# ----------------------------------------------------------------------------- window size
FRAME = (16, 40)              # room for a window manager's frame and title bar


def fit(screen: tuple[int, int, int, int], want: tuple[int, int] = DEFAULT_SIZE) -> tuple[int, int, int, int]:
    """(x, y, w, h): a window of size ``want``, shrunk to the available screen (x, y, w, h) less
    room for a frame, centred on it."""
    sx, sy, sw, sh = screen
    w = max(1, min(want[0], sw - FRAME[0]))
    h = max(1, min(want[1], sh - FRAME[1]))
    return sx + (sw - w) // 2, sy + (sh - h) // 2, w, h


def on_screen(geo: tuple[int, int, int, int], screen: tuple[int, int, int, int]) -> bool:
    """Does a saved geometry fit the available screen now (another monitor, another resolution)?"""
    x, y, w, h = geo
    sx, sy, sw, sh = screen
    return w <= sw and h <= sh and x >= sx - 8 and y >= sy - 8 and x + w <= sx + sw + 8 and y + h <= sy + sh + 8


def no_display(env=None, platform: str | None = None) -> str | None:
    """One line when Qt would find no display at all (Linux, no platform chosen, neither DISPLAY
    nor WAYLAND_DISPLAY), else None."""
    env = os.environ if env is None else env
    if not (platform or sys.platform).startswith("linux") or env.get("QT_QPA_PLATFORM", "").strip():
        return None
    if env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return None
    return ("no display (neither DISPLAY nor WAYLAND_DISPLAY is set): run it in a desktop session or under "
            "xvfb-run, or headless with QT_QPA_PLATFORM=offscreen (scripted mode: --screenshot PNG)")


def x_endpoint(display: str) -> tuple[str, object] | None:
    """Where the X server of DISPLAY listens: ("unix", socket path) for a local display (":1",
    ":1.0", "unix:1"), ("tcp", (host, 6000 + n)) for "host:n"; None when the form is not one of these."""
    host, sep, rest = display.rpartition(":")
    if not sep or host.startswith("/"):
        return None
    num = rest.split(".")[0]
    if not num.isdigit():
        return None
    if host in ("", "unix"):
        return "unix", f"/tmp/.X11-unix/X{int(num)}"
    return "tcp", (host, 6000 + int(num))


def x_answers(endpoint: tuple[str, object], timeout: float = 2.0) -> bool:
    """Whether something accepts a connection where the X server should listen (Linux: the
    abstract socket first, as Xorg and Xvfb open both, then the socket file)."""
    import socket

    kind, where = endpoint
    if kind == "tcp":
        try:
            with socket.create_connection(where, timeout=timeout):
                return True
        except OSError:
            return False
    for addr in ("\0" + str(where), str(where)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(addr)
                return True
            except OSError:
                continue
    return False


def x_server_problem(env=None, platform: str | None = None, answers=None) -> str | None:
    """One line when Qt would open an X display (xcb) that no server answers, else None: Qt itself
    would abort with a message about its xcb plugin (naming libxcb-cursor0 even when it is installed)."""
    env = os.environ if env is None else env
    if not wants_xcb(env, platform):
        return None
    if env.get("WAYLAND_DISPLAY") and not env.get("QT_QPA_PLATFORM", "").strip():
        return None          # a Wayland session: Qt may well use its wayland plugin
    disp = env.get("DISPLAY", "").strip()
    ep = x_endpoint(disp) if disp else None
    if ep is None or (answers or x_answers)(ep):
        return None
    where = ep[1] if ep[0] == "unix" else f"{ep[1][0]} port {ep[1][1]}"
    start = f"start one (e.g. Xvfb :{disp.rpartition(':')[2].split('.')[0]} &), " if ep[0] == "unix" else ""
    return (f"DISPLAY={disp} names no running X server (nothing answers at {where}): {start}set DISPLAY to a "
            "running one, or run headless with QT_QPA_PLATFORM=offscreen")


def main() -> int:
    """``python -m app.desktop``: say whether the explorer's window can open here (never fails)."""
    if not sys.platform.startswith("linux"):
        return 0
    msg = check({"DISPLAY": ":0"})       # as a desktop session would start it
    print(f"[setup] explorer: {msg}" if msg else "[setup] explorer: the X11 platform plugin's system libraries "
          "are all there", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
