"""Every relative link of the README and the docs leads somewhere: the file exists, and a
``#fragment`` into a Markdown file names one of its headings (GitHub's anchors). The bench summaries
under docs/results/ are left out: they link plots that the entry's command writes again and that
are not kept in git (docs/results/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

ROOT = Path(__file__).resolve().parents[2]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation dropped, spaces to -."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    h = re.sub(r"<[^>]+>", "", h)
    return "".join(c for c in h if c.isalnum() or c in " -_").replace(" ", "-")


def without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a\s+(?:name|id)="([^"]+)"', path.read_text()))
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", without_code(path.read_text()), flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def pages() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.relative_to(ROOT / "docs").parts[:1]]
    return [ROOT / "README.md", *sorted(docs)]


def broken_links() -> list[str]:
    bad, known = [], {}
    for page in pages():
        for url in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", url):
                continue                                    # http:, https:, mailto:
            path, _, frag = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {url}"
            if not target.exists():
                bad.append(f"{where} (no such file)")
            elif frag and target.suffix == ".md":
                if target not in known:
                    known[target] = anchors(target)
                if frag not in known[target]:
                    bad.append(f"{where} (no such heading)")
    return bad


def test_slug_is_githubs():
    assert slug("`ar` against llama.cpp on the same GGUF file") == "ar-against-llamacpp-on-the-same-gguf-file"
    assert slug("Install (vLLM's CPU build, in its own venv)") == "install-vllms-cpu-build-in-its-own-venv"


def test_every_link_of_the_docs_leads_somewhere():
    assert len(pages()) > 10
    assert broken_links() == []
