"""The GPU check scripts on the CPU: plugins/tests/gpu_check.sh (GPU without TensorRT) and
benchmarks/trt_gpu_check.sh / .py (GPU with TensorRT) — argument handling, header extraction from the
kernel-lens wheel, the refusal without a GPU, and the full -Werror build for sm_90 (~60 s on 2 cores; needs
nvcc and cmake). What needs a GPU runs only there; these make sure the scripts get that far."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "plugins" / "tests" / "gpu_check.sh"
TRT_CHECK = REPO / "benchmarks" / "trt_gpu_check.sh"


def _run(script: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel-shaped zip of the installed kernel-lens headers (the GPU machine gets the real wheel file)."""
    spec = importlib.util.find_spec("kernel_lens")
    assert spec is not None and spec.submodule_search_locations, "kernel-lens is installed by scripts/setup.sh"
    root = Path(spec.submodule_search_locations[0])
    out = tmp_path_factory.mktemp("wheel") / "kernel_lens-2.0.1-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for f in sorted((root / "include" / "tensorrt").glob("*.h")):
            zf.write(f, f"kernel_lens/include/tensorrt/{f.name}")
    return out


def test_gpu_check_usage_errors(tmp_path):
    r = _run(GPU_CHECK, "--help")
    assert r.returncode == 0 and "--kernel-lens WHEEL" in r.stdout and "NOT" not in r.stderr
    for args, msg in ((["--bogus"], "unknown option --bogus"),
                      ([], "pass --kernel-lens"),
                      (["--kernel-lens", str(tmp_path / "missing.whl")], "kernel-lens wheel not found"),
                      (["--kernel-lens", "x.whl", "--arch", "sm90"], "--arch needs a CUDA architecture"),
                      (["--budget-s", "soon"], "--budget-s needs a number")):
        r = _run(GPU_CHECK, *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line
        assert r.stderr.startswith("gpu_check: ") and msg in r.stderr
    bad = tmp_path / "not_a.whl"
    bad.write_bytes(b"plain text")
    r = _run(GPU_CHECK, "--kernel-lens", str(bad), "--build-dir", str(tmp_path / "b"), "--headers-only")
    assert r.returncode == 2 and "not a wheel (zip) file" in r.stderr
    empty = tmp_path / "other.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other/__init__.py", "")
    r = _run(GPU_CHECK, "--kernel-lens", str(empty), "--build-dir", str(tmp_path / "b"), "--headers-only")
    assert r.returncode == 2 and "has no kernel_lens/include/tensorrt/NvInferRuntime.h" in r.stderr


def test_gpu_check_headers_dry_run_and_no_gpu(wheel, tmp_path):
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--build-dir", str(tmp_path / "b"), "--headers-only")
    assert r.returncode == 0, r.stderr
    assert "TensorRT 10.14.1 headers in" in r.stdout and (tmp_path / "b/trt-headers/NvInferRuntime.h").is_file()
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--arch", "89", "--no-sanitizer", "--dry-run")
    assert r.returncode == 0 and "-DCMAKE_CUDA_ARCHITECTURES=89" in r.stdout and "sanitizer: off" in r.stdout
    assert "-DDFLASH2_WERROR=ON" in r.stdout
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--no-werror", "--log-dir", str(tmp_path / "out"), "--dry-run")
    assert r.returncode == 0 and "-DDFLASH2_WERROR=OFF" in r.stdout and "out/gpu-check-logs.tar.gz" in r.stdout
    # a machine without nvidia-smi: one line, exit 1, before anything is built
    no_gpu = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--build-dir", str(tmp_path / "c"), path=no_gpu)
    assert r.returncode == 1 and "no NVIDIA GPU visible" in r.stderr and not (tmp_path / "c/cmake").exists()


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cmake")), reason="needs nvcc and cmake")
def test_gpu_check_build_only_compiles_everything_for_sm90_with_werror(wheel, tmp_path):
    """The exact build the GPU machine runs (wrapper project, sm_90, warnings as errors), and its verdict
    table, which must say that TensorRT itself was not exercised."""
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--build-dir", str(tmp_path / "b"), "--build-only")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| build plugins/ for sm_90, -Werror | PASS |" in r.stdout
    assert "**NOT EXERCISED**" in r.stdout and "TensorRT itself" in r.stdout
    for exe in ("gpuCheck", "pluginGpuCheck", "testPluginHost", "testRegistration"):
        assert (tmp_path / "b/cmake/plugins/tests" / exe).is_file()
    assert (tmp_path / "b/cmake/lib/libdflash2_plugins.so").is_file()
    assert (tmp_path / "b/verdict.md").read_text().startswith("### DFlash2 GPU check without TensorRT")
    # without a GPU the GPU programs skip (77), they do not pass
    r = subprocess.run([str(tmp_path / "b/cmake/plugins/tests/pluginGpuCheck"),
                        str(tmp_path / "b/cmake/lib/libdflash2_plugins.so")], capture_output=True, text=True)
    assert r.returncode == 77 and "no CUDA device" in r.stdout
    # every later step's plumbing, GPU probe off (same build folder: the rebuild is a no-op): a GPU program
    # that finds no device is a FAIL row, not a pass; the host ctests pass; the table is complete
    out = tmp_path / "out"
    r = _run(GPU_CHECK, "--kernel-lens", str(wheel), "--build-dir", str(tmp_path / "b"), "--no-gpu-probe",
             "--no-sanitizer", "--python", sys.executable, "--log-dir", str(out))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    result = {ln.split(" | ")[0][2:]: ln.split(" | ")[1] for ln in table[1:]}
    assert result["selector kernel = CPU twin (greedy, Viterbi, sampling, ties)"] == "FAIL"
    assert result["selector timing at B = 1 (target < 5 us)"] == "FAIL"
    assert result["plugin .so: creator as the ONNX parser calls it, enqueue eager + graph replay = twin"] == "FAIL"
    assert result["host ctests (twin math, plugin host, registration, major check)"] == "PASS"
    assert result["runtime CUDA layer (cuda_api, device KV, graphs, failed capture)"] == "SKIP"
    assert result["compute-sanitizer racecheck"] == "SKIP" and "--no-sanitizer" in r.stdout
    assert len(table) == 12 and "3 failing step(s)" in r.stdout
    # --log-dir: two files (a device run returns few), every log inside the one tarball
    import tarfile

    assert sorted(f.name for f in out.iterdir()) == ["gpu-check-logs.tar.gz", "verdict.md"]
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tf:
        names = set(tf.getnames())
    assert {"verdict.md", "logs/build.log", "logs/gpuCheck.log", "logs/ctest.log", "logs/cuda_layer.log"} <= names


