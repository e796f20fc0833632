"""The C library's batch (dfl2_batch, runtime/src/core/batch.cpp) on ONNX Runtime exports of tiny dense, hybrid and
sliding-window pairs: chunked prefill ("prefill_chunk": a prompt joining running streams computed a chunk a step)
gives the tokens of whole-prompt prefill, greedy and seeded at T > 0, with the path asserted through
dfl2_batch_info's prefill counters. (The call-for-call twin test against the Python BatchDecoder and the planted
chunk bug live with the other batch twins in tests/test_capi.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash2_trt.bench.capi import run_driver
from test_capi import capi_build, vectors_path  # noqa: F401


@pytest.fixture(scope="module")
def exports(arch_exports):
    """(arch, accepting) -> conftest's tiny export of that family (block size 8, max 512 positions)."""
    return arch_exports


# A driver (dflash2_trt.bench.capi.run_driver): per run a batch made with its options, its requests submitted at
# their steps with numpy's uniforms for each request's seed, stepped until idle.
_C_BATCH = r"""
model = V()
ok(lib.dfl2_model_load(req["export"].encode(), options(req["model"]), C.byref(model)))
keep = []
out = []
for run in req["runs"]:
    batch = V()
    ok(lib.dfl2_batch_create(model, options(run["options"]), C.byref(batch)))
    ids, step, pending, waves = {}, 0, 0, []
    todo = sorted(range(len(run["requests"])), key=lambda i: (run["requests"][i]["wave"], run["requests"][i]["after"]))
    while todo or pending:
        if not pending and todo and run["requests"][todo[0]]["wave"] > len(waves):  # the batch idle: the next wave
            info = BatchInfo()
            ok(lib.dfl2_batch_get_info(batch, C.byref(info)))
            waves.append({k: getattr(info, k) for k, _ in BatchInfo._fields_})
            step = 0
        while todo and run["requests"][todo[0]]["wave"] == len(waves) and run["requests"][todo[0]]["after"] <= step:
            i = todo.pop(0)
            r = run["requests"][i]
            prompt = (C.c_int32 * len(r["prompt"]))(*r["prompt"])
            keep += [prompt, UNIFORM(numpy_uniforms(r["seed"]))]
            q = Request(C.sizeof(Request), C.cast(prompt, P(C.c_int32)), len(r["prompt"]), options(r["options"]),
                        TOKENS(0), DONE(0), None, keep[-1], None)
            rid = C.c_uint64()
            ok(lib.dfl2_batch_submit(batch, C.byref(q), C.byref(rid)))
            ids[i] = rid.value
        n = C.c_size_t()
        ok(lib.dfl2_batch_step(batch, C.byref(n)))
        pending, step = n.value, step + 1
    got = []
    for i in range(len(run["requests"])):
        toks, n, st, plain = P(C.c_int32)(), C.c_size_t(), Stats(), C.c_int32()
        ok(lib.dfl2_batch_get_result(batch, ids[i], C.byref(toks), C.byref(n), C.byref(st), C.byref(plain)))
        got.append({"tokens": toks[: n.value], "accepted": st.accepted[: st.cycles], "cached": st.cached_tokens})
    info = BatchInfo()
    ok(lib.dfl2_batch_get_info(batch, C.byref(info)))
    out.append({"requests": got, "info": {k: getattr(info, k) for k, _ in BatchInfo._fields_}, "waves": waves})
print(json.dumps(out))
"""


def c_batches(build: Path, export: Path, runs: list[tuple[list[str], list[dict]]], env: dict | None = None) -> list:
    """Per run (batch options, requests {prompt, seed, wave, after, options}) one dfl2_batch of the C library over
    ``export`` (ONNX Runtime, 1 thread, ONNX Runtime's own ops); the requests of wave k are submitted once the batch
    is idle after wave k - 1, each before the wave's step ``after`` -> per run {requests: [{tokens, accepted,
    cached}], info: dfl2_batch_info's fields at the end, waves: its fields before each wave after the first}."""
    req = {"lib": str(build / "lib" / "libdflash2.so"), "export": str(export), "model": ["backend=ort", "threads=1"],
           "runs": [{"options": opts, "requests": [{"options": [], "seed": 0, "after": 0, "wave": 0, **r}
                                                   for r in reqs]}
                    for opts, reqs in runs]}
    return run_driver(_C_BATCH, req, {"DFLASH2_ORT_OPS": "/nonexistent", **(env or {})})


