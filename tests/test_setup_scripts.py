"""scripts/setup.sh as a newcomer meets it: the demo's set-up installs only what the demo needs, the test set-up
adds the test toolchain (apt included), one line per step, a log file named on failure, re-runs are one line.

Run on a copy of the scripts with a stand-in ``.venv/bin/python`` (records its arguments, prints pip-like noise)
and stand-in ``dpkg`` / ``id`` / ``apt-get`` / ``scripts/build_ort_ops.sh`` on PATH (every C API package missing, running as root): nothing is
installed."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NOISY = """#!/bin/sh
echo "{name} $*" >> "$FAKE_LOG"
i=0; while [ $i -lt 40 ]; do echo "Requirement already satisfied: noise $i"; i=$((i+1)); done
echo "WARNING: Location 'file:///opt/x' is ignored" >&2
if [ -n "$FAKE_FAIL" ]; then case "$*" in *"$FAKE_FAIL"*) exit 1;; esac; fi
exit 0
"""


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def sandbox(tmp_path):
    if shutil.which("bash") is None or shutil.which("sha1sum") is None:
        pytest.skip("needs bash and sha1sum")
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "demo.sh", "test.sh"):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    _exe(tmp_path / "scripts" / "build_ort_ops.sh", NOISY.format(name="build_ort_ops"))  # records, builds nothing
    _exe(tmp_path / ".venv" / "bin" / "python", NOISY.format(name="python"))
    (tmp_path / ".venv" / "bin" / "activate").write_text(f'export PATH="{tmp_path / ".venv" / "bin"}:$PATH"\n')
    stubs = tmp_path / "stubs"
    _exe(stubs / "dpkg", "#!/bin/sh\nexit 1\n")
    _exe(stubs / "id", "#!/bin/sh\necho 0\n")
    _exe(stubs / "apt-get", NOISY.format(name="apt-get"))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls.log")}
    env.pop("DFLASH2_SETUP_DRY_RUN", None)
    env.pop("DFLASH2_SETUP_LOG", None)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                              env={**env, **extra}, timeout=60)

    def calls() -> list[str]:
        log = tmp_path / "calls.log"
        lines = log.read_text().splitlines() if log.is_file() else []
        log.unlink(missing_ok=True)
        return lines

    return run, calls, tmp_path


def test_demo_setup_installs_only_the_demos_needs_one_line_per_step(sandbox):
    run, calls, root = sandbox
    r = run("demo")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines and all(ln.startswith("setup: ") and ln.endswith(" ok") for ln in lines), r.stdout
    assert len(lines) <= 6 and r.stderr == ""  # the tools' noise is in the log, not on the screen
    c = calls()
    assert not any(x.startswith("apt-get") for x in c), c  # no cross compilers, qemu or clang for the demo
    assert not any(".[dev]" in x or "nvidia-pytriton" in x or "kernel-lens" in x for x in c), c
    assert any("torch==" in x for x in c) and any(".[export,ort,bench]" in x for x in c)
    assert any(x.startswith("build_ort_ops") for x in c)  # the attention op: apt-get and cmake are on PATH
    assert "Requirement already satisfied" in (root / "build" / "setup.log").read_text()
    r = run("demo")  # idempotent: one line
    assert r.returncode == 0 and r.stdout.splitlines() == ["setup: .venv is up to date (demo)"] and calls() == []


def test_test_setup_adds_the_test_toolchain(sandbox):
    run, calls, _ = sandbox
    r = run("test")
    assert r.returncode == 0, r.stdout + r.stderr
    c = calls()
    assert any(x.startswith("apt-get install") and "qemu-user" in x for x in c), c
    assert any(".[dev]" in x for x in c) and any("torch==" in x for x in c)  # the demo's part too
    assert any(x.startswith("build_ort_ops") for x in c)
    assert all(ln.startswith("setup: ") for ln in r.stdout.splitlines()) and len(r.stdout.splitlines()) <= 14
    assert run().stdout.splitlines() == ["setup: .venv is up to date (test)"]  # no argument: everything
    assert run("demo").stdout.splitlines() == ["setup: .venv is up to date (demo)"]


def test_a_failing_step_names_the_log(sandbox):
    run, calls, root = sandbox
    r = run("demo", FAKE_FAIL="torch==")
    assert r.returncode == 1
    log = root / "build" / "setup.log"
    assert r.stdout.splitlines()[-1] == f"setup: PyTorch 2.13 (CPU build) ... FAILED (log: {log})"
    assert len(r.stderr.splitlines()) <= 15 and "noise" in r.stderr  # the log's last lines
    assert not list((root / ".venv").glob(".setup-*"))  # not stamped: the next run tries again


def test_readme_commands_set_up_their_level():
    assert "./scripts/setup.sh demo" in (ROOT / "scripts" / "demo.sh").read_text()
    assert "./scripts/setup.sh test" in (ROOT / "scripts" / "test.sh").read_text()


# -- scripts/build_ort_ops.sh: ONNX Runtime's headers from the machine's own apt configuration --------------------------

APT_STUB = """#!/bin/sh
echo "apt-get $*" >> "$FAKE_LOG"
case "$*" in
  *indextargets*) printf '%s\\n' "$FAKE_MIRROR Debian-Security" | sed 's/ Debian-Security$/-security\\/ Debian-Security/'
                  echo "$FAKE_MIRROR Debian"; exit 0;;
  *"download libonnxruntime-dev"*)
    case "$*" in *Dir::Etc::SourceList*) ;; *) [ -z "$FAKE_NOT_CONFIGURED" ] || exit 100;; esac
    : > libonnxruntime-dev_1.21.0_amd64.deb; exit 0;;
