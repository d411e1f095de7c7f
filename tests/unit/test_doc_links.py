"""Every relative link of README.md and the guides in docs/ resolves: the file exists, and a
``#anchor`` names a heading of the page it points to (GitHub's heading slugs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped (letters,
    digits, ``-`` and ``_`` kept), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link renders as its text
    text = text.replace("`", "").strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (a repeated heading's get ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in ``page`` that is not a URL."""
    out = []
    for n, line in prose_lines(page.read_text()):
        # a code span is text, not a link; blanked, unless a link's own text is code
        line = _CODE.sub(lambda m: m.group(0) if "](" in line[m.end():m.end() + 2] else "``", line)
        for m in _LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                out.append((n, target))
    return out


def broken(page: Path) -> list[str]:
    bad = []
    for n, target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{n}: ({target})"
        if not dest.exists():
            bad.append(f"{where}: no file {path}")
        elif not dest.resolve().is_relative_to(REPO):
            bad.append(f"{where}: points outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
    return bad


def test_slug_is_githubs():
    assert slug("Train your own model (`model=hf`, `model=hf_local`)") == \
        "train-your-own-model-modelhf-modelhf_local"
    assert slug("Coming from DeepSpeed or Hugging Face: the one-line change") == \
        "coming-from-deepspeed-or-hugging-face-the-one-line-change"


def test_the_pages_link_to_each_other():
    linked = {(p.parent / t.partition("#")[0]).resolve() for p in PAGES
              for _, t in relative_links(p)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"guides no page links to: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = broken(page)
    assert not bad, "broken links:\n" + "\n".join(bad)
