"""scripts/setup.sh as a newcomer meets it: the demo's set-up installs only what the demo needs, the test set-up
adds the test toolchain (apt included), one line per step, a log file named on failure, re-runs are one line.

Run on a copy of the scripts with a stand-in ``.venv/bin/python`` (records its arguments, prints pip-like noise)
and stand-in ``dpkg`` / ``id`` / ``apt-get`` / ``scripts/build_ort_ops.sh`` on PATH (every C API package missing, running as root): nothing is
installed."""

from __future__ import annotations

import os
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
