"""Polygraphy, the tool TensorRT users debug engines with: ``dflash2 export --polygraphy-inputs DIR`` writes real
input sets of every TensorRT-bound graph a decode calls (the target, the drafter's context and block graphs, each
draft mode's head) in Polygraphy's data-loader format, beside ONNX Runtime's outputs for them; ``polygraphy run
GRAPH --onnxrt --load-inputs`` (its ONNX Runtime side, on the CPU) reproduces those outputs. On a GPU the same
files drive ``--trt --onnxrt`` (docs/tensorrt.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def test_export_records_polygraphy_inputs_and_polygraphy_reproduces_the_runtime(tiny_dir, tmp_path, capsys):
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    from dflash2_trt.cli import main
    from dflash2_trt.manifest import read_manifest

    exe = shutil.which("polygraphy") or str(Path(sys.executable).parent / "polygraphy")
    if not Path(exe).is_file():
        pytest.fail("the polygraphy command is missing: scripts/setup.sh test installs it (the dev extra)")
    out, pg = tmp_path / "exp", tmp_path / "pg"
    assert main(["export", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out",
                 str(out), "--max-seq-len", "64", "--no-verify", "--quiet", "--polygraphy-inputs", str(pg)]) == 0
    assert "polygraphy input sets in" in capsys.readouterr().out
    m = read_manifest(out)
    heads = {f"drafter_head_{mode}" for mode in m.draft_modes}
    keys = {p.name.split(".")[0] for p in pg.glob("*.inputs.json")}
    assert keys == {"target", "drafter_context", "drafter_block"} | heads, keys
    for key in sorted(keys):
        feeds = load_json(pg / f"{key}.inputs.json")
        want = load_json(pg / f"{key}.outputs.json")
        assert 1 <= len(feeds) == len(want) <= 3 and set(feeds[0]) == {t.name for t in m.graphs[key].inputs}
        got_file = tmp_path / f"{key}.polygraphy.json"
        subprocess.run([exe, "run", str(out / m.graphs[key].file), "--onnxrt", "--load-inputs",
                        str(pg / f"{key}.inputs.json"), "--save-outputs", str(got_file)], check=True,
                       capture_output=True, timeout=300)
        (_, got), = RunResults.load(str(got_file)).items()
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert set(g.keys()) == set(w), key
            for name in w:
                np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=f"{key}: {name}")
