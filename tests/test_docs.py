"""The README and the docs/ pages: every relative link and anchor resolves, and the README stays a
front page (short, with the two commands first)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)  # within a paragraph
# [text](target) and ![alt](target), with an optional "title"; text may hold one level of brackets
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
            else:
                lines.append(line)
        elif match and match.group(1).startswith(fence) and not line[match.end() :].strip():
            fence = None  # a closing fence: the same character, at least as long, nothing after
    return lines


def heading_text(raw: str) -> str:
    """A heading as rendered text: code spans, emphasis and links reduced to their words."""
    text = INLINE_CODE.sub(lambda m: m.group(2), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"(\*\*|__|\*|_)(.+?)\1", r"\2", text)


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lowercase, only letters, digits, spaces, hyphens and
    underscores kept, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, duplicates numbered -1, -2... as GitHub does."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(heading_text(match.group(2)))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """Targets of the inline links, images and reference definitions outside code (a link's
    text may run over lines, as may a code span)."""
    lines = prose_lines(page.read_text(encoding="utf-8"))
    targets = [m.group(1) for m in map(REFERENCE_DEFINITION.match, lines) if m]
    prose = INLINE_CODE.sub("", "\n".join(lines))
    return targets + [match.group(1) for match in INLINE_LINK.finditer(prose)]


def broken_links(page: Path) -> list[str]:
    problems: list[str] = []
    for target in links(page):
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            problems.append(f"{target}: {linked.name} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_docs_pages_all_exist_and_the_readme_links_each() -> None:
    readme_targets = {target.partition("#")[0] for target in links(README)}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_targets, f"the README does not link docs/{page.name}"


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first_block is not None, "the README has no code block"
    assert "make demo" in first_block.group(1)
    assert "make test" in first_block.group(1)


def test_the_slugs_follow_github() -> None:
    assert github_slug("Metrics, health and logs") == "metrics-health-and-logs"
    assert github_slug("Stragglers: gossip against synchronous allreduce") == (
        "stragglers-gossip-against-synchronous-allreduce"
    )
    assert github_slug(heading_text("The `node_config` API")) == "the-node_config-api"
    assert github_slug("What holds") == "what-holds"
