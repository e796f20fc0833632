"""dflash2 bench: JSON fields, FILE.jsonl prompts (raw and chat), the PyPI prompt sets, the plot."""

from __future__ import annotations

from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner

from dflash2_trt.runtime import decoder as D

import torch

import numpy as np

import json

import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.bench.prompts import load_prompts
from helpers import req

KEYS = {"backend", "n_prompts", "tau", "per_position_cumulative", "per_position_conditional", "oracle_tau",
        "spec_tokens_per_s", "ar_tokens_per_s", "speedup", "lossless"}


def test_bench_json_and_plot(tiny_export, tmp_path, capsys):
    from dflash2_trt.cli import main

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Hello world"}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "abc"}]}) + "\n")
    png = tmp_path / "curve.png"
    assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(f), "--max-new-tokens", "24",
                 "--ignore-eos", "--json", "--plot", str(png), "--selector", "viterbi"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert KEYS <= set(r) and r["n_prompts"] == 2 and r["lossless"] is True
    assert r["spec_tokens"] == r["ar_tokens"] == 48
    assert len(r["per_position_cumulative"]) == 15 and r["oracle_tau"] >= r["tau"] >= 1.0
    assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["ar_tokens_per_s"])
    # the guard is on by default; every token is committed by the prefill, a cycle or a guard's plain step
    assert r["guard"] == "on" and r["spec_cycles"] >= 1
    assert r["plain_steps"] + r["spec_cycles"] <= r["spec_tokens"] - r["n_prompts"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(f), "--limit", "1", "--max-new-tokens",
                 "8", "--temperature", "0.7", "--no-oracle", "--no-guard", "--min-confidence", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "speculative" in out and "autoregressive" in out and "n/a (T > 0)" in out
    assert "guard off   min confidence 0.2" in out and "plain steps 0" in out


def test_bench_from_target_and_drafter_uses_the_export_cache(tiny_dir, tmp_path, monkeypatch, capsys):
    from dflash2_trt.cli import main

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    argv = ["bench", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--prompts", str(f),
            "--max-new-tokens", "6", "--json", "--no-oracle"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["lossless"] is True
    exported = list((tmp_path / "cache" / "exports").iterdir())
    assert len(exported) == 1
    assert main(argv) == 0  # second run reuses the export
    assert list((tmp_path / "cache" / "exports").iterdir()) == exported


def test_repeats_keep_the_fastest_run_of_each_way():
    """--repeats N: each prompt decoded N times each way, interleaved; the fastest run of each counts."""
    from types import SimpleNamespace

    from dflash2_trt.bench import harness

    times = {True: iter([3.0, 1.0, 2.0]), False: iter([5.0, 6.0, 4.0])}  # speculative -> its runs' seconds
    calls = []

    class Gen:
        def generate(self, p, *a, speculative=True, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append(speculative)
            s = next(times[speculative])
            return SimpleNamespace(tokens=[1] * 6, text="", stats=SimpleNamespace(
                elapsed_s=s, accepted=[1, 1, 1] if speculative else [], verified=[2, 2, 2] if speculative else [],
                cycles=3 if speculative else 0, oracle_accepted=[], tau=2.0, plain_steps=0, guard_switches=0,
                guard_probes=0, proposers=["dflash2"] * 3 if speculative else []))

    r = harness.run_bench(Gen(), [[5, 6]], 6, progress=False, measure_oracle=False, repeats=3)
    assert calls == [True, False] * 3  # interleaved
    assert r["spec_tokens_per_s"] == 6 / 1.0 and r["ar_tokens_per_s"] == 6 / 4.0 and r["speedup"] == 4.0


def test_prompt_sets():
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0]["prompt"].startswith("from typing import List")
    mt = load_prompts("mtbench", limit=5)
    assert len(mt) == 5 and mt[0]["messages"][0]["role"] == "user"
    assert len(load_prompts("mtbench")) == 80


def test_bench_bad_input(tiny_export, tmp_path, capsys):
    from dflash2_trt.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(DFlash2Error, match="needs 'prompt'"):
        load_prompts(str(bad))
    with pytest.raises(DFlash2Error, match="not 'humaneval'"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and err.count("\n") == 1
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 3000}) + "\n")
    assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(long)]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_tau_is_pooled_over_cycles_with_the_prompt_mean_named_apart():
    """τ = tokens of all speculative cycles ÷ all cycles; a 1-cycle prompt does not weigh as much as a 4-cycle one
    (the per-prompt mean is kept, as ``tau_prompt_mean``)."""
    from dflash2_trt.api import Result, Stats
    from dflash2_trt.bench.harness import summarize
    from dflash2_trt.runtime.decoder import GenerationResult

    def result(g: GenerationResult) -> Result:
        return Result("", g.tokens, g.prompt_tokens, Stats.of(g), "length")

    long = GenerationResult([1], tokens=[5] * 17, accepted=[3, 3, 3, 3], proposed=[3, 3, 3, 3],
                            oracle_accepted=[3, 3, 3, 3], elapsed_s=1.0)
    short = GenerationResult([1], tokens=[5] * 2, accepted=[0], proposed=[3], oracle_accepted=[1], elapsed_s=1.0)
    ar = [GenerationResult([1], tokens=[5] * 17, elapsed_s=1.0), GenerationResult([1], tokens=[5] * 2, elapsed_s=1.0)]
    r = summarize([result(long), result(short)], [result(g) for g in ar], 0.0)
    assert r["tau"] == pytest.approx((4 * 4 + 1) / 5) and r["tau_prompt_mean"] == pytest.approx((4 + 1) / 2)
    assert r["oracle_tau"] == pytest.approx((4 * 4 + 2) / 5)
    assert r["per_position_cumulative"] == pytest.approx([4 / 5, 4 / 5, 4 / 5])  # τ = 1 + Σ r_i
    assert r["tau"] == pytest.approx(1 + sum(r["per_position_cumulative"]))


