"""The user documentation: README.md is a short guide that starts with the two set-up commands (CI runs its test
command), and every relative link in README.md, docs/*.md and benchmarks/README.md resolves to a file or folder
inside the repository (none escapes it, none points at a web page by accident). Seconds, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 150
SETUP_COMMANDS = (
    "./scripts/demo.sh     # set-up (idempotent, .venv) + the demo",
    "./scripts/test.sh     # set-up (idempotent, .venv) + the whole CPU test suite (CI runs exactly this)",
)
# [text](target) or [text](target "title"); images too. Code spans are removed first (a link inside backticks is
# text, not a link).
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    docs = sorted((REPO / "docs").glob("*.md"))
    return [README, *docs, REPO / "benchmarks" / "README.md"]


def relative_links(path: Path) -> list[str]:
    return links_in(path.read_text(encoding="utf-8"))


def links_in(markdown: str) -> list[str]:
    """The relative link targets of a markdown text (http links, bare anchors and code left out)."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return [t for t in LINK.findall(text) if not EXTERNAL.match(t) and not t.startswith("#")]


def test_readme_is_short_and_starts_with_the_setup_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert lines[0].startswith("# "), lines[0]
    body = [ln for ln in lines[1:] if ln.strip()]
    assert body[0] == "```bash", body[0]
    assert tuple(body[1:3]) == SETUP_COMMANDS, body[1:3]
    assert body[3] == "```", body[3]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert SETUP_COMMANDS[1].split()[0] in ci


def test_docs_folder_exists():
    docs = REPO / "docs"
    assert docs.is_dir() and any(docs.glob("*.md"))


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(path: Path):
    assert path.is_file(), path
    bad = []
    for target in relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:
            continue
        resolved = (path.parent / file_part).resolve()
        if not resolved.is_relative_to(REPO):
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file or folder")
    assert not bad, f"{path.relative_to(REPO)}: " + "; ".join(bad)


def test_docs_link_into_docs_from_the_readme():
    """The README's documentation index reaches every page of docs/."""
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for t in relative_links(README)}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, sorted(str(p.relative_to(REPO)) for p in pages - linked)


def test_link_checker_sees_links_and_ignores_code():
    """The checker itself: a markdown link is found, an http link, an anchor and a link inside code are not."""
    text = ("[a](design.md#x) [b](https://example.org) [c](#top) `[d](nowhere.md)`\n"
            "```\n[e](nowhere2.md)\n```\n![f](../README.md)\n")
    assert links_in(text) == ["design.md#x", "../README.md"]
