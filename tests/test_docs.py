"""The user documentation: README.md is a short guide that starts with the two set-up commands (CI runs its test
command), and every relative link in README.md, docs/*.md and benchmarks/README.md resolves to a file or folder
inside the repository (none escapes it, none points at a web page by accident). No tracked text file carries build
history (issue numbers, work sessions, run dates and times, reverted experiments: git log keeps those), and no
file name does. Seconds, no model."""

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


# -- no build history in the tree (git log keeps it) ------------------------------------------------------------------

# Words that only a history of the work uses: issue numbers ("issue 43", "#43"), numbered work sessions and periods,
# machines "lent", dates and clock times of runs, reverted experiments, commit hashes in prose, numbered stages.
HISTORY = re.compile(r"\bissues? ?#?\d+|(?<![\w&/'\"])#\d{1,3}\b|\bsessions? \d+|\bwork periods?\b|\bperiod \d+\b"
                     r"|\blent\b|\b20\d\d-[01]\d-[0-3]\d\b|\b[0-2]\d:[0-5]\d UTC\b|\brevert(?:ed|s)?\b"
                     r"|\bcommits? [0-9a-f]{7,40}\b|\bstages? \d\b", re.I)
HISTORY_NAME = re.compile(r"_s\d+\.|issue|session|_v\d+\.|quiet\d|before_after|prior\d", re.I)
# Data, not prose: prompt sets and golden files as their sources wrote them, measurement records (their own fields
# say when they ran), binaries.
NOT_PROSE = ("tests/data/", "benchmarks/prompts/", "benchmarks/results/")
BINARY = (".png", ".npz", ".npy", ".onnx", ".gguf", ".safetensors", ".bin", ".so")
# Real uses, by file and the exact text matched ("*": the whole file): this test's own patterns and samples; the
# z-lab reference's upstream commit, which the golden files were made from.
HISTORY_ALLOWED = {("tests/test_docs.py", "*"), ("docs/zlab-compatibility.md", "commit 07ebd93"),
                   ("tests/data/zlab/PROVENANCE.md", "commit 0a7587c04af47b56024ef80f44c0926e795a540b")}