esac
exit 0
"""
DPKG_DEB_STUB = """#!/bin/sh
echo "dpkg-deb $*" >> "$FAKE_LOG"
mkdir -p "$3/usr/include/onnxruntime" && : > "$3/usr/include/onnxruntime/onnxruntime_c_api.h"
"""


@pytest.fixture
def ort_ops_sandbox(tmp_path):
    if Path("/usr/include/onnxruntime/onnxruntime_c_api.h").is_file():
        pytest.skip("libonnxruntime-dev is installed: the script takes its headers and downloads nothing")
    shutil.copy2(ROOT / "scripts" / "build_ort_ops.sh", (tmp_path / "scripts").mkdir() or tmp_path / "scripts")
    stubs = tmp_path / "stubs"
    _exe(stubs / "apt-get", APT_STUB)
    _exe(stubs / "dpkg-deb", DPKG_DEB_STUB)
    _exe(stubs / "cmake", NOISY.format(name="cmake"))
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_MIRROR": "http://mirror.invalid/debian"}
    env.pop("ORT_INCLUDE_DIR", None)
    env.pop("DFLASH2_ORT_HEADERS_SUITE", None)

    def run(**extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "build_ort_ops.sh")], capture_output=True, text=True,
                           env={**env, **extra}, timeout=60)
        return r, log.read_text().splitlines() if log.is_file() else []

    return run, tmp_path


def test_ort_headers_come_from_the_configured_apt_sources(ort_ops_sandbox):
    """Where the machine's apt sources carry libonnxruntime-dev, it is downloaded with the machine's configuration as
    it is (no source list of the script's own), unpacked, and CMake gets its headers."""
    run, root = ort_ops_sandbox
    r, calls = run()
    assert r.returncode == 0, r.stdout + r.stderr
    downloads = [c for c in calls if "download libonnxruntime-dev" in c]
    assert len(downloads) == 1 and "SourceList" not in downloads[0], calls
    assert not (root / "build" / "ort-headers" / "sources.list").exists()
    inc = root / "build" / "ort-headers" / "x" / "usr" / "include" / "onnxruntime"
    assert any(c.startswith("cmake -S plugins/ortDecodeAttention") and f"-DORT_INCLUDE_DIR={inc}" in c for c in calls)


def test_ort_headers_from_the_configured_mirror_where_its_suites_lack_them(ort_ops_sandbox):
    """Debian 12's suites have no onnxruntime: the package comes from another suite of the Debian mirror that the
    machine's apt configuration names (read with apt-get indextargets), through a private list; the script itself
    names no host."""
    run, root = ort_ops_sandbox
    r, calls = run(FAKE_NOT_CONFIGURED="1", DFLASH2_ORT_HEADERS_SUITE="forky")
    assert r.returncode == 0, r.stdout + r.stderr
    listed = (root / "build" / "ort-headers" / "sources.list").read_text()
    assert listed.split("] ", 1)[1].split() == ["http://mirror.invalid/debian", "forky", "main"], listed
    private = [c for c in calls if "Dir::Etc::SourceList=" in c]
    assert [c.split()[-1] for c in private] == ["update", "libonnxruntime-dev"], calls
    assert "taking it from forky of http://mirror.invalid/debian" in r.stderr


# Registry and mirror hosts, and pip's options that point at one: packages come from the machine's configured
# sources (pip's and apt's own configuration), never from a host the project names.
PACKAGE_HOST = re.compile(r"(?:[\w-]+\.)*(?:pypi\.org|pythonhosted\.org|pypi\.nvidia\.com|download\.pytorch\.org"
                          r"|debian\.org|ubuntu\.com|launchpad\.net|anaconda\.(?:org|com)|npmjs\.(?:org|com)"
                          r"|ghcr\.io|nvcr\.io|quay\.io|docker\.io|githubusercontent\.com)\b"
                          r"|--(?:extra-)?index-url\b|--find-links\b|--trusted-host\b|^\s*deb(?:-src)?\s+(?:\[[^]]*\]\s*)?\w+://",
                          re.I | re.M)


def test_no_package_host_in_the_project():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for f in files:
        if f.startswith(("tests/data/", "benchmarks/prompts/", "benchmarks/results/")) or f == "tests/test_setup_scripts.py":
            continue
        try:
            text = (ROOT / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{f}: {m.group(0).strip()}" for m in PACKAGE_HOST.finditer(text)]
    assert not bad, bad
    assert PACKAGE_HOST.search("echo 'deb [signed-by=k] http://mirror.example/debian trixie main'") is None  # a variable
    assert PACKAGE_HOST.search("deb http://ftp.debian.org/debian trixie main") is not None
    assert PACKAGE_HOST.search("pip install --index-url X torch") is not None
