"""dflash2_trt.bench.machine: the machine record every result file carries, and the command that writes it around a
command's printed JSON (``dflash2 demo --json``) for benchmarks/rerun_quoted.sh. Seconds, no model."""

from __future__ import annotations

import json

import pytest

from dflash2_trt.bench import machine

KEYS = ("date", "commit", "cpu", "simd", "cores", "onnxruntime")


def test_describe_names_the_machine():
    m = machine.describe()
    assert all(m[k] for k in KEYS), m
    assert set(m["simd"]) <= {"avx2", "avx512f", "avx512bw", "avx512_vnni", "fma"}


def test_a_printed_result_is_written_with_its_machine_and_command(tmp_path):
    """One input: its last line's object, after the machine and the command; KEY=FILE inputs: joined under their
    keys; the two mixed, or an empty input: refused (exit 2, nothing written)."""
    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "r.json"
    a.write_text('progress line\n{"tau": 1.5, "n_prompts": 20}\n')
    b.write_text('{"tau": 2.0}\n\n')
    assert machine.main(["--out", str(out), "--command", "dflash2 demo --json", str(a)]) == 0
    r = json.loads(out.read_text())
    assert list(r)[:2] == ["machine", "command"] and r["command"] == "dflash2 demo --json"
    assert all(r["machine"][k] for k in KEYS) and (r["tau"], r["n_prompts"]) == (1.5, 20)
    assert machine.main(["--out", str(out), "--command", "c", f"humaneval={a}", f"mtbench={b}"]) == 0
    r = json.loads(out.read_text())
    assert r["humaneval"] == {"tau": 1.5, "n_prompts": 20} and r["mtbench"] == {"tau": 2.0}
    out.unlink()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for bad in ([str(a), f"k={b}"], [str(empty)]):
        with pytest.raises(SystemExit) as e:
            machine.main(["--out", str(out), "--command", "c", *bad])
        assert e.value.code == 2 and not out.exists()
