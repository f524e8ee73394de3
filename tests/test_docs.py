"""The user documentation holds together: every relative link resolves, the front pages stay short, and no word
of how the project was developed reaches a user.

Links are checked in README.md, BENCHMARKS.md and every Markdown file under docs/: a relative link must name an
existing file or folder, and a ``#anchor`` into a Markdown file must match one of its headings (GitHub's slugs).
Absolute URLs are not fetched (no network in tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO

USER_DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")
# What a user must not read: work-session numbers, names of development issues, the lab's own machines, and
# paths to the data folder beside the development checkout
_PROCESS_WORDS = re.compile(r"session|fast-path issue|planner issue|our gpu|\.\./shared", re.IGNORECASE)


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append((number, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Every relative link of ``path`` that names no existing file, or no heading of the Markdown file it names."""
    broken = []
    for number, line in _prose_lines(path):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where} (no heading #{anchor} in {resolved.name})")
    return broken


def test_broken_links_are_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n", encoding="utf-8")
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [bad](missing.md) [bad anchor](there.md#nowhere)\n"
                    "```\n[in code](not-checked.md)\n```\n", encoding="utf-8")
    assert broken_links(page, root=tmp_path) == ["page.md:1: missing.md (no such file)", "page.md:1: there.md#nowhere (no heading #nowhere in there.md)"]


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_front_pages_stay_short():
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) < 20_000, f"README.md is {len(readme):,} bytes; the limit is 20 KB: move detail to docs/"
    long_lines = [n for n, line in enumerate(readme.decode().splitlines(), 1) if len(line) > 400]
    assert long_lines == [], f"README.md lines over 400 characters: {long_lines}"
    index = (REPO / "BENCHMARKS.md").read_bytes()
    assert len(index) < 15_000, f"BENCHMARKS.md is {len(index):,} bytes; the limit is 15 KB: it indexes the pages"


def test_every_result_page_is_indexed():
    index = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    pages = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
    assert pages, "docs/benchmarks/ holds no result page"
    assert [p.name for p in pages if f"docs/benchmarks/{p.name}" not in index] == []


def _process_words(paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _PROCESS_WORDS.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    return hits


# docs/BAD_INPUTS.md quotes the error lines of src/ verbatim (tests/test_bad_inputs.py compares them), so it is
# checked with the source it quotes, not with the prose
BAD_INPUTS = REPO / "docs" / "BAD_INPUTS.md"


def test_user_docs_hold_no_development_words():
    assert _process_words([p for p in USER_DOCS if p != BAD_INPUTS]) == []


def test_source_configs_and_quoted_errors_hold_no_development_words():
    """src/ and configs/ (docstrings, --help, error lines, config comments) say nothing of how the project was
    developed, and so neither do the error lines docs/BAD_INPUTS.md quotes."""
    paths = [p for p in sorted((REPO / "src").rglob("*")) + sorted((REPO / "configs").rglob("*"))
             if p.is_file() and p.suffix in {".py", ".yaml", ".yml", ".json", ".md", ".txt"}]
    assert _process_words([*paths, BAD_INPUTS]) == []


def test_the_exit_status_table_lists_every_status_zerotrain_ends_with():
    """docs/clusters.md's table is the one place a job script's author reads the statuses: each one the code
    carries is there, with the row that says what it means."""
    from zerotrain.errors import (
        DIVERGED_EXIT,
        OOM_EXIT,
        RANK_LOST_EXIT,
        USER_ERROR_EXIT,
    )
    from zerotrain.runtime.preemption import PREEMPTED_EXIT

    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\d+|128 \+ n) \| ([^|]+) \|",
                                                         (REPO / "docs" / "clusters.md").read_text(), re.MULTILINE)}
    expected = {USER_ERROR_EXIT: "a mistake", DIVERGED_EXIT: "NaN/inf", RANK_LOST_EXIT: "a rank was lost",
                OOM_EXIT: "out of memory", PREEMPTED_EXIT: "after saving a checkpoint"}
    assert set(rows) == {"0", "128 + n", *map(str, expected)}
    for status, words in expected.items():
        assert words in rows[str(status)], (status, rows[str(status)])
