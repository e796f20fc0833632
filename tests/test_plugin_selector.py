"""DFlash2PathSelector plugin (plugins/): CMake build, ctest, CPU twin vs NumPy reference, contract.

The first test configures and builds the CMake project (cached in ``build/plugins-tests``) against
the TensorRT headers of the ``kernel-lens`` wheel and runs ctest (shared-math unit test, the dlopen
test of ``libdflash2_plugins.so`` without TensorRT, its load paths (loadLibrary, dfl2PluginsInit, opt-in load-time
registration, another major) against a stand-in registry;
the GPU check is skipped without a GPU). Then the host twin ``libdflash2_selector_host.so`` — compiled
from the same math header as the kernel — is called through ctypes on fresh random inputs and compared
with :func:`dflash2_trt.reference.select_paths`. Finally the contract yaml, the ONNX op schema and the
creator's field list are pinned together.

Missing nvcc / cmake / kernel-lens make these tests FAIL with a message (the README setup installs
them). The build uses the project's default CUDA architectures (sm_75 ... sm_121 + PTX; about
2 minutes from clean on 2 cores, then cached); ``DFLASH2_TEST_CUDA_ARCHS=75`` (any CMake list) builds
fewer for a quicker edit-test loop.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash2_trt import reference as ref
from selector_oracles import brute_force_best_path

REPO = Path(__file__).resolve().parents[1]
BUILD_DIR = REPO / "build" / "plugins-tests"
CONTRACT_YAML = REPO / "plugins" / "pathSelector" / "dflash2PathSelector.yaml"
TEST_ARCHS = os.environ.get("DFLASH2_TEST_CUDA_ARCHS", "")  # "" = the project default list

ELEM = {"float32": 0, "float16": 1, "bfloat16": 2}
MODE = {"greedy": 0, "viterbi": 1}


# --------------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------------


def _find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def plugin_build() -> Path:
    """Configure (once) and build the CMake project; returns the build directory."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake not found: install CMake >= 3.24 (apt-get install cmake)")
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.fail("nvcc not found: install the CUDA toolkit (nvcc) to build plugins/")
    if importlib.util.find_spec("kernel_lens") is None:
        pytest.fail("TensorRT headers missing: python -m pip install kernel-lens (docs/tensorrt.md)")
    # the architecture choice is made before enable_language(CUDA): a different choice needs a
    # fresh build directory
    marker = BUILD_DIR / ".dflash2-test-archs"
    if marker.exists() and marker.read_text() != TEST_ARCHS:
        shutil.rmtree(BUILD_DIR)
    if not (BUILD_DIR / "CMakeCache.txt").exists():
        args = [
            cmake, "-S", str(REPO), "-B", str(BUILD_DIR),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DDFLASH2_TRT_HEADERS_FROM_PIP=ON",
            "-DDFLASH2_WERROR=ON",
            "-DDFLASH2_BUILD_RUNTIME=OFF",  # the C API runtime is built and tested by tests/test_capi.py
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
        ]  # fmt: skip
        if TEST_ARCHS:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={TEST_ARCHS}")
        _run(args, "cmake configure")
        marker.write_text(TEST_ARCHS)
    _run([cmake, "--build", str(BUILD_DIR), "-j2"], "cmake build")
    return BUILD_DIR


@pytest.fixture(scope="session")
def host_twin(plugin_build):
    lib = ctypes.CDLL(str(plugin_build / "lib" / "libdflash2_selector_host.so"))
    P, I = ctypes.c_void_p, ctypes.c_int32
    lib.dfl2SelectPathsHost.restype = I
    lib.dfl2SelectPathsHost.argtypes = [P] * 8 + [I] * 7 + [P] * 3
    lib.dfl2SelectorLatticeHost.restype = I
    lib.dfl2SelectorLatticeHost.argtypes = [P] * 6 + [I] * 6 + [P]
    return lib


