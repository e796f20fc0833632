"""Engine building (dflash2-export build-engines / --engines): the CPU-checkable parts.

The real build needs TensorRT and a GPU (never run here). Checked here: precision plan per TensorRT version,
optimization profiles from the manifest, the one-line failure without TensorRT (export left intact), and
the build orchestration + manifest update against the recording FakeTrt (it builds nothing real)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.export import engines as E
import dataclasses

from dflash2_trt.manifest import GraphSpec, TensorSpec, parse_engine_set, read_manifest
from trt_fakes import FakeCuda, FakeTrt


def _snapshot(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def export_copy(tiny_export, tmp_path):
    out = tmp_path / "exp"
    shutil.copytree(tiny_export, out)
    return out


def test_precision_plan_by_version_and_dtype():
    assert E.precision_plan("10.3.0.26", "fp32") == E.PrecisionPlan(True, (), ("TF32",))
    assert E.precision_plan("10.13.0.35", "fp16", weak_typing=True) == E.PrecisionPlan(False, ("FP16",), ("TF32",))
    assert E.precision_plan("10.8.0", "bf16", weak_typing=True).set_flags == ("BF16",)
    assert E.precision_plan("10.8.0", "fp32", weak_typing=True).set_flags == ()
    assert E.precision_plan("11.1.0", "fp16") == E.PrecisionPlan(True, (), ("TF32",))
    assert E.precision_plan("11.1.0", "fp32", tf32=True).clear_flags == ()
    with pytest.raises(DFlash2Error, match="always strongly typed"):
        E.precision_plan("11.0.0", "fp16", weak_typing=True)


def test_profiles_cover_every_dynamic_input(tiny_export):
    m = read_manifest(tiny_export, verify_checksums=False)  # bs 16, max_seq_len 512, step 256
    tp = E.profiles_for(m, "target", 256)
    assert [p.name for p in tp] == ["prefill", "step"]
    # a dense target's profiles in full (no state dims: those are a hybrid target's, tests/test_trt_hybrid.py)
    assert tp[0].dims == {"batch": (1, 1, 1), "sequence": (1, 128, 256), "capacity": (256, 512, 512),
                          "capacity_plus_sequence": (257, 640, 768)}
    assert tp[1].dims == {"batch": (1, 1, 1), "sequence": (1, 16, 16), "capacity": (256, 512, 512),
                          "capacity_plus_sequence": (257, 528, 528)}
    shapes = E.input_shapes(m.graphs["target"], tp[1].dims)
    assert shapes["input_ids"] == ((1, 1), (1, 16), (1, 16))
    # capacity opt: the bucket of a typical length (TYPICAL_POSITIONS, here capped by the 512 exported)
    assert shapes["attention_mask"] == ((1, 257), (1, 528), (1, 528))
    assert shapes["past_key_values.0.key"] == ((1, 2, 256, 16), (1, 2, 512, 16), (1, 2, 512, 16))
    long = dataclasses.replace(m, max_seq_len=4000)  # capacity 4096: opt at the 1024 bucket, not the smallest
    assert E.profiles_for(long, "target", 256)[1].dims["capacity"] == (256, 1024, 4096)
    assert E.input_shapes(m.graphs["target"], tp[0].dims)["input_ids"][2] == (1, 256)
    for key in E.graph_keys(m, "both"):
        for p in E.profiles_for(m, key, 64):
            E.input_shapes(m.graphs[key], p.dims)  # raises if a dynamic dim is not covered
    blk = E.input_shapes(m.graphs["drafter_block"], E.profiles_for(m, "drafter_block", 64)[0].dims)
    assert blk["context_mask"] == ((1, 256), (1, 512), (1, 512))
    head = E.input_shapes(m.graphs["drafter_head_greedy_plugin"],
                          E.profiles_for(m, "drafter_head_greedy_plugin", 64)[0].dims)
    assert head["hidden"] == ((1, 16, 64),) * 3
    assert E.graph_keys(m, "plugin")[3:] == ["drafter_head_greedy_plugin", "drafter_head_viterbi_plugin"]
    v1 = dataclasses.replace(m, graphs={k: g for k, g in m.graphs.items() if "greedy" not in k and "viterbi" not in k})
    with pytest.raises(DFlash2Error, match="without the candidate selector .*--no-selector"):
        E.graph_keys(v1, "plugin")
    with pytest.raises(DFlash2Error, match="no optimization profile covers"):
        E.input_shapes(GraphSpec("x.onnx", "target", inputs=(TensorSpec("x", "float32", ("mystery",)),)),
                       {"batch": (1, 1, 1)})


def test_build_engines_without_tensorrt_is_one_line_and_leaves_export(export_copy, capsys):
    from dflash2_trt.cli import main

    before = _snapshot(export_copy)
    assert main(["build-engines", str(export_copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dflash2: error: engines not built: TensorRT is not installed")
    assert "intact" in err
    assert _snapshot(export_copy) == before
    read_manifest(export_copy)  # still a valid export, checksums included


def test_export_with_engines_flag_keeps_the_onnx_export(tiny_dir, tmp_path, capsys):
    from dflash2_trt.cli import export_main as main

    out = tmp_path / "exp"
    rc = main(["--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out", str(out),
               "--max-seq-len", "64", "--no-verify", "--quiet", "--engines"])
    cap = capsys.readouterr()
    assert rc == 1
    assert [ln for ln in cap.err.splitlines() if ln.strip()] == [ln for ln in cap.err.splitlines() if "error" in ln]
    assert "TensorRT is not installed" in cap.err and len(cap.err.strip().splitlines()) == 1
    m = read_manifest(out)  # the ONNX export was written and is complete
    assert m.engines is None and (out / "target.onnx").is_file()


def _build(export_dir, tmp_path, **kw):
    plugin = tmp_path / "libdflash2_plugins.so"
    plugin.write_bytes(b"\x7fELF fake plugin bytes")
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    entry = E.build_engines(export_dir, plugin=plugin, progress=False, trt_module=trt, api=cuda, **kw)
    return entry, trt, plugin


def test_build_orchestration_with_fake_tensorrt(export_copy, tmp_path):
    onnx_before = {k: v for k, v in _snapshot(export_copy).items() if k != "manifest.json"}
    entry, trt, plugin = _build(export_copy, tmp_path)
    assert trt.loaded_plugins == [str(plugin)]  # loaded before any parse
    assert [b["file"].rsplit("/", 1)[-1] for b in trt.builds] == [
        "target.onnx", "drafter_context.onnx", "drafter_block.onnx", "drafter_head_greedy.plugin.onnx",
        "drafter_head_viterbi.plugin.onnx"]
    for b in trt.builds:
        assert b["flags"] == 1 << 1  # STRONGLY_TYPED on 10.x
        assert b["set"] == [] and b["cleared"] == ["TF32"]
        assert all(set(p) == set(b["inputs"]) for p in b["profiles"])  # every input in every profile
    tgt = trt.builds[0]
    assert len(tgt["profiles"]) == 2 and tgt["profiles"][1]["input_ids"] == [[1, 1], [1, 16], [1, 16]]
    # manifest: identity, plans, plugin copy, checksums of the new files; the ONNX export untouched
    m = read_manifest(export_copy)
    assert m.engines == entry
    assert entry.tensorrt_version == "10.13.0.35" and (entry.gpu.name, entry.gpu.compute_capability) == (
        "FakeGPU H0", "9.0")
    assert entry.plugin is not None and entry.plugin.sha256 == E.sha256_file(plugin)
    d = entry.dir
    assert {f"{d}/target.plan", f"{d}/timing.cache", f"{d}/libdflash2_plugins.so"} <= set(m.files)
    after = _snapshot(export_copy)
    assert all(after[k] == v for k, v in onnx_before.items())
    assert not [p for p in export_copy.iterdir() if p.name.startswith(".")]  # no temp leftovers
    # a rebuild replaces the engines folder and carries the timing cache over
    entry2, trt2, _ = _build(export_copy, tmp_path, selector="decomposed")
    assert entry2.dir != d and not (export_copy / d).exists()
    assert set(entry2.plans) == {"target", "drafter_context", "drafter_block", "drafter_head_greedy",
                                 "drafter_head_viterbi"}
    assert entry2.plugin is None
    m2 = read_manifest(export_copy)
    assert not [k for k in m2.files if k.startswith(f"{d}/")]


def test_weak_typing_flags_and_missing_plugin(export_copy, tmp_path, monkeypatch):
    monkeypatch.delenv(E.PLUGIN_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(E, "_REPO", tmp_path)
    cuda = FakeCuda()
    with pytest.raises(DFlash2Error, match="needs libdflash2_plugins.so"):
        E.build_engines(export_copy, progress=False, trt_module=FakeTrt(cuda), api=cuda)
    entry, trt, _ = _build(export_copy, tmp_path, weak_typing=True, selector="decomposed")
    assert all(b["flags"] == 0 and b["set"] == [] for b in trt.builds)  # fp32 export: no precision flag
    assert entry.strongly_typed is False


def test_max_batch_gives_the_target_engine_a_batch_dimension(export_copy, tmp_path, tiny_export, capsys):
    """--max-batch N: the target engine's profiles take 1..N sequences (opt N for steps, 1 for prefills), every other
    engine stays at batch 1; N is recorded as the profiles' batch dim (EngineSet.max_batch reads it back, no new
    manifest field: manifests from before the option read as 1, and old readers accept the new ones)."""
    m = read_manifest(tiny_export, verify_checksums=False)
    assert [p.dims["batch"] for p in E.profiles_for(m, "target", 256)] == [(1, 1, 1), (1, 1, 1)]  # the default
    pre, step = E.profiles_for(m, "target", 256, max_batch=4)
    assert (pre.dims["batch"], step.dims["batch"]) == ((1, 1, 4), (1, 4, 4))
    shapes = E.input_shapes(m.graphs["target"], step.dims)
    assert shapes["input_ids"] == ((1, 1), (4, 16), (4, 16))
    assert shapes["attention_mask"] == ((1, 257), (4, 528), (4, 528))  # one capacity for the call, ragged lengths
    assert shapes["past_key_values.0.key"] == ((1, 2, 256, 16), (4, 2, 512, 16), (4, 2, 512, 16))
    assert E.input_shapes(m.graphs["target"], pre.dims)["input_ids"] == ((1, 1), (1, 128), (4, 256))
    for key in E.graph_keys(m, "both")[1:]:
        assert all(p.dims["batch"] == (1, 1, 1) for p in E.profiles_for(m, key, 256, max_batch=4)), key
    with pytest.raises(DFlash2Error, match="--max-batch must be >= 1, got 0"):
        E.profiles_for(m, "target", 256, max_batch=0)

    entry, trt, _ = _build(export_copy, tmp_path, selector="decomposed", max_batch=4)
    tgt = trt.builds[0]
    assert tgt["profiles"][1]["input_ids"] == [[1, 1], [4, 16], [4, 16]]
    assert tgt["profiles"][0]["past_key_values.0.key"][2][0] == 4
    assert all(dims[2][0] == 1 for b in trt.builds[1:] for p in b["profiles"] for dims in p.values())
    assert entry.max_batch == 4 and read_manifest(export_copy).engines.max_batch == 4
    raw = json.loads((export_copy / "manifest.json").read_text())["engines"]
    assert "max_batch" not in raw and raw["plans"]["target"]["profiles"][1]["dims"]["batch"] == [1, 4, 4]
    old = dict(raw, plans={k: {**v, "profiles": [dict(p, dims={d: r for d, r in p["dims"].items() if d != "batch"})
                                                 for p in v["profiles"]]} for k, v in raw["plans"].items()})
    assert parse_engine_set(old).max_batch == 1  # profiles without a batch dim: B = 1
    entry1, _, _ = _build(export_copy, tmp_path, selector="decomposed")
    assert entry1.max_batch == 1
    with pytest.raises(DFlash2Error, match="--max-batch must be >= 1"):
        _build(export_copy, tmp_path, selector="decomposed", max_batch=0)

    from dflash2_trt.cli import main

    assert main(["build-engines", "DIR", "--max-batch", "0"]) == 1  # the parser refuses it (one line)
    assert "--max-batch" in capsys.readouterr().err


def test_build_engines_cli_help_and_bad_selector(capsys):
    from dflash2_trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["build-engines", "--help"])
    assert e.value.code == 0 and "--selector" in capsys.readouterr().out
    assert main(["build-engines", "DIR", "--selector", "nope"]) == 1
    assert "invalid choice" in capsys.readouterr().err


def test_identity_mismatch_messages():
    from dflash2_trt.runtime.trt.env import check_engine_identity

    entry = parse_engine_set({"dir": "engines-x", "tensorrt_version": "10.13.0.35", "plans": {},
                              "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
                              "plugin": {"file": "engines-x/libdflash2_plugins.so", "sha256": "ab" * 32}})
    here = {"tensorrt_version": "10.13.0.35", "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"}}
    check_engine_identity(entry, here, "ab" * 32)
    with pytest.raises(DFlash2Error, match=r"built with TensorRT 10\.13\.0\.35, this is TensorRT 10\.3\.0\.30.*"
                                           r"build-engines"):
        check_engine_identity(entry, dict(here, tensorrt_version="10.3.0.30"), "ab" * 32)
    with pytest.raises(DFlash2Error, match=r"built on NVIDIA H200 \(compute capability 9\.0\), this GPU is Orin "
                                           r"\(compute capability 8\.7\)"):
        check_engine_identity(entry, dict(here, gpu={"name": "Orin", "compute_capability": "8.7"}), "ab" * 32)
    with pytest.raises(DFlash2Error, match="plugin library checksum cdcdcdcdcdcd… differs"):
        check_engine_identity(entry, here, "cd" * 32)
    with pytest.raises(DFlash2Error, match="library was not found"):
        check_engine_identity(entry, here, None)
    check_engine_identity(dataclasses.replace(entry, plugin=None), here, None)  # decomposed engines need no plugin


def test_manifest_json_stays_valid_json(export_copy, tmp_path):
    _build(export_copy, tmp_path)
    json.loads((export_copy / "manifest.json").read_text())


def test_parser_failure_and_single_stream_engines(export_copy, tmp_path):
    """The parser can fail (its errors reach the one-line message, the export stays as it was); engines are
    built with no auxiliary streams, so a failed capture cannot leave TensorRT streams capturing."""
    before = _snapshot(export_copy)
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    trt.parse_errors = ["In node 3 (parseGraph): UNSUPPORTED_NODE: No importer registered for op: Foo"]
    with pytest.raises(DFlash2Error, match="parser rejected target.onnx: In node 3 .*op: Foo"):
        E.build_engines(export_copy, selector="decomposed", progress=False, trt_module=trt, api=cuda)
    assert _snapshot(export_copy) == before and not trt.builds
    _, trt, _ = _build(export_copy, tmp_path)
    assert [b["aux"] for b in trt.builds] == [0] * len(trt.builds)


def test_build_then_backend_in_one_process_loads_the_plugin_once(export_copy, tmp_path):
    """build-engines copies the library next to the engines; the backend then loads the copy into the same
    registry, where TensorRT's load_library answers None (already registered): that is not a failure."""
    from dflash2_trt.runtime.trt.backend import TrtBackend

    _, trt, plugin = _build(export_copy, tmp_path)
    reg = trt.get_plugin_registry()
    with TrtBackend(export_copy, trt_module=trt, api=trt.cuda) as be:
        assert be.plugin_path is not None and be.plugin_path != plugin
    with TrtBackend(export_copy, trt_module=trt, api=trt.cuda):
        pass
    assert reg.load_calls == [str(plugin)]  # the look-up found the creator: no second load_library