def _joining(T: float) -> list[dict]:
    """A running stream (long enough to outlast the others' chunks), then two long prompts joining it (after steps 2
    and 4) and a short one; greedy or seeded."""
    import numpy as np

    rng = np.random.default_rng(5)
    return [{"prompt": rng.integers(2, 200, n).tolist(), "seed": 10 + i, "after": after,
             "options": [f"temperature={T}", f"max_new_tokens={new}", "eos_ids="]}
            for i, (n, new, after) in enumerate([(12, 160, 0), (70, 24, 2), (45, 24, 4), (9, 24, 4)])]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gpt_oss"])
def test_chunked_prefill_equals_whole_prompts(capi_build, exports, arch):
    """Dense, hybrid (the linear state carried from chunk to chunk) and sliding (rings of 24 wrapped by the chunks):
    long prompts joining a running stream, prefilled 16 rows a step, give the tokens of whole-prompt prefill, greedy
    and at T = 0.8 with the same seeds (every request drafting, so no draw depends on when the others start); the
    path asserted: the chunked run made more prefill calls over the same prompt rows, drafts were accepted."""
    export = exports(arch)
    for T in (0.0, 0.8):
        reqs = _joining(T)
        fixed = ["max_batch=4", "adaptive=false", "prefill_share=0"]
        chunked, whole = c_batches(capi_build, export, [([*fixed, "prefill_chunk=16"], reqs),
                                                        ([*fixed, "prefill_chunk=0"], reqs)])
        assert [r["tokens"] for r in chunked["requests"]] == [r["tokens"] for r in whole["requests"]], T
        rows = sum(len(r["prompt"]) for r in reqs)
        assert chunked["info"]["prefill_rows"] == whole["info"]["prefill_rows"] == rows
        assert chunked["info"]["prefill_calls"] >= whole["info"]["prefill_calls"] + 5  # 70 + 45 rows in chunks of 16
        assert sum(sum(r["accepted"]) for r in chunked["requests"]) > 0


def test_hybrid_planted_chunk_shift_is_caught(capi_build, exports):
    """Negative control on the hybrid export: with $DFLASH2_PLANT_PREFILL_CHUNK_SHIFT=1 (a chunk after the first
    takes its ids one position early) the joining prompts' tokens differ from whole-prompt prefill's."""
    export = exports("qwen3_5")
    reqs = _joining(0.0)
    fixed = ["max_batch=4", "adaptive=false", "prefill_share=0"]
    (whole,) = c_batches(capi_build, export, [([*fixed, "prefill_chunk=0"], reqs)])
    (planted,) = c_batches(capi_build, export, [([*fixed, "prefill_chunk=16"], reqs)],
                           env={"DFLASH2_PLANT_PREFILL_CHUNK_SHIFT": "1"})
    assert planted["requests"][0]["tokens"] == whole["requests"][0]["tokens"]  # the running stream: whole at start
    assert planted["requests"][1]["tokens"] != whole["requests"][1]["tokens"]


# ----------------------------------------------------------------------------------------------------
# Prefix reuse: the batch's SharedPrefixCache against the Python runtime's PrefixCache (Generator.submit)
# ----------------------------------------------------------------------------------------------------

NEW = 24


def _py_waves(export, waves: list[list[list[int]]], T: float, budget: int | None = None):  # noqa: ANN001, ANN202
    """The Python runtime's batch loop (Generator.submit, 4 slots, every request drafting) with its prefix cache
    (``budget`` bytes, else the default): each wave's prompts submitted together once the previous wave ended ->
    (per wave its results, per wave the cache's stats after it)."""
    import dflash2_trt

    kw = {} if budget is None else {"prefix_cache_bytes": budget}
    out, stats = [], []
    with dflash2_trt.load(export, backend="ort", threads=1, **kw) as g:
        g.set_batching(max_batch=4, adaptive=False)
        for w, prompts in enumerate(waves):
            hs = [g.submit(p, max_new_tokens=NEW, eos_ids=set(), temperature=T, seed=10 * w + i)
                  for i, p in enumerate(prompts)]
            out.append([h.result() for h in hs])
            st = g.prefix_cache.stats
            stats.append({"hits": st.hits, "nbytes": st.nbytes, "evictions": st.evictions, "entries": st.entries})
    return out, stats


def _c_requests(waves: list[list[list[int]]], T: float) -> list[dict]:
    return [{"prompt": p, "seed": 10 * w + i, "wave": w, "options": [f"temperature={T}", f"max_new_tokens={NEW}",
                                                                     "eos_ids="]}
            for w, prompts in enumerate(waves) for i, p in enumerate(prompts)]


