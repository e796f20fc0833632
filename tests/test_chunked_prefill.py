"""Chunked prefill in the batch loop (``BatchDecoder(prefill_chunk=...)``): a long prompt joining running streams is
computed ``prefill_chunk`` rows a step, so the running sequences get a token in every step while it prefills (the
path asserted step by step), and every request's tokens equal its own single, unchunked, uncached run — on a dense,
a hybrid and a sliding-window tiny accepting pair, with drafts accepted; a planted chunk whose features never reach
the drafter is caught."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import batch as B
from dflash2_trt.runtime import decoder as D
from helpers import req


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "gpt_oss"])
def backend(request, tmp_path_factory):
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.tiny import make_tiny

    d = tmp_path_factory.mktemp(f"chunk_{request.param}")
    make_tiny(d / "pair", seed=0, block_size=8, accepting=True, arch=request.param)
    export_model(d / "pair" / "target", d / "pair" / "drafter", d / "export", progress=False, max_seq_len=512)
    with OrtBackend(d / "export") as be:
        yield be


def _decoder(be, chunk: int | None) -> B.BatchDecoder:  # noqa: ANN001
    return B.BatchDecoder(be.batch_target_runner(4), None, B.SpeculationRule(adaptive=False),
                          batched_drafter=lambda n: be.batch_draft_runner("greedy", n), prefill_chunk=chunk)


def _joining(be, chunk: int | None) -> tuple[list, list[tuple[int, int, bool]]]:  # noqa: ANN001
    """Two short requests decoding, then a 150-token prompt joins -> (the three results, per step while it
    prefills: (tokens of the first request, of the second, still prefilling))."""
    rng = np.random.default_rng(0)
    short = [rng.integers(2, 200, 12).tolist() for _ in range(2)]
    long = rng.integers(2, 200, 150).tolist()
    dec = _decoder(be, chunk)
    ids = [dec.submit(p, req(200, eos_ids=frozenset())) for p in short]  # still running when it joins
    for _ in range(2):
        dec.step()
    ids.append(dec.submit(long, req(20, eos_ids=frozenset())))
    trace = []
    while dec.busy:
        dec.step()
        s = dec._active.get(ids[2])
        if s is not None and s.prefilling or len(trace) < 1:
            trace.append((len(dec.in_flight(ids[0]).tokens), len(dec.in_flight(ids[1]).tokens),
                          s is not None and s.prefilling))
    return [dec.results[i] for i in ids], trace, [short[0], short[1], long]


def test_running_streams_step_while_a_long_prompt_prefills(backend):
    """Chunks of 16 rows: the long prompt prefills over ~10 steps and both running requests commit tokens in each of
    them; every request = its single uncached run; drafts accepted."""
    results, trace, prompts = _joining(backend, 16)
    prefill_steps = [t for t in trace if t[2]]
    assert len(prefill_steps) >= 150 // 16 - 1
    for (a0, b0, _), (a1, b1, _) in zip(trace, trace[1:]):
        assert a1 > a0 and b1 > b0  # every step of the prefill decoded the running streams too
    for res, prompt in zip(results, prompts):
        single = D.speculative_generate(backend.target_runner(), backend.draft_runner("greedy"), prompt,
                                        req(len(res.tokens), eos_ids=frozenset()))
        assert res.tokens == single.tokens
    assert all(sum(r.accepted) > 0 for r in results)


def test_unchunked_prefill_takes_the_prompt_in_one_step(backend):
    """prefill_chunk=None (the loop without chunking): the long prompt is whole in the step it joins."""
    results, trace, _ = _joining(backend, None)
    assert not any(t[2] for t in trace)
    assert results[2].tokens


def test_a_chunk_whose_features_are_lost_is_caught(backend, monkeypatch):
    """Negative control: a prefill step that keeps only the prompt's last chunk of features for the drafter (the
    others lost) — its context would have a hole, which the drafter's position check refuses in one line."""
    prefill = B.BatchDecoder._prefill

    def planted(self):  # noqa: ANN001, ANN202
        done = prefill(self)
        for s, _ in done:
            s.pending = s.pending[-1:]
        return done

    monkeypatch.setattr(B.BatchDecoder, "_prefill", planted)
    with pytest.raises(DFlash2Error, match="draft context (is at length|holds)"):
        _joining(backend, 16)


def test_a_bad_chunk_is_refused():
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(DFlash2Error, match="prefill_chunk"):
            B.check_prefill_chunk(bad)
