"""The ONNX Runtime path in a minimal virtual environment: numpy, onnxruntime, tokenizers, jinja2 and the
project installed with --no-deps — no torch, no transformers. ``dflash2 generate --model-dir`` there must
reproduce the PyTorch reference. Needs PyPI (or pip's wheel cache); about a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNTIME_DEPS = ["numpy", "onnxruntime", "tokenizers", "jinja2"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    py = d / "bin" / "python"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [str(py), "-m", "pip", "install", "-q"]
    r = subprocess.run(pip + RUNTIME_DEPS, capture_output=True, text=True, env=env)
    if r.returncode:
        pytest.fail(f"pip install {' '.join(RUNTIME_DEPS)} failed:\n{r.stderr[-2000:]}")
    # the pure-Python install (its native parts: tests/test_wheel.py)
    r = subprocess.run(pip + ["--no-deps", "-Cwheel.cmake=false", str(REPO)], capture_output=True, text=True, env=env)
    if r.returncode:
        pytest.fail(f"pip install --no-deps {REPO} failed:\n{r.stderr[-2000:]}")
    return d


def test_generate_without_torch(venv, tiny_dir, tiny_export, capsys):
    py = venv / "bin" / "python"
    for mod in ("torch", "transformers"):
        r = subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = ["--prompt", "Hello world", "--max-new-tokens", "20", "--json", "--check-lossless", "--selector", "viterbi"]
    r = subprocess.run([str(venv / "bin" / "dflash2"), "generate", "--model-dir", str(tiny_export), "--backend", "ort",
                        *argv], capture_output=True, text=True, env=env, cwd=str(venv))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    # the installed copy really ran (not this checkout) and never loaded torch
    r2 = subprocess.run([str(py), "-c", "import sys, dflash2_trt.cli as c, dflash2_trt.runtime.ort.backend, "
                         "dflash2_trt.runtime.decoder; print(c.__file__); print('torch' in sys.modules)"],
                        capture_output=True, text=True, env=env, cwd=str(venv))
    assert str(venv) in r2.stdout.splitlines()[0] and r2.stdout.splitlines()[1] == "False"
    from dflash2_trt.cli import main

    assert main(["generate", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), *argv]) == 0
    want = json.loads(capsys.readouterr().out)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"] and got["stats"] == want["stats"]
    assert got["lossless"] is True


def test_readme_python_example_runs_without_torch(venv, tiny_export):
    """The README's "From Python" example, as printed there, against the tiny export, in the torch-free venv."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### From Python"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```")]
    assert "out/tiny/export" in code
    code = "import sys\n" + code.replace('"out/tiny/export"', repr(str(tiny_export))) + \
        "\nassert 'torch' not in sys.modules\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env,
                       cwd=str(venv))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ONNX Runtime" in r.stdout  # gen.note: TensorRT is not installed there


def test_triton_repo_without_torch(venv, tiny_export, tmp_path):
    """``dflash2 triton-repo`` in a torch-free install (+ the triton extra's tritonclient) writes the repository
    and prints how to serve it, importing nothing torch-side (it used to die on ``target.cache_dir``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "tritonclient[grpc]"],
                       capture_output=True, text=True, env=dict(env, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    repo = tmp_path / "repo"
    r = subprocess.run([str(venv / "bin" / "dflash2"), "triton-repo", str(tiny_export), "--triton-repo", str(repo)],
                       capture_output=True, text=True, env=env, cwd=str(venv))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote Triton model repository" in r.stdout and (repo / "dflash2" / "config.pbtxt").is_file()
    assert "bundled server" in r.stdout or "tritonserver" in r.stdout  # the hint, or why there is none
    assert "Traceback" not in r.stderr
