"""A prompt's prefill computes the logits of the rows it reads: the last row's alone (the first token), every row's
when the request asks for prompt logprobs; the context features of every row either way. On the rewritten fused
ONNX Runtime target (``logits_index``, runtime/ort/fused_target.py and batched_target.py) the LM head runs over that
one row — asserted at the graph's output; the other runners (the plain ``target.onnx`` of the stateful families,
TensorRT, PyTorch) compute every row and return the last. Decoding equals the all-rows path (every row's logits,
the last one read) token for token, greedy and seeded at T > 0, on a dense and a hybrid tiny target, single loop and
batch loop (chunked prefill); a planted bug that takes the wrong row's logits is caught."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime.ort import batched_target, fused_target
from dflash2_trt.runtime.ort.backend import OrtTargetRunner
from test_capi import capi_build, vectors_path  # noqa: F401


class _Outputs:
    """A session stand-in in front of the fused target's: records each call's logits output shape [1, R, V]."""

    def __init__(self, sess, seen: list) -> None:  # noqa: ANN001
        self._sess, self._seen = sess, seen

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._sess, name)

    def run_with_iobinding(self, io) -> None:  # noqa: ANN001
        self._sess.run_with_iobinding(io)
        self._seen.append(tuple(io.get_outputs()[0].shape()))


def _observe(monkeypatch, all_rows: bool = False) -> list:  # noqa: ANN001
    """Every single-loop target call as (kind, new rows, logits rows returned, logits rows the graph computed or
    None where it is not seen); ``all_rows``: the runners ignore ``last_logits`` (the all-rows path)."""
    calls: list = []
    for cls in (fused_target.OrtFusedTargetRunner, OrtTargetRunner):
        real = cls.forward

        def spy(self, ids, last_logits=False, _real=real, _cls=cls):  # noqa: ANN001, ANN202
            graph: list = []
            if _cls is fused_target.OrtFusedTargetRunner:
                assert self._rewritten, "the fused target was not rewritten with DecodeAttention"
                if not isinstance(self.sess, _Outputs):
                    self.sess = _Outputs(self.sess, graph)
                self.sess._seen = graph
            logits, feats = _real(self, ids, last_logits and not all_rows)
            assert feats.shape[0] == len(ids)  # every row's context features
            calls.append((_cls.__name__, len(ids), logits.shape[0], graph[0][1] if graph else None))
            return logits, feats

        monkeypatch.setattr(cls, "forward", spy)
    return calls


def _decode(export, prompts, T: float, **kw):  # noqa: ANN001, ANN003, ANN202
    import dflash2_trt

    with dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0) as g:
        return [g.generate(p, max_new_tokens=16, eos_ids=set(), temperature=T, seed=3, guard=False, **kw)
                for p in prompts]


def _prompts(n: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(2, 200, k).tolist() for k in (37, 61)[:n]]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_prefill_computes_the_last_rows_logits_and_decodes_as_all_rows(arch_exports, monkeypatch, arch):
    """Tokens and accepted drafts = the all-rows path's (greedy and T = 0.8 seeded); the path asserted: the dense
    target's graph computed one logits row per prompt, the hybrid's every row (its graph has no row input) and its
    runner returned the last."""
    export = arch_exports(arch)
    prompts = _prompts()
    for T in (0.0, 0.8):
        with monkeypatch.context() as m:
            calls = _observe(m, all_rows=True)
            want = _decode(export, prompts, T)
            assert [c[2] for c in calls if c[1] in (37, 61)] == [37, 61]
        with monkeypatch.context() as m:
            calls = _observe(m)
            got = _decode(export, prompts, T)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert [g.stats.accepted for g in got] == [w.stats.accepted for w in want]
        assert sum(sum(g.stats.accepted) for g in got) > 0  # the drafter took every row's features
        prefills = [c for c in calls if c[1] in (37, 61)]
        if arch == "llama":
            assert prefills == [("OrtFusedTargetRunner", 37, 1, 1), ("OrtFusedTargetRunner", 61, 1, 1)]
            assert any(c[1] > 1 and c[3] == c[1] for c in calls), "verifies compute every row's logits"
        else:
            assert prefills == [("OrtTargetRunner", 37, 1, None), ("OrtTargetRunner", 61, 1, None)]


def test_prompt_logprobs_compute_every_rows_logits(arch_exports, monkeypatch):
    """A request asking for prompt logprobs reads every row: the graph computes them all, and they equal the ones
    of a second, all-rows run."""
    export = arch_exports("llama")
    prompt = _prompts(1)[0]
    calls = _observe(monkeypatch)
    got = _decode(export, [prompt], 0.0, prompt_logprobs=True)[0]
    assert calls[0] == ("OrtFusedTargetRunner", 37, 37, 37)
    assert len(got.prompt_logprobs) == 36
    assert got.tokens == _decode(export, [prompt], 0.0)[0].tokens


def test_the_batch_prefill_computes_each_prompts_last_row(arch_exports, monkeypatch):
    """The batch loop in chunks (two prompts joining a running stream): each prefill call's graph output holds one
    row per slot; the tokens = the all-rows batch's."""
    import dflash2_trt

    export = arch_exports("llama")
    prompts = _prompts()
    real_run = batched_target.OrtBatchedTargetRunner._run
    real_forward = batched_target.OrtBatchedTargetRunner.forward

    def run(all_rows: bool) -> tuple[list, list]:
        seen: list = []

        def spy(self, lo, hi, rows, last):  # noqa: ANN001, ANN202
            lg, ft = real_run(self, lo, hi, rows, last)
            seen.append((last, lg.shape[1], max(len(r) for r in rows.values())))
            return lg, ft

        def every_row(self, rows, last_logits=False):  # noqa: ANN001, ANN202 - the all-rows path: the last read
            out = real_forward(self, rows)
            return {b: (lg[-1:] if last_logits else lg, ft) for b, (lg, ft) in out.items()}

        with monkeypatch.context() as m:
            m.setattr(batched_target.OrtBatchedTargetRunner, "_run", spy)
            if all_rows:
                m.setattr(batched_target.OrtBatchedTargetRunner, "forward", every_row)
            with dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0) as g:
                g.set_batching(max_batch=3, adaptive=False, prefill_chunk=16, prefill_share=None)
                running = g.submit([3, 4, 5], max_new_tokens=40, eos_ids=set())
                next(iter(running))  # decoding: the prompts joining it prefill in chunks
                hs = [g.submit(p, max_new_tokens=12, eos_ids=set(), temperature=0.8, seed=3) for p in prompts]
                return [h.result().tokens for h in [running, *hs]], seen

    want, _ = run(all_rows=True)
    got, seen = run(all_rows=False)
    assert got == want
    prefills = [s for s in seen if s[0]]
    assert prefills and all(s[1] == 1 for s in prefills)
    assert any(s[2] == 16 for s in prefills), "no prefill chunk of 16 rows ran"