def _conversation_waves(export, T: float):  # noqa: ANN001, ANN202
    """Wave 0: a 40-token prompt; wave 1, admitted together and diverging from its cached sequence: the next turn
    (a hit at the sequence's end), a branch inside its answer (dense: there; stateful: the prompt's snapshot), the
    prompt again with one more token (a snapshot) -> (the waves, the Python runtime's results and cache stats)."""
    import numpy as np

    rng = np.random.default_rng(0)
    p1 = rng.integers(2, 200, 40).tolist()
    ((first,),), _ = _py_waves(export, [[p1]], T)
    out = first.tokens
    waves = [[p1], [p1 + out + rng.integers(2, 200, 9).tolist(), p1 + out[:5] + [7, 8, 9], p1 + [5]]]
    py, stats = _py_waves(export, waves, T)
    return waves, py, stats


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gpt_oss"])
def test_batch_prefix_reuse_equals_python_twin_and_empty_cache(capi_build, exports, arch):
    """Dense, hybrid and sliding, greedy and at T = 0.8 (numpy's uniforms, the same seeds): a batch's second wave —
    three requests admitted together that diverge from the first request's cached sequence — equals the Python
    runtime's batch loop with its cache (ids, positions restored per request, the cache's bytes) and the same batch
    without prefix reuse (ids); hits happen (a stateful target's at its snapshots) and drafts are accepted after
    them; dfl2_batch_info counts the hits and restored positions."""
    export = exports(arch)
    stateful = arch != "llama"
    for T in (0.0, 0.8):
        waves, py, stats = _conversation_waves(export, T)
        reqs = _c_requests(waves, T)
        on, off = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false"], reqs),
                                                 (["max_batch=4", "adaptive=false", "prefix_cache_bytes=0"], reqs)])
        want = [r for wave in py for r in wave]
        assert [r["tokens"] for r in on["requests"]] == [w.tokens for w in want], T
        assert [r["tokens"] for r in off["requests"]] == [w.tokens for w in want], T
        assert [r["cached"] for r in on["requests"]] == [w.stats.cached_tokens for w in want], T
        assert [r["accepted"] for r in on["requests"]] == [w.stats.accepted for w in want], \
            f"accepted drafts {[r['accepted'] for r in on['requests']]}, the Python twin's {[w.stats.accepted for w in want]}"
        cached = [r["cached"] for r in on["requests"]]
        assert cached[0] == 0 and min(cached[1:]) >= 40 and cached[2] == (40 if stateful else 45)
        assert [r["cached"] for r in off["requests"]] == [0] * 4
        assert (on["info"]["prefix_hits"], on["info"]["cached_tokens"]) == (3, sum(cached))
        assert on["waves"][0]["prefix_cache_bytes"] == stats[0]["nbytes"]  # the twins weigh an entry alike
        assert sum(sum(r["accepted"]) for r in on["requests"][1:]) > 0


def _eviction_waves():  # noqa: ANN202
    """A, then B (a budget of one entry evicts A), then B's prompt + 1 (a hit), A's + 1 (nothing to match)."""
    import numpy as np

    rng = np.random.default_rng(3)
    a, b = rng.integers(2, 200, 40).tolist(), rng.integers(2, 200, 40).tolist()
    return [[a], [b], [b + [6]], [a + [5]]]


def test_batch_prefix_eviction_equals_python_twin(capi_build, exports):
    """The budget holds one entry: the C batch's cache never exceeds it after any wave, evicts least recently used
    first, never matches an evicted entry, and restores what the Python PrefixCache restores (positions per request,
    bytes and evictions after each wave); tokens = the uncached run's."""
    export = exports("llama")
    waves = _eviction_waves()
    _, one = _py_waves(export, waves[:1], 0.0)
    budget = one[0]["nbytes"] * 3 // 2
    py, stats = _py_waves(export, waves, 0.0, budget)
    (on,) = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false", f"prefix_cache_bytes={budget}"],
                                            _c_requests(waves, 0.0))])
    want = [w[0] for w in py]
    assert [r["cached"] for r in on["requests"]] == [w.stats.cached_tokens for w in want] == [0, 0, 40, 0]
    assert [r["tokens"] for r in on["requests"]] == [w.tokens for w in want]
    seen = [*on["waves"], on["info"]]
    assert all(0 < i["prefix_cache_bytes"] <= budget and i["prefix_entries"] == 1 for i in seen)
    assert [(i["prefix_cache_bytes"], i["prefix_evictions"]) for i in seen] == \
        [(s["nbytes"], s["evictions"]) for s in stats]
    assert on["info"]["prefix_evictions"] >= 3