def test_trt_gpu_check_usage_and_helpers(tmp_path, wheel):
    r = _run(TRT_CHECK, "--help")
    assert r.returncode == 0 and "--trt-include DIR" in r.stdout
    r = _run(TRT_CHECK, "--work", str(tmp_path))
    assert r.returncode == 2 and "pass --kernel-lens WHEEL" in r.stderr
    r = _run(TRT_CHECK, "--kernel-lens", str(wheel), "--dry-run", "--", "--prompts", "2")
    assert r.returncode == 0 and "extra: --prompts 2" in r.stdout
    spec = importlib.util.spec_from_file_location("trt_gpu_check", REPO / "benchmarks" / "trt_gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # importable without TensorRT
    assert mod.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert mod.first_divergence([1, 2, 3], [1, 5, 3]) == 1 and mod.first_divergence([1, 2], [1, 2, 4]) == 2
    import numpy as np

    assert mod.top2_margin(np.array([0.5, 3.0, 2.75, -1.0], np.float32)) == pytest.approx(0.25)
    # near-ties (margin < 1e-4 x max|logit|) decide nothing: a divergence there is reported, not failed
    tie = np.array([20.0, 20.0 + 1e-4, -3.0], np.float32)
    assert mod.near_tie(tie) and not mod.near_tie(np.array([20.0, 19.9, -3.0], np.float32))
    clear = np.array([1.0, 5.0, 0.0], np.float32)
    assert mod.verdict([1, 2], [1, 2], [clear, clear]) == ("same", None)
    assert mod.verdict([1, 0, 4], [1, 1, 2], [clear, tie, clear]) == ("tie", 1)
    assert mod.verdict([1, 0], [1, 1], [clear, clear]) == ("diverged", 1)


def _gpu_check_module():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("trt_gpu_check", REPO / "benchmarks" / "trt_gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trt_gpu_check_head_on_feeds_one_block_output(tiny_export, tmp_path):
    """head_on (check 5: both heads on identical inputs) runs a head engine alone on a given hidden buffer:
    on the block output a propose() just made, it returns that propose's draft (FakeTrt engines computing
    with ONNX Runtime)."""
    import numpy as np

    from dflash2_trt.export import engines as E
    from dflash2_trt.runtime.trt.backend import TrtBackend
    from trt_fakes import FakeCuda, FakeTrt

    d = tmp_path / "exp"
    shutil.copytree(tiny_export, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    cuda = FakeCuda()
    mod = _gpu_check_module()
    with TrtBackend(d, trt_module=FakeTrt(cuda, compute=True), api=cuda) as be:
        rng = np.random.default_rng(0)
        for mode, temp in (("greedy", 0.0), ("viterbi", 0.8)):
            dr = be.draft_runner(mode)
            dr.add_context(rng.standard_normal((12, 128)).astype(np.float32), 0)
            u = rng.random((1, dr.L), dtype=np.float32) if temp > 0 else None
            want = dr.propose(5, 12, dr.L, temp, u)
            got = mod.head_on(dr, dr.bio["hidden"].dev, 5, temp, u)
            assert np.array_equal(got.cand, want.cand) and np.array_equal(got.tokens, want.tokens)
            np.testing.assert_array_equal(got.proposal, want.proposal)
