"""The runtime says which path it runs: :attr:`Generator.note` / :attr:`Generator.op_library`, the start-up lines
of ``dflash2 generate`` / ``bench`` / ``serve`` and the server's ``/health`` name the ONNX Runtime op library (the
file loaded, the nodes it runs) or its absence and its cost. The counts are checked against the export's own graphs
(each GroupQueryAttention of target_ort.onnx becomes one DecodeAttention), and against the sessions' graphs as
ONNX Runtime loaded them; the planted bug (nodes miscounted) is caught."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import dflash2_trt
from dflash2_trt.runtime.ort import decode_attention as DA

NOTE = re.compile(r"op library loaded from (?P<path>\S+): it runs (?P<n>\d+) nodes \((?P<nodes>[^)]*)\)")
ABSENT = "the plain ONNX Runtime graph, ~2x slower here; see docs/onnxruntime.md"


def _gqa_nodes(export: Path) -> int:
    """GroupQueryAttention nodes of the export's fused target graph, read with onnx (not the runtime)."""
    import onnx

    g = onnx.load(str(export / "target_ort.onnx"), load_external_data=False)
    return sum(n.op_type == "GroupQueryAttention" for n in g.graph.node)


def _check_named(gen: dflash2_trt.Generator, export: Path) -> dict[str, int]:
    """The note names the library found and the nodes the sessions run -> {op type: count}."""
    m = NOTE.search(gen.note)
    assert m, gen.note
    assert Path(m["path"]) == DA.find_library() and Path(m["path"]).is_file()
    nodes = {k: int(v) for k, v in (x.rsplit(" ", 1) for x in m["nodes"].split(", "))}
    assert sum(nodes.values()) == int(m["n"])
    assert nodes.get("DecodeAttention") == _gqa_nodes(export) > 0  # every attention node rewritten
    be = gen._backend
    assert be.attention_op == "DecodeAttention"  # the path taken: the target runs the library's op
    seen: dict[str, int] = {}
    for s in be._sessions.values():  # what the sessions were built from, counted again from their graphs
        import onnx

        graph = onnx.load(s.path, load_external_data=False) if not s.rewritten else None
        for k, v in (DA.library_nodes(graph) if graph is not None else s.library_nodes).items():
            seen[k] = seen.get(k, 0) + v
    assert seen == nodes
    return nodes


@pytest.fixture
def ort_ops():
    if DA.find_library() is None:
        pytest.fail("libdflash2_ort_ops.so not built (scripts/setup.sh builds it)")


def test_note_names_the_library_and_its_nodes(tiny_export, ort_ops):
    with dflash2_trt.load(tiny_export, "ort", threads=1) as gen:
        assert gen.note.startswith("using ONNX Runtime (CPUExecutionProvider); op library loaded from ")
        before = _check_named(gen, tiny_export)
        assert set(before) <= {"DecodeAttention", "PanelMatMul"}  # the target graph only, so far
        gen.generate([1, 2, 3], max_new_tokens=6)
        after = _check_named(gen, tiny_export)  # the drafter's graphs too: the selector node, DrafterLayer
        assert {"DFlash2PathSelector", "DrafterLayer"} <= set(after) and gen.op_library in gen.note


def test_planted_miscount_is_caught(tiny_export, ort_ops, monkeypatch):
    """Negative control: a library_nodes that loses the DecodeAttention nodes fails the check above."""
    real = DA.library_nodes
    monkeypatch.setattr(DA, "library_nodes",
                        lambda model: {k: v for k, v in real(model).items() if k != "DecodeAttention"})
    with dflash2_trt.load(tiny_export, "ort", threads=1) as gen, pytest.raises(AssertionError):
        _check_named(gen, tiny_export)


def test_note_names_the_absence_and_its_cost(tiny_export, monkeypatch):
    monkeypatch.setenv(DA.LIBRARY_ENV, "/nonexistent/libdflash2_ort_ops.so")
    with dflash2_trt.load(tiny_export, "ort", threads=1) as gen:
        assert gen.note == ("using ONNX Runtime (CPUExecutionProvider); op library not found (libdflash2_ort_ops.so; "
                            f"or set DFLASH2_ORT_OPS): {ABSENT}")
        assert gen._backend.attention_op == "GroupQueryAttention"  # the path taken: ORT's own op


def test_note_names_a_missing_onnx_package(tiny_export, ort_ops, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx -> ImportError
    with dflash2_trt.load(tiny_export, "ort", threads=1) as gen:
        assert gen.op_library == f"op library unused: the onnx package is not installed (pip install onnx): {ABSENT}"
        assert gen._backend.attention_op == "GroupQueryAttention"


def test_gqa_and_standard_graphs_say_so(tiny_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(tiny_export, attention="gqa", threads=1) as be:
        assert be.op_library() == "op library not used: attention 'gqa' (ONNX Runtime's GroupQueryAttention)"
    with OrtBackend(tiny_export, flavour="standard", threads=1) as be:
        assert be.op_library().startswith("op library not used: the standard graphs")


def test_generate_prints_the_path_on_stderr(tiny_export, ort_ops, capsys):
    from dflash2_trt.cli import main

    assert main(["generate", "--model-dir", str(tiny_export), "--backend", "ort", "--threads", "1",
                 "--prompt", "Hi", "--max-new-tokens", "4"]) == 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dflash2: "))
    assert NOTE.search(line) and f"DecodeAttention {_gqa_nodes(tiny_export)}" in line


def test_serve_start_up_line_and_health(tiny_export, ort_ops, monkeypatch, capsys):
    """``dflash2 serve`` names the path on its start-up line, and /health answers backend and op_library."""
    pytest.importorskip("uvicorn", reason="the serve extra")
    import uvicorn

    from dflash2_trt.cli import main
    from dflash2_trt.serving.http import app as A

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    answers: list[dict] = []
    real_run = uvicorn.Server.run

    def run(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202 - the real server, asked once, then stopped
        def ask() -> None:
            deadline = time.monotonic() + 60
            while not self.started and time.monotonic() < deadline:
                time.sleep(0.02)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
                answers.append(json.loads(r.read()))
            self.should_exit = True

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        real_run(self, *args, **kw)
        t.join(5)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert A.Server  # the app module imports (serve extra)
    assert main(["serve", str(tiny_export), "--backend", "ort", "--threads", "1", "--port", str(port)]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("dflash2 serve: "))
    assert NOTE.search(line), line
    assert len(answers) == 1 and answers[0]["status"] == "ok", answers
    assert answers[0]["backend"] == "ONNX Runtime (CPUExecutionProvider)" and NOTE.fullmatch(answers[0]["op_library"])