def test_batch_planted_evicted_entry_matched_is_caught(capi_build, exports):
    """Negative control: with $DFLASH2_PLANT_PREFIX_EVICTED_MATCHED=1 (evicted entries stay matchable) the last wave
    (A's prompt again) restores A's evicted prefix, which the eviction test's comparison with the Python twin refuses."""
    export = exports("llama")
    waves = _eviction_waves()
    _, one = _py_waves(export, waves[:1], 0.0)
    budget = one[0]["nbytes"] * 3 // 2
    (planted,) = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false", f"prefix_cache_bytes={budget}"],
                                                 _c_requests(waves, 0.0))],
                           env={"DFLASH2_PLANT_PREFIX_EVICTED_MATCHED": "1"})
    assert [r["cached"] for r in planted["requests"]] != [0, 0, 40, 0]


def test_batch_planted_drafter_context_bug_is_caught(capi_build, exports):
    """Negative control: with $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (a hit restores the target but leaves the
    drafter's context zeros) the ids stay lossless but the accepted drafts after the hits differ from the twin's."""
    export = exports("llama")
    waves, py, _ = _conversation_waves(export, 0.0)
    want = [r for wave in py for r in wave]
    (on,) = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false"], _c_requests(waves, 0.0))],
                      env={"DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED": "1"})
    assert [r["tokens"] for r in on["requests"]] == [w.tokens for w in want]
    assert [r["accepted"] for r in on["requests"]][1:] != [w.stats.accepted for w in want][1:]


def test_batch_planted_later_snapshot_bug_is_caught(capi_build, exports):
    """On the random qwen3_5 target (every layer moves its tokens): a branch inside the cached answer restores the
    prompt's snapshot and decodes as the uncached batch; with $DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT=1 (the K/V cropped
    at the hit, the linear layers' state from the snapshot after it) its ids change."""
    import numpy as np

    export = exports("qwen3_5", False)
    rng = np.random.default_rng(0)
    p1 = rng.integers(2, 200, 40).tolist()
    reqs = _c_requests([[p1]], 0.0)
    (first,) = c_batches(capi_build, export, [(["max_batch=4", "adaptive=false"], reqs)])
    out = first["requests"][0]["tokens"]
    reqs = _c_requests([[p1], [p1 + out[:5] + [7, 8, 9]]], 0.0)
    opts = ["max_batch=4", "adaptive=false"]
    on, off = c_batches(capi_build, export, [(opts, reqs), ([*opts, "prefix_cache_bytes=0"], reqs)])
    (planted,) = c_batches(capi_build, export, [(opts, reqs)], env={"DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT": "1"})
    assert on["requests"][1]["cached"] == planted["requests"][1]["cached"] == 40
    assert on["requests"][1]["tokens"] == off["requests"][1]["tokens"]
    assert planted["requests"][1]["tokens"] != off["requests"][1]["tokens"]


def test_session_keeps_several_entries_as_the_python_twin(capi_build, exports):
    """A dfl2_session's cache is the same multi-entry one: A, then B, then A's prompt + 1 restores A's 40 positions
    (a one-sequence cache would have kept only B), as the Python runtime's generate with its PrefixCache does; with a
    one-entry budget A is evicted and nothing is restored, as there."""
    import dflash2_trt
    from test_prefix_cache import C_NEW, _c_sessions

    export = exports("llama")
    a, b, _, _ = [w[0] for w in _eviction_waves()]
    prompts = [a, b, a + [5]]
    got = {}
    for budget in (None, "one"):
        kw = {}
        if budget == "one":
            with dflash2_trt.load(export, backend="ort", threads=1) as g:
                g.generate(a, max_new_tokens=C_NEW, eos_ids=set(), guard=False)
                kw = {"prefix_cache_bytes": g.prefix_cache.stats.nbytes * 3 // 2}
        with dflash2_trt.load(export, backend="ort", threads=1, **kw) as g:
            want = [g.generate(p, max_new_tokens=C_NEW, eos_ids=set(), guard=False) for p in prompts]
        opts = [f"prefix_cache_bytes={kw['prefix_cache_bytes']}"] if kw else []
        (on,) = _c_sessions(capi_build, export, [(opts, [(p, 3) for p in prompts])])
        assert [g["cached"] for g in on] == [w.stats.cached_tokens for w in want]
        assert [g["tokens"] for g in on] == [w.tokens for w in want]
        got[budget] = [g["cached"] for g in on]
    assert got == {None: [0, 0, 40], "one": [0, 0, 0]}
