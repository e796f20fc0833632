"""Static checks of the TensorRT / CUDA code (no GPU, no TensorRT libraries needed).

* mypy (tests/mypy_trt.ini: typed defs, no implicit Any returns) over the TensorRT / CUDA modules against
  ``tensorrt-stubs`` and the focused cudart stub in ``typings/cuda``;
* a probe with deliberate misuse must fail the same check (so the stubs are really in use);
* ``typings/cuda/bindings/runtime.pyi`` is pinned to the installed ``cuda.bindings.runtime``: every stubbed
  function exists with the same parameter names, every enum member with the same value.

tensorrt-stubs 10.13.0.35.1 does not parse as published (parameters named ``in``, a non-default parameter
after defaults, an import of the absent ``tensorrt_libs``); :func:`_stub_dir` repairs a copy mechanically.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["dflash2_trt/runtime/trt/cuda_api.py", "dflash2_trt/runtime/trt/cuda_graphs.py",
           "dflash2_trt/runtime/trt/device_buffers.py", "dflash2_trt/runtime/trt/backend.py",
           "dflash2_trt/export/engines.py", "dflash2_trt/runtime/trt/env.py",
           "benchmarks/trt_gpu_check.py", "plugins/tests/cuda_layer_check.py"]  # the GPU checks too
STUB = ROOT / "typings" / "cuda" / "bindings" / "runtime.pyi"


def _require(module: str):  # noqa: ANN202
    """The dev extra installs these; a missing one is a set-up failure, not a reason to skip."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: run ./scripts/setup.sh (dev extra)")


def _stub_dir(tmp: Path) -> Path:
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is None or spec.origin is None:
        pytest.fail("tensorrt-stubs not installed (./scripts/setup.sh installs it: "
                    "pip install --no-deps tensorrt-stubs==10.13.0.35.1)")
    site = Path(spec.origin).parent.parent
    out = tmp / "trt-stubs"
    for pkg in ("tensorrt", "tensorrt_bindings"):
        shutil.copytree(site / pkg, out / pkg, ignore=shutil.ignore_patterns("*.py", "*.so", "__pycache__"))
    for p in out.rglob("*.pyi"):
        s = p.read_text()
        s = re.sub(r"(?m)^(\s*def [^\n]*?[(,] )in: ", r"\1in_: ", s)
        s = s.replace(", channel_axis: int)", ", channel_axis: int = ...)")
        s = s.replace("import tensorrt_libs as tensorrt_libs\n", "")
        ast.parse(s, filename=str(p))  # the repaired stub must parse, else this test needs updating
        p.write_text(s)
    return out


def _mypy(tmp: Path, files: list[str]) -> subprocess.CompletedProcess:
    _require("mypy")
    env = {"MYPYPATH": str(_stub_dir(tmp)), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "tests/mypy_trt.ini",
                           "--cache-dir", str(ROOT / ".mypy_cache" / "trt"), *files], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_mypy_trt_and_cuda_modules(tmp_path):
    r = _mypy(tmp_path, CHECKED)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"no issues found in {len(CHECKED)} source files" in r.stdout


def test_mypy_catches_misuse(tmp_path):
    probe = ROOT / "dflash2_trt" / "runtime" / "_mypy_probe_tmp.py"
    probe.write_text(
        "from __future__ import annotations\n"
        "import tensorrt as trt\n"
        "from cuda.bindings import runtime as rt\n"
        "def f(ctx: trt.IExecutionContext, cfg: trt.IBuilderConfig) -> None:\n"
        "    ctx.execute_async_v3('stream')\n"
        "    cfg.set_flag(3)\n"
        "    rt.cudaMalloc('16')\n"
        "    rt.cudaStreamBeginCapture(0, 1)\n")
    try:
        r = _mypy(tmp_path, [str(probe.relative_to(ROOT))])
    finally:
        probe.unlink()
    assert r.returncode == 1, r.stdout
    for line in (5, 6, 7, 8):
        assert f"_mypy_probe_tmp.py:{line}: error" in r.stdout, r.stdout


def test_cudart_stub_matches_installed_cuda_bindings():
    real = _require("cuda.bindings.runtime")
    tree = ast.parse(STUB.read_text())
    n_funcs = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            fn = getattr(real, node.name, None)
            assert fn is not None, f"cuda.bindings.runtime has no {node.name}"
            want = [a.arg for a in node.args.args]
            assert list(inspect.signature(fn).parameters) == want, node.name
            n_funcs += 1
        elif isinstance(node, ast.ClassDef):
            cls = getattr(real, node.name, None)
            assert cls is not None, f"cuda.bindings.runtime has no {node.name}"
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant):
                    name = item.targets[0].id  # type: ignore[attr-defined]
                    assert int(getattr(cls, name)) == item.value.value, f"{node.name}.{name}"
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id != "_Stream":
            assert hasattr(real, node.target.id), node.target.id
    assert n_funcs >= 20
    # every cudart call in cuda_api.py is stubbed (so mypy checks each of them)
    used = set(re.findall(r"rt\.(cuda[A-Za-z0-9]+)\(", (ROOT / "dflash2_trt/runtime/trt/cuda_api.py").read_text()))
    stubbed = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert used and used <= stubbed, used - stubbed


def test_cuda_runtime_without_a_gpu_is_one_clear_error():
    _require("cuda.bindings.runtime")
    from dflash2_trt.runtime.trt.cuda_api import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA device is present")
    assert reason.startswith("CUDA is not usable here: cudaError") and "\n" not in reason