def test_plot_path_is_checked_before_the_work(tiny_export, tmp_path, monkeypatch, capsys):
    from dflash2_trt.bench import harness
    from dflash2_trt.cli import main

    def never(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("the benchmark ran before --plot was checked")

    monkeypatch.setattr(harness, "run_bench", never)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    for plot, want in [(tmp_path / "missing" / "c.png", "does not exist"), (tmp_path / "c.txt", "must end in"),
                       (tmp_path, "must end in")]:
        assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(f), "--plot", str(plot)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("dflash2: error: --plot") and want in err and err.count("\n") == 1, err


def test_results_are_printed_before_the_plot(tiny_export, tmp_path, monkeypatch, capsys):
    """A plot that fails at the end never loses the computed figures: they are printed first."""
    from dflash2_trt.bench import harness
    from dflash2_trt.cli import main

    def broken(r, path):  # noqa: ANN001
        raise DFlash2Error(f"cannot write --plot {path}: injected")

    monkeypatch.setattr(harness, "plot", broken)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    assert main(["bench", "--model-dir", str(tiny_export), "--prompts", str(f), "--max-new-tokens", "6", "--json",
                 "--no-oracle", "--plot", str(tmp_path / "c.png")]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["n_prompts"] == 1 and "injected" in out.err


def test_side_by_side_table_has_no_tautological_cells():
    """benchmarks/ort_side_by_side.py: an AR row is its own reference, so its agreement is not reported (it was
    1.00 by construction); a speculative row is compared with its AR row; τ is pooled over cycles."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ort_side_by_side.py"
    spec = importlib.util.spec_from_file_location("ort_side_by_side", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = lambda toks, **k: {"tokens": toks, "s": 1.0, "ttft": 0.1, **k}  # noqa: E731
    rows = mod.summarize({
        "ours fp32 AR": [run([1, 2]), run([3, 4])],
        "ours fp32 DFlash2 bs3": [run([1, 2], tau=4.0, cycles=4), run([3, 5], tau=1.0, cycles=1)],
        "genai fp32 AR": [run([1, 2]), run([3, 4])],
        "genai fp32 n-gram": [run([1, 2]), run([3, 4])],
    })
    assert rows["ours fp32 AR"]["agreement_own_greedy"] is None
    assert rows["genai fp32 AR"]["agreement_own_greedy"] is None
    assert rows["ours fp32 DFlash2 bs3"]["agreement_own_greedy"] == 0.5
    assert rows["genai fp32 n-gram"]["agreement_own_greedy"] == 1.0
    assert rows["ours fp32 DFlash2 bs3"]["tau"] == pytest.approx(17 / 5)
    assert rows["ours fp32 DFlash2 bs3"]["tau_prompt_mean"] == pytest.approx(2.5)


def test_every_results_file_is_indexed_with_its_drafter_and_command():
    """benchmarks/results/README.md lists every file there (drafter, command) and no file that is not there."""
    import re
    from pathlib import Path

    d = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    index = (d / "README.md").read_text()
    rows = [ln for ln in index.splitlines() if ln.startswith("| `")]
    listed = {n for ln in rows for n in re.findall(r"`([\w.]+\.(?:json|png))`", ln.split("|")[1])}
    assert listed == {p.name for p in d.iterdir() if p.name != "README.md"}
    for ln in rows:
        cells = [c.strip() for c in ln.split("|")[1:-1]]
        assert cells[1] in ("packaged", "none"), ln  # none: a benchmark of the target alone
        assert cells[2].startswith(("`python benchmarks/", "`dflash2 ", "the same")), ln


# -- pinned review findings, each failed before its fix ---------------------------------------------------
def test_oracle_tau_at_positive_temperature_follows_its_definition(acc_target, acc_drafter):
    """bench/oracle.py: at T > 0 a cycle's oracle count is the number of leading rows whose token — the
    committed prefix (accepted drafts + the sampled bonus), then the target's argmax continuation — is among
    the row's candidates. Recomputed here from scratch with fresh target passes."""
    from dflash2_trt.bench.oracle import oracle_count

    runner = TorchTargetRunner(acc_target, [0, 2])
    src = TorchDraftRunner(acc_drafter)
    seen = []

    def spy(target, cand, drafts, n_rows, acc, bonus, pos):  # noqa: ANN001
        o = oracle_count(target, cand, drafts, n_rows, acc, bonus, pos)
        seen.append((cand.copy(), list(drafts), n_rows, acc, bonus, pos, o, target.cache_length))
        return o

    p = np.random.default_rng(9).integers(4, 500, 18).tolist()
    res = D.speculative_generate(runner, src, p, req(40, temperature=0.7, eos_ids=set(), seed=3),
                                 D.DecodeHooks(oracle=spy))
    assert res.oracle_accepted == [s[6] for s in seen] and len(seen) == len(res.accepted)
    assert any(s[3] > 0 for s in seen)  # drafts were accepted, so the committed-prefix part is exercised
    for cand, drafts, n_rows, acc, bonus, pos, o, cache_len in seen:
        assert cache_len == pos + acc + 1  # the oracle left the cache at the committed length
        seq = (p + res.tokens)[: pos + 1] + drafts[:acc] + [bonus]
        while len(seq) < pos + 1 + n_rows:  # the target's argmax continuation after the committed prefix
            acc_target.reset([])
            logits, _ = acc_target.forward(torch.tensor(seq))
            seq.append(int(logits[-1].argmax()))
        want = 0
        while want < n_rows and seq[pos + 1 + want] in cand[want].tolist():
            want += 1
        assert o == want