@pytest.mark.parametrize("version,error", [("10.3.0.26", None), ("11.4.0.106", None),
                                           ("10.2.0", "too old"), ("12.0.0.1", "not supported")])
def test_supported_tensorrt_versions(monkeypatch, version, error):
    """TensorRT 10.3+ and 11 are accepted (one plugin build per major); anything else is BackendUnavailable."""
    import types

    from dflash2_trt.runtime.protocol import BackendUnavailable
    from dflash2_trt.runtime.trt.env import import_tensorrt

    mod = types.ModuleType("tensorrt")
    mod.__version__ = version
    mod.Builder = object
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    if error is None:
        assert import_tensorrt() is mod
    else:
        with pytest.raises(BackendUnavailable, match=f"TensorRT {version} is {error}"):
            import_tensorrt()


def test_quantized_export_builds_its_target_engine_from_the_qdq_graph(tiny_dir, tmp_path):
    """--quantize: the target engine comes from target_qdq.onnx (DequantizeLinear weights; TensorRT turns them
    into weight-only quantized GEMMs), the drafter engines from the standard graphs; fp16 exports quantize too
    (Q/DQ only: the ONNX Runtime flavour is fp32)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.export.quantize import QuantSpec

    d = tmp_path / "q"
    export_model(tiny_dir / "target", tiny_dir / "drafter", d, progress=False, max_seq_len=512, dtype="fp16",
                 quantization=QuantSpec("int4", block_size=32))
    m = read_manifest(d)
    assert m.graphs["target_qdq"].flavour == "qdq" and "target_ort" not in m.graphs
    assert m.verification["target_qdq.dequantized_weights"] > 0
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    E.build_engines(d, selector="decomposed", progress=False, trt_module=trt, api=cuda)
    files = [b["file"].rsplit("/", 1)[-1] for b in trt.builds]
    assert files[0] == "target_qdq.onnx" and "target.onnx" not in files and "drafter_block.onnx" in files
    assert set(read_manifest(d).engines.plans) >= {"target", "drafter_block"}