def test_the_wrong_rows_logits_are_caught(arch_exports, monkeypatch):
    """Planted: the prefill's logits taken from the row before the last (the random dense target: every row's
    logits differ); the tokens then differ from the all-rows path's."""
    export = arch_exports("llama", False)
    prompts = _prompts()
    with monkeypatch.context() as m:
        _observe(m, all_rows=True)
        want = [r.tokens for r in _decode(export, prompts, 0.0)]
    rows = fused_target.logits_rows
    monkeypatch.setattr(fused_target, "logits_rows", lambda S, last: rows(S, last) - (1 if last and S > 1 else 0))
    got = [r.tokens for r in _decode(export, prompts, 0.0)]
    assert got != want


# ----------------------------------------------------------------------------------------------------
# The C library's batch (runtime/src/backends/ortBackend.cpp: OrtRunners::targetForwardRows under the batch's
# lastLogits) on the graph rewritten with the op library
# ----------------------------------------------------------------------------------------------------

def _c_joining(capi_build, export, env: dict | None = None) -> list[list[int]]:  # noqa: ANN001
    """The C batch with the op library (DecodeAttention, logits_index), prompts joining a running stream in chunks
    of 16, greedy -> each request's tokens."""
    from test_capi_batch_cache import _joining, c_batches
    from test_capi_ort import _ops_library

    (run,) = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false", "prefill_chunk=16", "prefill_share=0"],
                                             _joining(0.0))],
                       env={"DFLASH2_ORT_OPS": _ops_library(), **(env or {})})
    return [r["tokens"] for r in run["requests"]]


def test_c_batch_prefill_equals_python_and_its_planted_row_is_caught(capi_build, arch_exports):  # noqa: F811
    """The random dense target: the C batch's tokens = the Python runtime's greedy single runs of the same prompts
    (which equal the all-rows path, above); with $DFLASH2_PLANT_LOGITS_ROW=1 (the prefill's logits computed for the
    row before the last) the joining prompts' tokens differ — so the one-row path ran."""
    from test_capi_batch_cache import _joining

    export = arch_exports("llama", False)
    reqs = _joining(0.0)
    want = [r.tokens for r in (_decode_each(export, reqs))]
    assert _c_joining(capi_build, export) == want
    planted = _c_joining(capi_build, export, {"DFLASH2_PLANT_LOGITS_ROW": "1"})
    assert planted[1] != want[1] and planted[2] != want[2]


def _decode_each(export, reqs: list[dict]):  # noqa: ANN001, ANN202
    import dflash2_trt

    with dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0) as g:
        return [g.generate(r["prompt"], max_new_tokens=int(r["options"][1].split("=")[1]), eos_ids=set(), guard=False)
                for r in reqs]


def test_c_session_prefill_equals_python_and_its_planted_row_is_caught(capi_build, arch_exports):  # noqa: F811
    """The single loop (dfl2_session, core/decoder.cpp's prefill through Runners::targetForwardLast) on the random
    dense target with the op library: tokens = the Python runtime's greedy runs; with $DFLASH2_PLANT_LOGITS_ROW=1
    they differ — so the one-row path ran."""
    from test_prefix_cache import _c_sessions

    export = arch_exports("llama", False)
    import dflash2_trt
    from test_prefix_cache import C_NEW

    prompts = _prompts()
    reqs = [(p, 3) for p in prompts]
    (got,) = _c_sessions(capi_build, export, [(["prefix_cache_bytes=0"], reqs)])
    with dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0) as g:
        want = [g.generate(p, max_new_tokens=C_NEW, eos_ids=set(), guard=False).tokens for p in prompts]
    assert [r["tokens"] for r in got] == want
    (planted,) = _c_sessions(capi_build, export, [(["prefix_cache_bytes=0"], reqs)],
                             env={"DFLASH2_PLANT_LOGITS_ROW": "1"})
    assert [r["tokens"] for r in planted] != want
