"""Never delete what we did not write (dflash2_trt.outdir): every command that writes a folder replaces it only
when it proves to be ours; extra files need --overwrite, which names them; stale temporaries of interrupted runs
are cleaned (unless locked); exports are world-readable; a full disk is one line with nothing left behind.

The export itself is stubbed where the test is about the folder (``_export_into`` copies the session's tiny
export), so these tests take seconds."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import time

import pytest

from dflash2_trt.cli import main
from dflash2_trt.manifest import MANIFEST_FILE, read_manifest


def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("dflash2: error:")]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _tree(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


@pytest.fixture
def stub_export(tiny_export, monkeypatch):
    """``_export_into`` replaced by a copy of the tiny export (the folder logic is the subject, not the graphs)."""
    from dflash2_trt.export import exporter

    calls = []

    def fake(tmp, *a, **k):  # noqa: ANN001, ANN002, ANN003
        calls.append(tmp)
        for p in tiny_export.iterdir():
            shutil.copy2(p, tmp / p.name)
        return read_manifest(tmp, verify_checksums=False)

    monkeypatch.setattr(exporter, "_export_into", fake)
    return calls


def _export_argv(tiny_dir, out, *extra):
    return ["export", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out", str(out),
            "--quiet", *extra]


def test_export_refuses_a_folder_that_is_not_ours(tiny_dir, tmp_path, capsys, stub_export):
    """A web-app folder with a manifest.json of its own is not an export: refused, every file kept."""
    app = tmp_path / "app"
    (app / "src").mkdir(parents=True)
    (app / MANIFEST_FILE).write_text(json.dumps({"name": "my web app", "start_url": "/"}))
    (app / "index.html").write_text("<html></html>")
    (app / "src" / "main.js").write_text("console.log(1)")
    before = _tree(app)
    line = _one_line_error(capsys, main(_export_argv(tiny_dir, app)))
    assert "did not write" in line and str(app) in line
    assert _tree(app) == before and stub_export == []  # refused before any work
    # --overwrite does not make a foreign folder ours
    _one_line_error(capsys, main(_export_argv(tiny_dir, app, "--overwrite")))
    assert _tree(app) == before
    # a file, a non-empty folder without manifest: refused too
    (tmp_path / "f").write_text("x")
    assert "not a folder" in _one_line_error(capsys, main(_export_argv(tiny_dir, tmp_path / "f")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app", "f"]  # no temporaries left


def test_reexport_keeps_unlisted_files_unless_overwrite(tiny_dir, tiny_export, tmp_path, capsys, stub_export):
    out = tmp_path / "exp"
    shutil.copytree(tiny_export, out)
    assert main(_export_argv(tiny_dir, out)) == 0  # our own export, every file listed: replaced
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    (out / "engines-x").mkdir()
    (out / "engines-x" / "target.plan").write_bytes(b"plan")
    line = _one_line_error(capsys, main(_export_argv(tiny_dir, out)))
    assert "--overwrite" in line and "notes.txt" in line and "engines-x/target.plan" in line
    assert (out / "notes.txt").read_text() == "mine"
    assert main(_export_argv(tiny_dir, out, "--overwrite")) == 0
    err = capsys.readouterr().err
    assert "removes 2 file(s)" in err and "notes.txt" in err  # said before it is done
    assert not (out / "notes.txt").exists() and read_manifest(out).files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_engines_built_since_need_overwrite(tiny_dir, tiny_export, tmp_path, capsys, stub_export):
    """TensorRT engines listed in the manifest (build-engines) are not replaced silently."""
    from dflash2_trt.export.engines import update_manifest_engines
    from dflash2_trt.manifest import parse_engine_set

    out = tmp_path / "exp"
    shutil.copytree(tiny_export, out)
    (out / "engines-1").mkdir()
    (out / "engines-1" / "target.plan").write_bytes(b"plan")
    update_manifest_engines(out, parse_engine_set({
        "dir": "engines-1", "tensorrt_version": "10.0", "gpu": {"name": "g", "compute_capability": "9.0"},
        "plans": {"target": {"file": "engines-1/target.plan", "profiles": []}}}))
    line = _one_line_error(capsys, main(_export_argv(tiny_dir, out)))
    assert "TensorRT engines" in line and "engines-1/target.plan" in line
    assert main(_export_argv(tiny_dir, out, "--overwrite")) == 0 and not (out / "engines-1").exists()


def test_stale_temporaries_are_cleaned_unless_locked(tiny_dir, tmp_path, capsys, stub_export):
    out = tmp_path / "exp"
    past = time.time() - 3600
    stale = [tmp_path / ".exp.export-ab12cd34", tmp_path / ".exp.old-ef56gh78", tmp_path / ".exp.triton-x1"]
    live, other = tmp_path / ".exp.export-live0001", tmp_path / ".other.export-ab12cd34"
    for d in [*stale, live, other]:
        d.mkdir()
        (d / "weights.bin").write_bytes(b"0" * 10)
        os.utime(d, (past, past))
    fd = os.open(live, os.O_RDONLY)  # a writer still running holds its lock
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(_export_argv(tiny_dir, out)) == 0
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert all(not d.exists() for d in stale) and all(f"removed {d}" in err for d in stale)
    assert live.exists() and other.exists()
    young = tmp_path / ".exp.export-young001"  # younger than this process: perhaps a writer that just started
    young.mkdir()
    assert main(_export_argv(tiny_dir, out)) == 0 and young.exists()


def test_exports_are_world_readable(tiny_export, tiny_dir, tmp_path, stub_export):
    def modes(d):
        for p in [d, *d.rglob("*")]:
            assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p

    modes(tiny_export)  # a real export
    old = os.umask(0o077)  # set explicitly, not from the umask
    try:
        assert main(_export_argv(tiny_dir, tmp_path / "e")) == 0
    finally:
        os.umask(old)
    modes(tmp_path / "e")


def test_disk_full_during_export_is_one_line_and_cleans_up(tiny_dir, tiny_export, tmp_path, capsys, monkeypatch):
    from dflash2_trt.export import exporter

    def full(tmp, *a, **k):  # noqa: ANN001, ANN002, ANN003
        (tmp / "weights.bin").write_bytes(b"0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "weights.bin"))

    monkeypatch.setattr(exporter, "_export_into", full)
    line = _one_line_error(capsys, main(_export_argv(tiny_dir, tmp_path / "new")))
    assert "no space left" in line
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "exp"
    shutil.copytree(tiny_export, out)
    before = _tree(out)
    _one_line_error(capsys, main(_export_argv(tiny_dir, out)))
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_triton_repo_same_rule(tiny_export, tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc")
    from dflash2_trt.outdir import REPO_RECORD

    def argv(repo, *extra):
        return ["triton-repo", str(tiny_export), "--triton-repo", str(repo), *extra]

    foreign = tmp_path / "models"
    (foreign / "other_model" / "1").mkdir(parents=True)
    (foreign / "other_model" / "config.pbtxt").write_text('name: "other_model"')
    before = _tree(foreign)
    assert "did not write" in _one_line_error(capsys, main(argv(foreign)))
    _one_line_error(capsys, main(argv(foreign, "--overwrite")))
    assert _tree(foreign) == before
    repo = tmp_path / "repo"
    assert main(argv(repo)) == 0 and (repo / REPO_RECORD).is_file()
    assert main(argv(repo)) == 0  # ours, every file listed: replaced
    for p in [repo, *repo.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p
    (repo / "dflash2" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert "notes.txt" in _one_line_error(capsys, main(argv(repo)))
    assert main(argv(repo, "--overwrite")) == 0 and not (repo / "dflash2" / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "repo"]


def test_folder_writers_refuse_foreign_folders(tiny_dir, tmp_path, capsys):
    """make-tiny (replaces OUT/target), make-data and train (write into OUT) refuse a folder that is not theirs,
    before any work."""
    mine = tmp_path / "mine"
    (mine / "target").mkdir(parents=True)
    (mine / "target" / "thesis.tex").write_text("years of work")
    before = _tree(mine)
    assert "make-tiny did not write" in _one_line_error(capsys, main(["make-tiny", "--out", str(mine)]))
    line = _one_line_error(capsys, main(["make-data", "--target", str(tiny_dir / "target"), "--out", str(mine)]))
    assert "not make-data output" in line
    line = _one_line_error(capsys, main(["train", "--target", str(tiny_dir / "target"), "--data", str(tmp_path),
                                         "--out", str(mine)]))
    assert "not a drafter folder" in line
    assert _tree(mine) == before
    # names alone prove nothing: a model folder (config.json + weights) is not a training run, a meta.json
    # without make-data's key is not make-data's
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    line = _one_line_error(capsys, main(["train", "--target", str(tiny_dir / "target"), "--data", str(tmp_path),
                                         "--out", str(model)]))
    assert "no training run to resume" in line
    (model / "config.json").unlink()
    (model / "model.safetensors").unlink()
    (model / "meta.json").write_text("{}")
    line = _one_line_error(capsys, main(["make-data", "--target", str(tiny_dir / "target"), "--out", str(model)]))
    assert "no make-data meta.json" in line
    assert _tree(model) == {"meta.json": b"{}"}
    # a make-tiny folder is make-tiny's to rewrite
    assert main(["make-tiny", "--out", str(tmp_path / "t")]) == 0
    assert main(["make-tiny", "--out", str(tmp_path / "t"), "--seed", "1"]) == 0


def test_build_engines_cleans_the_folder_an_interrupted_build_left(tiny_export, tmp_path, capsys):
    """build-engines builds in .engines-XXXXXXXX.tmp inside the export: a stale one (an interrupted build) is
    removed on the next build-engines, even when that build then fails (no TensorRT here)."""
    exp = tmp_path / "exp"
    shutil.copytree(tiny_export, exp)
    stale = exp / ".engines-0123abcd.tmp"
    stale.mkdir()
    (stale / "target.plan").write_bytes(b"half a plan")
    past = time.time() - 3600
    os.utime(stale, (past, past))
    main(["build-engines", str(exp), "--quiet"])
    assert not stale.exists() and f"removed {stale}" in capsys.readouterr().err
    assert read_manifest(exp).files  # the export intact


def test_folder_writers_accept_their_own_files():
    """What train / make-data write (and leave when interrupted) is theirs to continue in."""
    from dflash2_trt.train.cli import _is_drafter_file
    from dflash2_trt.train.make_data import _is_data_file

    assert all(map(_is_drafter_file, ["config.json", ".config.json.tmp", "model.safetensors", "model.safetensors.tmp",
                                      "token_counts.npy", "trained_prompts.txt", "train_log.jsonl", "train_state"]))
    assert all(map(_is_data_file, ["meta.json", "prompts.jsonl", "prompts.jsonl.tmp", "self_instructions.json",
                                   "self_instructions.tmp", "shard-00000", "shard-00001.tmp", "shard-00002.part",
                                   "shard-00002.part.tmp"]))
    assert not any(map(_is_drafter_file, ["thesis.tex", "target"])) and not _is_data_file("notes.txt")