def test_build_and_ctest(plugin_build):
    """The CMake build is warning-clean (-Werror) and every ctest passes (GPU check: skipped here)."""
    proc = _run(["ctest", "--test-dir", str(plugin_build), "--output-on-failure"], "ctest")
    assert "tests failed" not in proc.stdout.replace("0 tests failed", "")
    for name in ("selectorMath", "pluginHost", "registration_loadLibrary", "registration_init", "registration_static",
                 "registration_major"):
        assert name in proc.stdout


def test_plugin_library_needs_no_tensorrt(plugin_build):
    lib = plugin_build / "lib" / "libdflash2_plugins.so"
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "nvinfer" not in needed and "libcudart" not in needed, needed
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert {"getCreators", "setLoggerFinder"} <= names


# --------------------------------------------------------------------------------------------------
# Host twin vs NumPy reference
# --------------------------------------------------------------------------------------------------


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return ((b + rounding) >> np.uint32(16)).astype(np.uint16)


def _typed(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(buffer handed to the twin, float64 values the reference sees)."""
    if dtype == "float32":
        buf = np.ascontiguousarray(x, dtype=np.float32)
        return buf, buf.astype(np.float64)
    if dtype == "float16":
        buf = np.ascontiguousarray(x, dtype=np.float16)
        return buf, buf.astype(np.float64)
    bits = _to_bf16_bits(x)
    return bits, (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def _random_case(rng, B, L, K, r, V, dtype, *, dyadic=False):
    cand = np.stack([rng.choice(V, size=(L, K), replace=True) for _ in range(B)]).astype(np.int32)  # [B, L, K]
    if dyadic:
        # small integers / halves: fp32 represents and sums them exactly -> exact ties
        unary = -np.sort(-rng.integers(-2, 3, size=(B, L, K)), axis=-1).astype(np.float32)
        g = rng.integers(-2, 3, size=(B, L, r)) * 0.5
        A = rng.integers(-2, 3, size=(V, r)) * 0.5
        Bc = rng.integers(-2, 3, size=(V, r)) * 0.5
    else:
        unary = -np.sort(-2.0 * rng.normal(size=(B, L, K)), axis=-1).astype(np.float32)  # [B, L, K]
        g = rng.normal(size=(B, L, r))  # [B, L, r]
        A = rng.normal(size=(V, r)) / np.sqrt(r)  # [V, r]
        Bc = rng.normal(size=(V, r))  # [V, r]
    anchor = rng.integers(0, V, size=B).astype(np.int32)  # [B]
    g_buf, g64 = _typed(g, dtype)
    A_buf, A64 = _typed(A, dtype)
    B_buf, B64 = _typed(Bc, dtype)
    return cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64


def _run_twin(lib, cand, unary, g_buf, anchor, A_buf, B_buf, temps, uniforms, dtype, mode):
    B, L, K = cand.shape
    r = g_buf.shape[-1]
    V = A_buf.shape[0]
    ids = np.full((B, L), -7, np.int32)  # poisoned
    props = np.full((B, L, K), np.nan, np.float32)
    idx = np.full((B, L), -7, np.int32)
    temps = np.ascontiguousarray(temps, dtype=np.float32)
    uniforms = np.ascontiguousarray(uniforms, dtype=np.float32)
    status = lib.dfl2SelectPathsHost(
        _ptr(cand), _ptr(unary), _ptr(g_buf), _ptr(anchor), _ptr(A_buf), _ptr(B_buf), _ptr(temps), _ptr(uniforms),
        B, L, K, r, V, ELEM[dtype], MODE[mode], _ptr(ids), _ptr(props), _ptr(idx),
    )  # fmt: skip
    assert status == 0
    return ids, idx, props


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _decision_margins(S, mode, T, u, path):
    """Per-row robustness of the reference decisions along the reference path (float64).

    T <= 0: gap between the best and second-best option of the decision that picked path[t]
    (Viterbi: the final argmax and the back-pointers on the path, reported for every row).
    T > 0: distance of the uniform from the nearest cdf boundary of the row's proposal.
    """
    L, K, _ = S.shape
    margins = np.full(L, np.inf)

    def gap(v):
        if v.shape[0] < 2:
            return np.inf
        top = np.sort(v)[::-1]
        return top[0] - top[1]

    if T > 0:
        if mode == "greedy":
            rows = [S[t, 0 if t == 0 else path[t - 1]] / T for t in range(L)]
        else:
            X = S / T
            b = np.zeros((L, K))
            for t in range(L - 2, -1, -1):
                z = X[t + 1] + b[t + 1][None, :]
                m = z.max(axis=1)
                b[t] = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
            rows = [X[t, 0 if t == 0 else path[t - 1]] + b[t] for t in range(L)]
        for t in range(L):
            cdf = np.cumsum(_softmax(rows[t]))
            margins[t] = np.min(np.abs(cdf[:-1] - u[t])) if K > 1 else np.inf
        return margins
    if mode == "greedy":
        for t in range(L):
            margins[t] = gap(S[t, 0 if t == 0 else path[t - 1]])
        return margins
    delta = S[0, 0].copy()
    worst = np.inf
    deltas = [delta]
    for t in range(1, L):
        cand = delta[:, None] + S[t]
        delta = cand.max(axis=0)
        deltas.append(delta)
        worst = min(worst, gap(cand[:, path[t]]))
    worst = min(worst, gap(deltas[-1]))
    return np.full(L, worst)


def _compare(lib, rng, B, L, K, r, V, dtype, mode, temp_kind, *, dyadic=False, tol=1e-3):
    cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64 = _random_case(rng, B, L, K, r, V, dtype, dyadic=dyadic)
    if temp_kind == "zero":
        temps = np.zeros(B)
    elif temp_kind == "positive":
        temps = rng.uniform(0.3, 2.0, size=B)
    else:  # mixed: per-sequence argmax and sampling in one batch
        temps = np.where(rng.random(B) < 0.5, 0.0, rng.uniform(0.3, 2.0, size=B))
    temps = temps.astype(np.float32)
    uniforms = (rng.random((B, L)) * 0.999999).astype(np.float32)
    ids, idx, props = _run_twin(lib, cand, unary, g_buf, anchor, A_buf, B_buf, temps, uniforms, dtype, mode)
    r_ids, r_idx, r_props = ref.select_paths(
        cand, unary, g64, anchor, A64, B64, mode=mode, temperature=temps.astype(np.float64), uniforms=uniforms
    )
    compared = 0
    for b in range(B):
        S = ref.lattice(cand[b], unary[b], g64[b], int(anchor[b]), A64, B64)
        margins = _decision_margins(S, mode, float(temps[b]), uniforms[b].astype(np.float64), r_idx[b])
        # rows before the first near-tie decide the same prefix; later rows may legitimately differ
        robust = margins > (1e-4 if temps[b] > 0 else tol)
        n_ok = L if robust.all() else int(np.argmin(robust))
        np.testing.assert_array_equal(idx[b, :n_ok], r_idx[b, :n_ok], err_msg=f"seq {b} mode={mode} T={temps[b]}")
        np.testing.assert_array_equal(ids[b, :n_ok], r_ids[b, :n_ok])
        # a sampled row's proposal depends only on the previous choice, so row n_ok is comparable too
        n_prop = min(L, n_ok + 1) if temps[b] > 0 else n_ok
        np.testing.assert_allclose(props[b, :n_prop], r_props[b, :n_prop], atol=1e-4, rtol=0)
        compared += n_ok
    assert np.isfinite(props).all() and (ids >= 0).all()
    np.testing.assert_array_equal(ids, np.take_along_axis(cand, idx[..., None].astype(np.int64), -1)[..., 0])
    return compared, B * L


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
@pytest.mark.parametrize("temp_kind", ["zero", "positive", "mixed"])
def test_host_twin_matches_reference(host_twin, dtype, mode, temp_kind):
    """Fresh random inputs over many sizes: K < 16, r not a power of two, L = 1, V small and large."""
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rng = np.random.default_rng(seed)
    compared = total = 0
    for case in range(40):
        B = int(rng.integers(1, 5))
        L = int(rng.choice([1, 2, 3, 7, 15, 16, 24]))
        K = int(rng.choice([1, 2, 5, 8, 13, 16]))
        r = int(rng.choice([1, 3, 4, 31, 64, 100, 256, 257]))
        V = int(rng.integers(K, 600))
        c, t = _compare(host_twin, rng, B, L, K, r, V, dtype, mode, temp_kind)
        compared, total = compared + c, total + t
    # near-ties must stay rare, otherwise the comparison above proves little
    assert compared >= 0.9 * total, f"seed {seed}: only {compared}/{total} rows compared"


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_exact_ties_follow_lowest_index(host_twin, mode):
    """Dyadic inputs: fp32 and float64 agree exactly, so ties are real and the lowest index must win."""
    rng = np.random.default_rng(1234)
    ties_seen = 0
    for _ in range(60):
        B, L, K = int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(1, 17))
        r, V = int(rng.integers(1, 9)), int(rng.integers(2, 12))  # tiny vocab: repeated tokens, many ties
        cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64 = _random_case(
            rng, B, L, K, r, V, "float32", dyadic=True
        )
        temps = np.zeros(B, np.float32)
        uniforms = np.zeros((B, L), np.float32)
        ids, idx, props = _run_twin(host_twin, cand, unary, g_buf, anchor, A_buf, B_buf, temps, uniforms, "float32", mode)
        r_ids, r_idx, r_props = ref.select_paths(cand, unary, g64, anchor, A64, B64, mode=mode)
        np.testing.assert_array_equal(idx, r_idx)
        np.testing.assert_array_equal(ids, r_ids)
        np.testing.assert_array_equal(props, r_props)
        for b in range(B):
            S = ref.lattice(cand[b], unary[b], g64[b], int(anchor[b]), A64, B64)
            ties_seen += int(np.sum(S.max(axis=-1, keepdims=True) == S) > S.shape[0] * S.shape[1])
    assert ties_seen > 10


def test_viterbi_finds_the_best_path(host_twin):
    """T = 0 Viterbi equals exhaustive search on small lattices (dyadic: exact scores)."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        L, K, r, V = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 4, 9
        cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64 = _random_case(
            rng, 1, L, K, r, V, "float32", dyadic=True
        )
        _, idx, _ = _run_twin(
            host_twin, cand, unary, g_buf, anchor, A_buf, B_buf, np.zeros(1), np.zeros((1, L)), "float32", "viterbi"
        )
        S = ref.lattice(cand[0], unary[0], g64[0], int(anchor[0]), A64, B64)
        best, _ = brute_force_best_path(S)
        np.testing.assert_array_equal(idx[0], best)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_lattice_matches_reference(host_twin, dtype):
    rng = np.random.default_rng()
    for _ in range(10):
        B, L, K = int(rng.integers(1, 4)), int(rng.integers(1, 17)), int(rng.integers(1, 17))
        r, V = int(rng.integers(1, 300)), int(rng.integers(K, 400))
        cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64 = _random_case(rng, B, L, K, r, V, dtype)
        out = np.full((B, L, K, K), np.nan, np.float32)
        status = host_twin.dfl2SelectorLatticeHost(
            _ptr(cand), _ptr(unary), _ptr(g_buf), _ptr(anchor), _ptr(A_buf), _ptr(B_buf),
            B, L, K, r, V, ELEM[dtype], _ptr(out),
        )  # fmt: skip
        assert status == 0
        for b in range(B):
            S = ref.lattice(cand[b], unary[b], g64[b], int(anchor[b]), A64, B64)
            np.testing.assert_allclose(out[b], S, atol=2e-5 * (1 + np.abs(S).max()), rtol=0)


def test_host_twin_refuses_bad_arguments(host_twin):
    cand = np.zeros((1, 2, 17), np.int32)
    x = np.zeros(64, np.float32)
    ids, props = np.zeros(64, np.int32), np.zeros(64, np.float32)
    args = [_ptr(cand), _ptr(x), _ptr(x), _ptr(ids), _ptr(x), _ptr(x), _ptr(x), _ptr(x)]
    assert host_twin.dfl2SelectPathsHost(*args, 1, 2, 17, 1, 4, 0, 0, _ptr(ids), _ptr(props), None) != 0  # K > 16
    assert host_twin.dfl2SelectPathsHost(*args, 1, 2, 4, 1, 4, 0, 2, _ptr(ids), _ptr(props), None) != 0  # mode
    assert host_twin.dfl2SelectPathsHost(*args, 1, 2, 4, 1, 4, 3, 0, _ptr(ids), _ptr(props), None) != 0  # dtype


def test_out_of_range_ids_are_clamped(host_twin):
    """Ids index the codebooks: out-of-range ids read the nearest valid row, never outside."""
    rng = np.random.default_rng(3)
    V, r = 10, 8
    cand, unary, g_buf, g64, anchor, A_buf, A64, B_buf, B64 = _random_case(rng, 1, 3, 4, r, V, "float32")
    wild = cand.copy()
    wild[0, 0, 0], wild[0, 1, 2] = -5, V + 100
    wild_anchor = np.array([V + 3], np.int32)
    ids, idx, _ = _run_twin(
        host_twin, wild, unary, g_buf, wild_anchor, A_buf, B_buf, np.zeros(1), np.zeros((1, 3)), "float32", "greedy"
    )
    clamped = np.clip(wild, 0, V - 1)
    _, r_idx, _ = ref.select_paths(clamped, unary, g64, np.clip(wild_anchor, 0, V - 1), A64, B64)
    np.testing.assert_array_equal(idx, r_idx)
    np.testing.assert_array_equal(ids[0], wild[0, np.arange(3), idx[0]])  # ids pass through unchanged


# --------------------------------------------------------------------------------------------------
# Contract: yaml <-> ONNX op schema <-> creator field list
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def contract_yaml() -> dict:
    import yaml  # dev extra
    return yaml.safe_load(CONTRACT_YAML.read_text())


@pytest.fixture(scope="session")
def creator_contract(plugin_build) -> dict:
    exe = plugin_build / "plugins" / "tests" / "testPluginHost"
    lib = plugin_build / "lib" / "libdflash2_plugins.so"
    proc = _run([str(exe), str(lib), "--print-contract"], "testPluginHost --print-contract")
    return json.loads(proc.stdout)


ONNX_ATTR = {"INT": "int", "STRING": "string"}
ONNX_TYPE = {"tensor(int32)": "int32", "tensor(float)": "float32", "tensor(float16)": "float16",
             "tensor(bfloat16)": "bfloat16"}  # fmt: skip


def test_contract_yaml_matches_onnx_schema(contract_yaml):
    from dflash2_trt.export import selector_contract as sc

    schema = sc.register_schema()
    assert sc.register_schema() is not None  # idempotent
    y = contract_yaml
    assert (schema.name, schema.domain, schema.since_version) == (y["name"], y["onnx_domain"], y["onnx_since_version"])
    assert sc.PLUGIN_VERSION == y["version"] and sc.PLUGIN_NAMESPACE == y["namespace"]
    constraints = {c.type_param_str: sorted(ONNX_TYPE[t] for t in c.allowed_type_strs) for c in schema.type_constraints}
    for formal, spec in zip(schema.inputs, y["inputs"], strict=True):
        assert formal.name == spec["name"]
        assert constraints[formal.type_str] == sorted(spec["types"])
    for formal, spec in zip(schema.outputs, y["outputs"], strict=True):
        assert formal.name == spec["name"]
        assert constraints[formal.type_str] == sorted(spec["types"])
    # hidden_proj and both codebooks share one type parameter
    shared = {f.type_str for f in schema.inputs if f.name in ("hidden_proj", "pred_codebook", "succ_codebook")}
    assert len(shared) == 1
    attrs = {a["name"]: a for a in y["attributes"] + y["onnx_only_attributes"]}
    assert set(schema.attributes) == set(attrs)
    for name, a in schema.attributes.items():
        assert ONNX_ATTR[a.type.name] == attrs[name]["onnx_type"]
        assert a.required == attrs[name].get("required", False)
    assert tuple(next(a for a in y["attributes"] if a["name"] == "mode")["values"]) == sc.MODES
    assert next(a for a in y["attributes"] if a["name"] == "top_k")["range"] == [1, sc.MAX_TOP_K]
    assert next(a for a in y["attributes"] if a["name"] == "rank")["range"] == [1, sc.MAX_RANK]


def test_contract_yaml_matches_creator(contract_yaml, creator_contract):
    y, c = contract_yaml, creator_contract
    assert (c["name"], c["version"], c["namespace"]) == (y["name"], y["version"], y["namespace"])
    assert [(f["name"], f["type"]) for f in c["fields"]] == [(a["name"], a["trt_field_type"]) for a in y["attributes"]]
    assert c["nb_inputs"] == len(y["inputs"]) and c["nb_outputs"] == len(y["outputs"])
    expected = [sorted(io["types"]) for io in y["inputs"] + y["outputs"]]
    assert [sorted(t) for t in c["io_types"]] == expected


def test_selector_node_checks_in_an_onnx_model():
    import onnx
    from onnx import TensorProto, helper

    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.export import selector_contract as sc

    sc.register_schema()
    L, K, r, V = 15, 16, 8, 32
    ins = [
        helper.make_tensor_value_info("cand_ids", TensorProto.INT32, ["B", L, K]),
        helper.make_tensor_value_info("unary", TensorProto.FLOAT, ["B", L, K]),
        helper.make_tensor_value_info("hidden_proj", TensorProto.FLOAT16, ["B", L, r]),
        helper.make_tensor_value_info("anchor_ids", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("temperature", TensorProto.FLOAT, ["B"]),
        helper.make_tensor_value_info("uniforms", TensorProto.FLOAT, ["B", L]),
    ]
    inits = [
        helper.make_tensor("pred_codebook", TensorProto.FLOAT16, [V, r], np.zeros(V * r, np.float16).tobytes(), raw=True),
        helper.make_tensor("succ_codebook", TensorProto.FLOAT16, [V, r], np.zeros(V * r, np.float16).tobytes(), raw=True),
    ]
    outs = [
        helper.make_tensor_value_info("path_ids", TensorProto.INT32, ["B", L]),
        helper.make_tensor_value_info("proposal_probs", TensorProto.FLOAT, ["B", L, K]),
    ]
    node = sc.make_selector_node([n for n, _, _ in sc.INPUTS], [n for n, _, _ in sc.OUTPUTS], top_k=K, rank=r)
    graph = helper.make_graph([node], "selector", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), sc.opset_import()])
    onnx.checker.check_model(model, full_check=True)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"top_k": K, "rank": r, "mode": b"greedy", "plugin_version": b"1", "plugin_namespace": b""}
    for bad in ({"top_k": 17}, {"top_k": 0}, {"rank": 0}, {"mode": "beam"}):
        kw = {"top_k": K, "rank": r, "mode": "greedy"} | bad
        with pytest.raises(DFlash2Error):
            sc.make_selector_node([n for n, _, _ in sc.INPUTS], ["a", "b"], **kw)
    with pytest.raises(DFlash2Error):
        sc.make_selector_node(["x"], ["a", "b"], top_k=K, rank=r)


def test_gpu_check_builds_here(plugin_build):
    """The GPU check program is part of every build; without a GPU it says so and exits 77 (skip)."""
    script = REPO / "plugins" / "tests" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    exe = plugin_build / "plugins" / "tests" / "gpuCheck"
    assert exe.exists()
    proc = subprocess.run([str(exe), "--quick", "--no-timing"], capture_output=True, text=True, timeout=600)
    if proc.returncode == 77:
        assert "no CUDA device" in proc.stdout
    else:  # a GPU is present: the quick correctness pass must succeed
        assert proc.returncode == 0, proc.stdout + proc.stderr
