"""Chunked prefill in the batch loop (``BatchDecoder(prefill_chunk=..., prefill_share=...)``): a long prompt joining
running streams is computed ``prefill_chunk`` rows a step (fewer under a time budget: the rows the costs allow),
so the running sequences get a token in every step while it prefills (the path asserted step by step), and every
request's tokens equal its own single, unchunked, uncached run — on a dense, a hybrid and a sliding-window tiny
accepting pair, with drafts accepted; a planted chunk whose features never reach the drafter and a budget that
ignores the costs are caught."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import batch as B
from dflash2_trt.runtime import decoder as D
from helpers import req


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "gpt_oss"])
def backend(request, arch_exports):
    """The accepting pair of each family (conftest's export, block size 8, max 512 positions) on ONNX Runtime."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(arch_exports(request.param)) as be:
        yield be


def _decoder(be, chunk: int | None, share: float | None = None, costs=None) -> B.BatchDecoder:  # noqa: ANN001
    rule = B.SpeculationRule(adaptive=False) if costs is None else B.SpeculationRule(adaptive=False, costs=costs)
    return B.BatchDecoder(be.batch_target_runner(4), None, rule,
                          batched_drafter=lambda n: be.batch_draft_runner("greedy", n), prefill_chunk=chunk,
                          prefill_share=share)


def _joining(be, chunk: int | None, share: float | None = None, costs=None, short_tokens: int = 200  # noqa: ANN001
             ) -> tuple[list, list[tuple[int, int, bool]], list[list[int]]]:
    """Two short-prompt requests decoding (``short_tokens`` each), then a 150-token prompt joins -> (the three
    results, per step while it prefills: (tokens of the first request, of the second, still prefilling), the
    prompts)."""
    rng = np.random.default_rng(0)
    short = [rng.integers(2, 200, 12).tolist() for _ in range(2)]
    long = rng.integers(2, 200, 150).tolist()
    dec = _decoder(be, chunk, share, costs)
    ids = [dec.submit(p, req(short_tokens, eos_ids=frozenset())) for p in short]  # still running when it joins
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
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(DFlash2Error, match="prefill_share"):
            B.check_prefill_share(bad)


def _chunk_rows(be, monkeypatch, chunk: int, share: float, step_s: float | None, row_s: float | None  # noqa: ANN001
                ) -> tuple[list[int], list]:
    """_joining with given costs (a whole step ``step_s``, a chunked prompt row ``row_s``) -> (the rows of each
    prefill chunk computed while the others decode, the results)."""
    costs = B.FixedCosts(plain_fn=lambda n: 1.0, draft_s=0.1, verify_s=0.2, step_s=step_s, prefill_row_s=row_s)
    rows: list[int] = []
    monkeypatch.setattr(costs, "record_prefill", lambda n, s: rows.append(n))
    results, _, _ = _joining(be, chunk, share, costs, short_tokens=400)  # decoding until the prompt is whole
    return rows, results


@pytest.fixture(scope="module")
def dense_backend(arch_exports):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(arch_exports("llama")) as be:
        yield be


def test_the_chunk_is_the_rows_that_fit_the_time_budget(dense_backend, monkeypatch):
    """prefill_share: each chunk of the 150-token prompt is the rows whose forward takes share × a decoding step by
    the costs — a step 10 ms, a row 4 ms, share 2: 5 rows; a row 1.5 ms, share 1.5: 10 rows; a row 0.1 ms: the cap
    (prefill_chunk 16); costs not given (unmeasured): PREFILL_PROBE_ROWS — the last chunk the rest; the tokens are
    each request's single, unchunked run."""
    for chunk, share, step_s, row_s, want in ((512, 2.0, 0.010, 0.004, 5), (512, 1.5, 0.010, 0.0015, 10),
                                              (16, 2.0, 0.010, 0.0001, 16), (512, 2.0, None, None,
                                                                               B.PREFILL_PROBE_ROWS)):
        rows, results = _chunk_rows(dense_backend, monkeypatch, chunk, share, step_s, row_s)
        assert sum(rows) == 150 and rows[:-1] == [want] * (len(rows) - 1) and 0 < rows[-1] <= want, (want, rows)
    _, _, prompts = _joining(dense_backend, None)
    for res, prompt in zip(results, prompts):
        single = D.speculative_generate(dense_backend.target_runner(), dense_backend.draft_runner("greedy"), prompt,
                                        req(len(res.tokens), eos_ids=frozenset()))
        assert res.tokens == single.tokens


def test_a_budget_that_ignores_the_costs_is_caught(dense_backend, monkeypatch):
    """Negative control: the budget that always takes prefill_chunk rows (the costs unread)."""
    monkeypatch.setattr(B.BatchDecoder, "_prefill_budget", lambda self: self.prefill_chunk)
    with pytest.raises(AssertionError):
        test_the_chunk_is_the_rows_that_fit_the_time_budget(dense_backend, monkeypatch)


def test_measured_costs_hold_a_chunked_row_and_a_step():
    """MeasuredCosts: a chunk's seconds per row and a whole step's seconds (running means, as the other costs);
    None before any."""
    c = B.MeasuredCosts()
    assert c.prefill_row() is None and c.step() is None
    c.record_prefill(10, 0.05)
    c.record_prefill(20, 0.04)
    c.record_step(2, True, 3, 0.02, True)
    assert c.prefill_row() == pytest.approx((0.005 + 0.002) / 2) and c.step() == pytest.approx(0.02)


def _sharing(be, monkeypatch) -> tuple[list, list[list[int]], int]:  # noqa: ANN001
    """A stream decoding, then three requests join: two with one 60-token prompt (T = 0.8, seeds 3 and 4: a request's
    n = 2 choices) and another prompt; chunks of 16 -> (results, prompts, the first rows the second choice's slot
    forwarded)."""
    rng = np.random.default_rng(2)
    short, shared, other = (rng.integers(2, 200, k).tolist() for k in (12, 60, 30))
    dec = _decoder(be, 16)
    seen: list[dict] = []
    real = dec.target.forward
    monkeypatch.setattr(dec.target, "forward", lambda rows, **kw: seen.append(dict(rows)) or real(rows, **kw))
    ids = [dec.submit(short, req(120, eos_ids=frozenset()))]
    dec.step()
    ids += [dec.submit(p, req(24, eos_ids=frozenset(), temperature=0.8, seed=k))
            for p, k in ((shared, 3), (shared, 4), (other, 5))]
    dec.step()
    slot = dec._active[ids[2]].slot
    while dec.busy:
        dec.step()
    first = next(r[slot] for r in seen[1:] if slot in r)
    return [dec.results[i] for i in ids], [short, shared, shared, other], first


def test_identical_prompts_admitted_together_are_computed_once(backend, monkeypatch):
    """A request's n = 2 choices (identical prompts, their own seeds) joining a running stream with chunked prefill:
    the first computes the prompt, the second takes a copy of its slot (target rows and state, the drafter's pending
    features) — its slot's first forward is its first token — and each request = its own single run (T = 0.8
    seeded; drafts accepted)."""
    results, prompts, first = _sharing(backend, monkeypatch)
    assert first[0] == results[2].tokens[0] and len(first) <= 8
    for res, prompt, (T, seed) in zip(results, prompts, ((0.0, 0), (0.8, 3), (0.8, 4), (0.8, 5))):
        single = D.speculative_generate(backend.target_runner(), backend.draft_runner("greedy"), prompt,
                                        req(len(res.tokens), eos_ids=frozenset(), temperature=T, seed=seed))
        assert res.tokens == single.tokens
    assert all(sum(r.accepted) > 0 for r in results)


def test_a_choice_that_takes_the_logits_but_not_the_slot_is_caught(backend, monkeypatch):
    """Negative control: the second choice marked prefilled without its leader's rows and state copied."""
    def not_copied(self, leader, f):  # noqa: ANN001, ANN202
        f.prefilled, f.prefilling, f.leader = len(f.prompt), False, None

    monkeypatch.setattr(B.BatchDecoder, "_share_prompt", not_copied)
    with pytest.raises((AssertionError, DFlash2Error)):
        test_identical_prompts_admitted_together_are_computed_once(backend, monkeypatch)