def tracked_files() -> list[str]:
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def history_words(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_no_build_history_in_tracked_text():
    """Docs, code comments, test docstrings and script headers describe the project as it is; which issue, session,
    machine or run got it there is for commit messages."""
    bad = []
    for f in tracked_files():
        if f.startswith(NOT_PROSE) and not f.endswith(".md") or f.endswith(BINARY):
            continue
        if (f, "*") in HISTORY_ALLOWED:
            continue
        try:
            text = (REPO / f).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            bad += [f"{f}:{i}: {w!r}" for w in history_words(line) if (f, w) not in HISTORY_ALLOWED]
    assert not bad, f"{len(bad)} history words in tracked files:\n" + "\n".join(bad[:60])


# A document the repository does not hold: the specification the project was built from (its sections are in
# docs/design.md and docs/training.md now), the steering folder beside the checkout and its style guide's rules.
OUTSIDE = re.compile(r"\bSPEC §\d|\bSPEC\.md\b|\.\./shared/|\bSTYLE\.md\b|\bSTYLE(?: rules?)? ?\d*[:)]|\bSTYLE rules? \d")


def test_nothing_points_at_a_document_outside_the_repository():
    bad = []
    for f in tracked_files():
        if f.startswith(NOT_PROSE) or f.endswith(BINARY) or f == "tests/test_docs.py":
            continue
        try:
            text = (REPO / f).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{f}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not bad, bad


def test_no_history_in_file_names():
    bad = [f for f in tracked_files() if HISTORY_NAME.search(Path(f).name)]
    assert not bad, bad


def test_history_check_sees_history_and_spares_the_present():
    """The checker itself: each kind of history word is found; ordinary technical text is not."""
    found = history_words("see issue 43, #43 and issues #12; in session 17 (work period 2) on the lent GPU, "
                          "2026-12-03 at 07:37 UTC; the change was reverted; commit 93c4411; stage 3")
    assert len(found) == 11, found
    assert history_words("an InferenceSession per graph; a C API session; int64 #include <x.h>; 3.5 rows; "
                         "layer 43; --streams 1 2 4 8 16; shape [B, 16]; a two-stage build") == []
    assert HISTORY_NAME.search("triton_throughput_s17.json") and not HISTORY_NAME.search("verify_rows_codes.json")


# -- docs/contributing.md: the Python <-> C++ twins table ----------------------------------------------------------

CONTRIBUTING = REPO / "docs" / "contributing.md"


def twin_rows(markdown: str) -> list[list[list[str]]]:
    """The twins table's body rows, each cell as its code spans (without backticks)."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "rule":
            rows.append([re.findall(r"`([^`]+)`", c) for c in cells])
    return rows


def missing_names(spans: list[str]) -> list[str]:
    """Names of a Python or C++ cell (a file path, then the names that file holds; a C++ name may sit in the file's
    header) that its file does not define or mention."""
    missing, text = [], ""
    for span in spans:
        if span.endswith((".py", ".cpp", ".h")):
            files = [REPO / span, (REPO / span).with_suffix(".h")]
            if not files[0].is_file():
                missing.append(span)
            text = "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())
        elif not re.search(rf"\b{re.escape(span)}\b", text):
            missing.append(span)
    return missing


def twin_command(markdown: str) -> list[str]:
    """The one command that runs every twin test (the fenced bash line under "Running them all"), as pytest args."""
    import shlex

    section = markdown.split("## Running them all", 1)[1]
    line = next(ln for ln in section.splitlines() if ln.startswith(".venv/bin/python -m pytest"))
    return shlex.split(line)[3:]


def test_contributing_lists_every_twin_by_names_that_exist():
    """Each row of the twins table names a Python file and a C++ file and steps each of them holds (renaming a step
    on one side fails here until the table, and the other side, follow); every ctest it names exists."""
    rows = twin_rows(CONTRIBUTING.read_text(encoding="utf-8"))
    assert len(rows) >= 10, rows
    ctests = (REPO / "runtime" / "tests" / "CMakeLists.txt").read_text(encoding="utf-8")
    for rule, python, cpp, tests in rows:
        assert python[0].startswith("dflash2_trt/") and cpp[0].startswith("runtime/src/"), (rule, python, cpp)
        assert not missing_names(python) and not missing_names(cpp), (rule, missing_names(python + cpp))
        assert tests, rule
        for t in tests:
            assert t.startswith("test_") or re.search(rf"NAME {t}\b", ctests), (rule, t)


def test_contributing_command_runs_exactly_the_twin_tests():
    """The one command of docs/contributing.md selects every test the page names and no other."""
    import subprocess
    import sys

    text = CONTRIBUTING.read_text(encoding="utf-8")
    named = {s for s in re.findall(r"`([^`]+)`", text) if re.fullmatch(r"test_\w+", s)}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                        *twin_command(text)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    selected = {ln.split("::")[1].split("[")[0] for ln in r.stdout.splitlines() if "::" in ln}
    assert selected == named, (sorted(selected - named), sorted(named - selected))


def test_twin_checks_see_a_wrong_name_and_a_stray_test():
    """Negative controls: a step the file does not hold is reported; a command that selects a test the page does
    not name (or misses one) differs."""
    assert missing_names(["dflash2_trt/runtime/decoder.py", "_SpeculativeLoop", "no_such_step"]) == ["no_such_step"]
    assert missing_names(["runtime/src/core/decoder.cpp", "SpeculativeLoop", "Cycle"]) == []
    assert missing_names(["runtime/src/core/nothing.cpp"]) == ["runtime/src/core/nothing.cpp"]
    rows = twin_rows("| rule | Python | C++ | tests |\n|---|---|---|---|\n| r | `a.py`: `x` | `b.cpp`: `y` | `test_z` |\n")
    assert rows == [[[], ["a.py", "x"], ["b.cpp", "y"], ["test_z"]]]
    cmd = twin_command("## Running them all\n\n```bash\n.venv/bin/python -m pytest -q tests/a.py -k \"x or y\"\n```\n")
    assert cmd == ["-q", "tests/a.py", "-k", "x or y"]


# -- docs/design.md: the code layout lists the package ----------------------------------------------------------------

PACKAGE = REPO / "dflash2_trt"


def layout_names(markdown: str) -> set[str]:
    """The names docs/design.md's code layout gives under ``dflash2_trt/``: ``x.py`` modules and ``x/`` folders."""
    block = markdown.split("## Code layout", 1)[1].split("```", 2)[1]
    names = set()
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            head = re.split(r"\s{2,}", line.strip())[0]
            names |= {n.strip() for n in head.split(",")}
    return names


def package_entries(tracked: bool = True) -> set[str]:
    """The package's top-level modules and subpackages (and its package-data folders), as the layout names them:
    those git tracks, or (``tracked=False``) those on disk, work in progress included."""
    files = [REPO / f for f in tracked_files() if f.startswith("dflash2_trt/")] if tracked else \
        [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    out = set()
    for f in files:
        top = f.relative_to(PACKAGE).parts
        if len(top) == 1 and top[0].endswith(".py") and top[0] != "__init__.py":
            out.add(top[0])
        elif len(top) > 1 and not top[0].startswith(("_", ".")):
            out.add(f"{top[0]}/")
    return out


def test_design_layout_lists_every_top_level_module_and_subpackage():
    """docs/design.md's code layout names each top-level module and subpackage of dflash2_trt that git tracks, and
    nothing that is not there."""
    listed = layout_names((REPO / "docs" / "design.md").read_text(encoding="utf-8"))
    missing, gone = package_entries() - listed, listed - package_entries(tracked=False)
    assert not missing, f"not in docs/design.md's layout: {sorted(missing)}"
    assert not gone, f"in the layout but not in the package: {sorted(gone)}"


def test_layout_check_sees_a_missing_module():
    """Negative control: a layout that leaves out a module, or names one that is gone, differs from the package."""
    text = ("## Code layout\n\n```\ndflash2_trt/   root\n  api.py, gone.py   x\n  runtime/   y\n"
            "plugins/   z\n```\n")
    assert layout_names(text) == {"api.py", "gone.py", "runtime/"}
    assert "errors.py" in package_entries() - layout_names(text)


def test_every_declared_pytest_marker_is_used():
    """A marker pyproject.toml declares marks at least one test (a declared marker no test uses promises a selection
    that selects nothing)."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    declared = [m.split(":", 1)[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]]
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").glob("*.py"))
    unused = [m for m in declared if not re.search(rf"\bmark\.{m}\b", tests)]
    assert declared and not unused, unused
