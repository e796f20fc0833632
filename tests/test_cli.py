"""The dflash2 CLI: make-tiny + generate --json, one-line errors with exit code 1."""

from __future__ import annotations

import json

import pytest

from dflash2_trt.cli import main


def test_generate_json_lossless(tiny_dir, capsys):
    rc = main(["generate", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"),
               "--prompt", "Hello world", "--max-new-tokens", "20", "--check-lossless", "--json",
               "--selector", "viterbi"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(out) >= {"text", "tokens", "stats", "tokens_per_s", "lossless"}
    assert set(out["stats"]) >= {"tau", "cycles", "per_position_cumulative", "per_position_conditional", "oracle_tau"}
    assert out["lossless"] is True and len(out["tokens"]) == 20 and len(out["stats"]["per_position_cumulative"]) == 15


@pytest.mark.parametrize("flags", [["--no-conv"], ["--no-selector"], ["--temperature", "0.8"], ["--chat"]])
def test_generate_options(tiny_dir, capsys, flags):
    rc = main(["generate", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"),
               "--prompt", "abc", "--max-new-tokens", "8", "--json", "--check-lossless", *flags])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["tokens"]) <= 8
    if "--temperature" not in flags:
        assert out["lossless"] is True


def test_make_tiny_cli(tmp_path, capsys):
    assert main(["make-tiny", "--out", str(tmp_path / "t"), "--seed", "3", "--block-size", "8"]) == 0
    cfg = json.loads((tmp_path / "t" / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 8 and cfg["architectures"] == ["DFlash2DraftModel"]
    assert (tmp_path / "t" / "target" / "tokenizer.json").is_file()


def test_make_tiny_accepting_then_generate_shows_tau(tmp_path, capsys):
    """The accepting pair as a user makes it: ``make-tiny --accepting`` then ``generate --json`` is lossless
    with τ well above 1."""
    assert main(["make-tiny", "--out", str(tmp_path / "a"), "--accepting", "--block-size", "8"]) == 0
    capsys.readouterr()
    rc = main(["generate", "--target", str(tmp_path / "a" / "target"), "--drafter", str(tmp_path / "a" / "drafter"),
               "--prompt", "Hello world", "--max-new-tokens", "40", "--check-lossless", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["lossless"] is True and out["stats"]["tau"] >= 2.0, out["stats"]


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert err.startswith("dflash2: error: ") and "\n" not in err
    return err


def test_errors_are_one_line(tiny_dir, tmp_path, capsys):
    base = ["generate", "--target", str(tiny_dir / "target"), "--prompt", "x"]
    assert "drafter folder not found" in _err(capsys, base + ["--drafter", str(tmp_path / "missing")])
    assert "target not found" in _err(capsys, ["generate", "--target", str(tmp_path / "nope"), "--drafter",
                                               str(tiny_dir / "drafter"), "--prompt", "x"])
    # a drafter made for another target (different vocab) is refused, naming the field
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter, save_drafter

    cfg = DFlash2Config.from_json_file(tiny_dir / "drafter").replace(vocab_size=1000)
    save_drafter(DFlash2Drafter(cfg), tmp_path / "other")
    assert "vocab_size 1000 != target vocab" in _err(capsys, base + ["--drafter", str(tmp_path / "other")])


def test_bad_flags_exit_1(capsys):
    """argparse's errors too are one line and exit 1 (tests/test_bad_input.py: every bad input)."""
    assert main(["generate", "--selector", "beam"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: argument --selector: invalid choice") and len(err.splitlines()) == 1


def test_dflash2_export_help_names_itself(capsys):
    from dflash2_trt.cli import export_main

    with pytest.raises(SystemExit) as e:
        export_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dflash2-export [-h]") and "dflash2-export export" not in out


# -- pinned review findings, each failed before its fix ---------------------------------------------------
def test_cli_bad_temperature_is_one_line(acc_dir, capsys):
    from dflash2_trt.cli import main

    assert main(["generate", "--target", str(acc_dir / "target"), "--drafter", str(acc_dir / "drafter"),
                 "--prompt", "x", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash2: error: argument --temperature: must be >= 0") and "\n" not in err


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["bench", "--prompts", "P"]])
def test_ort_options_reach_load(tiny_export, tmp_path, monkeypatch, capsys, cmd):
    """--no-spinning / --panels / --no-weight-codes become load()'s typed options (unset: None, None, True)."""
    import dflash2_trt
    from dflash2_trt import DFlash2Error

    seen: list[dict] = []

    def spy(model_dir, backend="auto", threads=None, **opts):  # noqa: ANN001, ANN003, ANN202
        seen.append(opts)
        raise DFlash2Error("stop here")

    monkeypatch.setattr(dflash2_trt, "load", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    argv = [cmd[0], "--model-dir", str(tiny_export), *[str(prompts) if x == "P" else x for x in cmd[1:]]]
    assert main([*argv, "--no-spinning", "--panels", "--no-weight-codes"]) == 1
    assert main(argv) == 1
    assert seen == [{"spinning": False, "panels": True, "weight_codes": False},
                    {"spinning": None, "panels": None, "weight_codes": True}]
    assert "stop here" in capsys.readouterr().err


def test_serve_takes_the_ort_options(tiny_export, monkeypatch, capsys):
    """``dflash2 serve`` passes --no-spinning / --panels / --no-weight-codes to load() as the other commands do."""
    import dflash2_trt
    from dflash2_trt import DFlash2Error

    seen: list[dict] = []

    def spy(model_dir, backend="auto", threads=None, **opts):  # noqa: ANN001, ANN003, ANN202
        seen.append(opts)
        raise DFlash2Error("stop here")

    monkeypatch.setattr(dflash2_trt, "load", spy)
    assert main(["serve", str(tiny_export), "--no-spinning", "--panels", "--no-weight-codes"]) == 1
    assert seen == [{"prefix_cache_bytes": 1 << 30, "spinning": False, "panels": True, "weight_codes": False}]
    assert "stop here" in capsys.readouterr().err


def test_serve_prefill_share_zero_turns_the_time_budget_off(tiny_export, monkeypatch, capsys):
    """``dflash2 serve --prefill-share 0`` gives the server no time budget (fixed --prefill-chunk rows: the Python
    API's ``prefill_share=None``, the C option's 0); a number gives that share; none, the default."""
    import contextlib

    import dflash2_trt
    from dflash2_trt import DFlash2Error
    from dflash2_trt.runtime.batch import DEFAULT_PREFILL_SHARE
    from dflash2_trt.serving.http import app as A

    seen: list[dict] = []

    def spy(gen, name, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(kw)
        raise DFlash2Error("stop here")

    monkeypatch.setattr(dflash2_trt, "load", lambda *a, **kw: contextlib.nullcontext())
    monkeypatch.setattr(A, "Server", spy)
    for flags in ([], ["--prefill-share", "0"], ["--prefill-share", "2.5"]):
        assert main(["serve", str(tiny_export), *flags]) == 1
    assert [kw["prefill_share"] for kw in seen] == [DEFAULT_PREFILL_SHARE, None, 2.5]
    assert main(["serve", str(tiny_export), "--prefill-share", "-1"]) == 1
    assert len(seen) == 3 and "--prefill-share" in capsys.readouterr().err


def test_generate_sampling_flags_build_the_request(acc_export, capsys):
    """--top-p / --top-k / --min-p / the penalties (SAMPLING_SCALARS) reach the request record: greedy tokens = the
    Python API's with the same fields, and differ from those without; a value out of range is one line, exit 1."""
    import dflash2_trt
    from dflash2_trt.runtime.request import SAMPLING_SCALARS, GenerationRequest

    kw = {"presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 2.0, "top_k": 5, "top_p": 0.9,
          "min_p": 0.01}
    assert set(kw) == set(SAMPLING_SCALARS)
    flags = [x for k, v in kw.items() for x in ("--" + k.replace("_", "-"), str(v))]
    base = ["generate", "--model-dir", str(acc_export), "--backend", "ort", "--threads", "1", "--prompt",
            "the the the cat the cat", "--max-new-tokens", "12", "--json", "--no-oracle"]
    assert main([*base, *flags]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    with dflash2_trt.load(acc_export, "ort", threads=1) as g:
        p = g.encode("the the the cat the cat", chat=False)
        want = g.generate(p, request=GenerationRequest(max_new_tokens=12, seed=0, guard=False, **kw)).tokens
        plain = g.generate(p, request=GenerationRequest(max_new_tokens=12, seed=0, guard=False)).tokens
    assert got == want != plain
    assert main([*base, "--top-p", "1.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert "top_p" in err and "\n" not in err
