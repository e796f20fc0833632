"""The binary wheel as a user gets it: ``scripts/build_wheel.sh`` (``pip wheel`` + ``auditwheel repair``) from this
checkout, installed with its ``ort`` extra into a fresh virtual environment. There ``load()`` runs the tiny export
with the op library of the installed package (every GroupQueryAttention of the export rewritten to DecodeAttention),
libdflash2 loads from the installed package, and ``runtime/examples/generate.c`` built against the installed header
(pkg-config, and CMake's ``find_package(dflash2)``) decodes the tokens the Python runtime decodes.

Slow (the libraries compiled, a virtual environment with onnxruntime): marked ``wheel``, so the default run leaves
it out (pyproject's addopts); ``.ci/run`` runs it as its own step, ``./scripts/test.sh -m wheel``. Needs PyPI (or
pip's cache) for onnxruntime, onnx, scikit-build-core and auditwheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 2, 3]
MAX_NEW = 8

# run inside the fresh venv, from a folder outside the source tree: what the installed package reports
PROBE = """
import json, sys
import dflash2_trt, dflash2_trt.native as native
from dflash2_trt.runtime.ort import decode_attention as DA
if len(sys.argv) > 2:  # the planted bug: the package's lib/ is not searched
    native.LIB_DIR = native.PACKAGE / "nowhere"
with dflash2_trt.load(sys.argv[1], "ort", threads=1) as gen:
    tokens = gen.generate(%r, max_new_tokens=%d, temperature=0.0).tokens
    print(json.dumps({"package": dflash2_trt.__file__, "note": gen.note, "op_library": gen.op_library,
                      "library": str(DA.find_library()), "attention": gen._backend.attention_op, "tokens": tokens,
                      "installed": {k: str(v) for k, v in native.installed().items()}}))
""" % (PROMPT, MAX_NEW)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel() -> Path:
    r = _run(["bash", str(REPO / "scripts" / "build_wheel.sh")], cwd=REPO, timeout=1800)
    path = REPO / r.stdout.strip().splitlines()[-1].removeprefix("build_wheel: ")
    assert "-manylinux_" in path.name, path
    assert "is consistent" in r.stdout and "manylinux" in r.stdout  # auditwheel show's verdict
    names = zipfile.ZipFile(path).namelist()
    for f in ("lib/libdflash2.so", "lib/libdflash2_ort_ops.so", "include/dflash2/dflash2.h",
              "lib/cmake/dflash2/dflash2Config.cmake", "lib/pkgconfig/dflash2.pc"):
        assert f"dflash2_trt/{f}" in names, f
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("wheel") / "v"
    _run([sys.executable, "-m", "venv", str(d)])
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([str(d / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[ort]"], env=env, timeout=900)
    return d


def _probe(venv: Path, export: Path, *extra: str) -> dict:
    r = _run([str(venv / "bin" / "python"), "-c", PROBE, str(export), *extra], cwd=venv,
             env={k: v for k, v in os.environ.items() if k not in ("DFLASH2_ORT_OPS", "PYTHONPATH")})
    return json.loads(r.stdout.strip().splitlines()[-1])


def _gqa_nodes(export: Path) -> int:
    import onnx

    g = onnx.load(str(export / "target_ort.onnx"), load_external_data=False)
    return sum(n.op_type == "GroupQueryAttention" for n in g.graph.node)


def _check_fast_path(out: dict, venv: Path, export: Path) -> None:
    """The installed package (not the source tree) ran the export with its own op library."""
    site = str(venv / "lib")
    assert out["package"].startswith(site), out["package"]
    assert out["library"].startswith(site) and out["library"].endswith("dflash2_trt/lib/libdflash2_ort_ops.so")
    assert f"op library loaded from {out['library']}: it runs " in out["note"], out["note"]
    assert f"DecodeAttention {_gqa_nodes(export)}" in out["op_library"] and out["attention"] == "DecodeAttention"


def test_installed_wheel_decodes_with_its_op_library(venv, tiny_export):
    out = _probe(venv, tiny_export)
    _check_fast_path(out, venv, tiny_export)
    assert all(v != "None" and v.startswith(str(venv)) for v in out["installed"].values()), out["installed"]
    planted = _probe(venv, tiny_export, "plant")  # negative control: the package's lib/ not searched
    assert "op library not found" in planted["note"]
    with pytest.raises(AssertionError):  # the check above refuses the plain graph
        _check_fast_path(planted, venv, tiny_export)


def _c_tokens(exe: Path, venv: Path, export: Path) -> tuple[list[int], str]:
    r = _run([str(exe), str(export), *map(str, PROMPT), "-o", "backend=ort", "-o", f"max_new_tokens={MAX_NEW}",
              "-o", "threads=1"], env=dict(os.environ, VIRTUAL_ENV=str(venv)), cwd=venv)
    return [int(t) for ln in r.stdout.split("\n") for t in ln.split()], r.stderr


def test_c_library_and_its_header_from_the_wheel(venv, tiny_export, tmp_path):
    """libdflash2 loads from the installed package; examples/generate.c builds against the installed header with
    pkg-config and with find_package(dflash2), and decodes what the Python runtime decodes, with the package's op
    library."""
    py = str(venv / "bin" / "python")
    folder = {k: _run([py, "-m", "dflash2_trt.native", f"--{k}"], cwd=venv).stdout.strip() for k in ("pkgconfig", "cmake")}
    _run([py, "-c", "import ctypes, dflash2_trt.native as n; ctypes.CDLL(str(n.C_LIBRARY)).dfl2_model_load"],
         cwd=venv)
    want = _probe(venv, tiny_export)["tokens"]
    source = REPO / "runtime" / "examples" / "generate.c"
    if shutil.which("pkg-config") is None:
        pytest.fail("pkg-config not found (apt-get install pkg-config)")
    flags = _run(["pkg-config", "--cflags", "--libs", "dflash2"],
                 env=dict(os.environ, PKG_CONFIG_PATH=folder["pkgconfig"])).stdout.split()
    assert any(f.startswith("-I") and f.startswith(f"-I{venv}") for f in flags), flags
    exe = tmp_path / "generate_pc"
    _run(["cc", "-std=c99", "-Wall", "-Werror", "-o", str(exe), str(source), *flags])
    tokens, err = _c_tokens(exe, venv, tiny_export)
    assert tokens == want and "op library " in err and str(venv) in err.split("op library ", 1)[1], err
    (tmp_path / "cm").mkdir()
    (tmp_path / "cm" / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(generate C)\nfind_package(dflash2 1.0 REQUIRED)\n"
        f"add_executable(generate {source})\ntarget_link_libraries(generate PRIVATE dflash2::dflash2)\n")
    _run(["cmake", "-S", str(tmp_path / "cm"), "-B", str(tmp_path / "cm" / "b"), f"-Ddflash2_DIR={folder['cmake']}"])
    _run(["cmake", "--build", str(tmp_path / "cm" / "b")])
    assert _c_tokens(tmp_path / "cm" / "b" / "generate", venv, tiny_export)[0] == want


# the aarch64 wheel's libraries under qemu-user: each loads and answers (the op library's kernels: the portable ones)
ARM_PROBE = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
int main(int argc, char** argv)
{
    void* ops = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    void* lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!ops || !lib) { printf("dlopen: %s\n", dlerror()); return 1; }
    int32_t (*isa)(void) = (int32_t (*)(void)) dlsym(ops, "dflash2OrtKernelIsa");
    uint32_t (*ver)(void) = (uint32_t (*)(void)) dlsym(lib, "dfl2_api_version");
    printf("isa %d api 0x%x\n", isa ? isa() : -1, ver ? ver() : 0u);
    return 0;
}
"""


