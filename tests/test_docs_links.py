"""Every link in the project's Markdown points to a file of this repository that exists.

The pages read here are the ones a reader browses: README.md, docs/, the lab's READMEs and
records (bench/**), the chart's and the SDK's READMEs. A link is `[text](target)`,
`![alt](target)` or a reference definition `[label]: target`, outside code blocks and code
spans (a path in backticks is an example, not a link). A relative target is resolved against the
page's own directory and must stay inside the repository and exist; a `#fragment` on a Markdown
page must name one of its headings. A target with a URL scheme (`https:`, `mailto:`...) or an
absolute path points outside the repository, which the docs do not do: they must read the same
in a checkout with no network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({
    ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").rglob("*.md"),
    *(ROOT / "helm").rglob("README.md"), *(ROOT / "clients").rglob("README.md"),
} - set((ROOT / "bench" / "results" / "tmp").rglob("*.md")))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, code blocks and code spans left out."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return [*INLINE.findall(prose), *REFERENCE.findall(prose)]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats
    numbered."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        if m := re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def problem(page: Path, target: str) -> str | None:
    """Why `target` on `page` is not a link to an existing file of the repository, or None."""
    if SCHEME.match(target) or target.startswith(("/", "//")):
        return "points outside the repository"
    path, _, fragment = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.is_relative_to(ROOT):
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
        return f"no heading #{fragment}"
    return None


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/configuration.md", "bench/README.md", "bench/results/README.md",
            "clients/python/README.md", "helm/kvgate/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_points_to_a_file_in_the_repository(page: Path) -> None:
    broken = [f"{t}: {why}" for t in links(page.read_text()) if (why := problem(page, t))]
    assert broken == []


def test_links_are_read_from_prose_only() -> None:
    text = ("See [the config](docs/configuration.md#pools) and ![plot](a.png \"title\").\n"
            "[ref]: ../up.md\n"
            "`[not a link](x.md)` and\n```\n[nor this](y.md)\n```\n"
            "[nested [brackets]](z.md)\n")
    assert links(text) == ["docs/configuration.md#pools", "a.png", "z.md", "../up.md"]


def test_broken_escaping_external_and_fragment_links_are_caught(tmp_path: Path) -> None:
    page = ROOT / "docs" / "architecture.md"
    assert problem(page, "configuration.md") is None
    assert problem(page, "configuration.md#no-such-heading") == "no heading #no-such-heading"
    assert problem(page, "missing.md") == "no such file"
    assert problem(page, "../../outside.md") == "points outside the repository"
    assert problem(page, "https://example.com/") == "points outside the repository"
    assert problem(page, "/etc/passwd") == "points outside the repository"
    assert problem(page, "#failure-modes") is None


def test_anchors_follow_github_slugs() -> None:
    text = "# Failure modes\n## The `[pools]` table: keys & defaults\n## Failure modes\n"
    assert anchors(text) == {"failure-modes", "the-pools-table-keys--defaults", "failure-modes-1"}