def test_aarch64_wheel_under_qemu(tmp_path, tiny_export):
    """``scripts/build_wheel.sh aarch64`` (Debian's cross compiler): a manylinux aarch64 wheel whose libraries load
    under qemu-user, and examples/generate.c cross-built against its header runs until it looks for ONNX Runtime
    (no aarch64 ONNX Runtime here: the line naming where it looked is libdflash2's, run to that point)."""
    for tool in ("aarch64-linux-gnu-gcc", "qemu-aarch64"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found (scripts/setup.sh test installs g++-aarch64-linux-gnu and qemu-user)")
    r = _run(["bash", str(REPO / "scripts" / "build_wheel.sh"), "aarch64"], cwd=REPO, timeout=1800)
    path = REPO / r.stdout.strip().splitlines()[-1].removeprefix("build_wheel: ")
    assert path.name.endswith("_aarch64.whl") and "-manylinux_" in path.name and "is consistent" in r.stdout, r.stdout
    zipfile.ZipFile(path).extractall(tmp_path / "w")
    pkg = tmp_path / "w" / "dflash2_trt"
    qemu = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]
    (tmp_path / "probe.c").write_text(ARM_PROBE)
    _run(["aarch64-linux-gnu-gcc", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c"), "-ldl"])
    out = _run([*qemu, str(tmp_path / "probe"), str(pkg / "lib" / "libdflash2_ort_ops.so"),
                str(pkg / "lib" / "libdflash2.so")]).stdout
    assert out.startswith("isa 0 api 0x1"), out  # 0: the portable (NEON) kernels
    exe = tmp_path / "generate"
    _run(["aarch64-linux-gnu-gcc", "-std=c99", "-Wall", "-Werror", "-o", str(exe),
          str(REPO / "runtime" / "examples" / "generate.c"), f"-I{pkg / 'include'}", f"-L{pkg / 'lib'}",
          f"-Wl,-rpath,{pkg / 'lib'}", "-ldflash2"])
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ORT_LIBRARY")}
    r = subprocess.run([*qemu, str(exe), str(tiny_export), "1", "2", "-o", "backend=ort", "-o", "verify_checksums=false"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "ONNX Runtime not found" in r.stderr, r.stderr
