"""The prefix cache (``runtime/prefix_cache.py``): matching by token ids, what a hit may restore (all but the prompt's
last token; a stateful target only at a snapshot at or below the match; the drafter's context only as far as the
entry rebuilds it), the byte budget and least-recently-used eviction (an evicted entry is never matched: a planted
bug that keeps it fails), and — through the runtime's runners on tiny dense, hybrid, sliding and MoE exports — a
decode after a hit equal to the same decode from an empty cache, with the planted restore bugs caught; a hit on the
runner whose buffers still hold the entry copies nothing, and one after they were overwritten copies them back. The C library's
twin (a dfl2_session keeping its last sequence, runtime/src/core/prefixCache.h) on the same exports: its requests equal
the Python runtime's with its cache and its own without prefix reuse, with its planted restore bugs caught."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.bench.capi import run_driver
from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import prefix_cache as P
from test_capi import capi_build, vectors_path  # noqa: F401


class _Target:
    """A runner stand-in holding ``per_token`` bytes of K/V per position (one array) and, when ``stateful``, a
    snapshot-able state: what the cache reads of a runner."""

    def __init__(self, n: int, per_token: int = 64, stateful: bool = False) -> None:
        self.cache_length, self.per_token, self.stateful = n, per_token, stateful
        self.restored: tuple | None = None

    def prefix_rows(self, n: int, slot: int = 0) -> list[np.ndarray]:
        return [np.zeros((1, n, self.per_token // 4), np.float32)]

    def prefix_state(self, slot: int = 0) -> P.SlotState | None:
        return P.SlotState(linear=([np.full(3, float(self.cache_length), np.float32)], [])) if self.stateful else None

    def restore_prefix(self, rows, n, state, slot=0) -> None:  # noqa: ANN001
        self.restored = (rows[0].shape[1], n, state)


def _store(cache: P.PrefixCache, ids: list[int], stateful: bool = False, states=None) -> None:  # noqa: ANN001
    cache.store(ids, _Target(len(ids), stateful=stateful), None, None, states or {})


def test_a_hit_is_the_longest_common_prefix_and_leaves_the_last_token():
    cache = P.PrefixCache(1 << 20)
    _store(cache, [1, 2, 3, 4, 5, 6])
    assert cache.lookup([9, 9, 9], drafter=False) is None
    assert cache.lookup([1, 2, 3, 7, 8], drafter=False).length == 3  # diverges at the 4th token
    assert cache.lookup([1, 2, 3, 4, 5, 6], drafter=False).length == 5  # the whole entry: the last token recomputed
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], drafter=False).length == 6
    # the drafter's context: none kept, so a request that drafts gets nothing
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], drafter=True) is None
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens) == (5, 3, 14)


def test_a_stateful_target_restores_the_longest_snapshot_at_or_below_the_match():
    cache = P.PrefixCache(1 << 20)
    ids = list(range(1, 41))
    state20 = P.SlotState(linear=([np.full(3, 20.0, np.float32)], []))
    _store(cache, ids, stateful=True, states={20: state20})  # snapshots at 20 (the prompt) and 40 (the end)
    assert cache.lookup(ids[:30] + [99], drafter=False).length == 20  # matched 30: the snapshot at 20
    assert cache.lookup(ids[:19] + [99], drafter=False) is None  # below every snapshot
    hit = cache.lookup(ids + [7], drafter=False)
    assert hit.length == 40
    t = _Target(0, stateful=True)
    cache.restore(hit, t, None)
    assert t.restored[:2] == (40, 40) and t.restored[2].linear[0][0][0] == 40.0  # the end's snapshot, not 20's
    hit = cache.lookup(ids[:25] + [99], drafter=False)
    cache.restore(hit, t, None)
    assert t.restored[:2] == (20, 20) and t.restored[2] is state20


def test_a_sequence_that_extends_an_entry_replaces_it_and_keeps_its_snapshots():
    cache = P.PrefixCache(1 << 20)
    _store(cache, [1, 2, 3, 4], stateful=True)  # a turn: snapshot at its end (4)
    _store(cache, [1, 2, 3, 4, 5, 6, 7, 8], stateful=True)  # the next turn extends it
    assert cache.stats.entries == 1
    assert cache.lookup([1, 2, 3, 4, 5, 9], drafter=False).length == 4  # the first turn's snapshot lives on
    _store(cache, [1, 2, 3, 4, 5, 6, 7, 8], stateful=True)  # the same again: nothing new kept
    assert cache.stats.entries == 1 and cache.stats.stored == 2


def _planted_evict_keeps_entries(self) -> None:  # noqa: ANN001
    """The planted bug: eviction counts the bytes as freed but leaves the entry matchable."""
    total = sum(e.nbytes for e in self._entries)
    evicted = 0
    while total > self.budget_bytes and evicted < len(self._entries):
        total -= self._entries[evicted].nbytes
        evicted += 1
        self.stats.evictions += 1
    self.stats.nbytes, self.stats.entries = total, len(self._entries)


def _evictions(cache: P.PrefixCache) -> None:
    """Within a budget of ~2.5 entries, entries stored in turn: the cache never holds more than its budget, the
    least recently used goes first, and an evicted entry is never matched again."""
    one = P.Entry(ids=np.arange(100, dtype=np.int64), target_rows=_Target(100).prefix_rows(100), states={},
                  drafter_rows=[], feats=None, stateful=False).nbytes
    cache.budget_bytes = int(2.5 * one)
    seqs = [[k] * 100 for k in range(1, 6)]
    _store(cache, seqs[0])
    _store(cache, seqs[1])
    assert cache.lookup(seqs[0] + [0], drafter=False).length == 100  # entry 0 is now the most recently used
    _store(cache, seqs[2])  # over budget: entry 1 (least recently used) goes
    assert cache.stats.nbytes <= cache.budget_bytes and cache.stats.evictions == 1
    assert cache.lookup(seqs[1] + [0], drafter=False) is None
    for s in seqs[3:]:
        _store(cache, s)
        assert cache.stats.nbytes <= cache.budget_bytes
    assert cache.lookup(seqs[0] + [0], drafter=False) is None and cache.lookup(seqs[4] + [0], drafter=False)


def test_the_budget_holds_and_evicted_entries_are_never_matched():
    _evictions(P.PrefixCache(1))


def test_the_planted_eviction_bug_is_caught(monkeypatch):
    """Negative control: an eviction that leaves the entry in place fails the test above."""
    monkeypatch.setattr(P.PrefixCache, "_evict", _planted_evict_keeps_entries)
    with pytest.raises(AssertionError):
        _evictions(P.PrefixCache(1))


def test_a_bad_budget_is_refused_in_one_line():
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(DFlash2Error, match="prefix cache budget"):
            P.PrefixCache(bad)
    cache = P.PrefixCache(0)  # 0: keeps nothing
    _store(cache, [1, 2, 3])
    assert cache.lookup([1, 2, 3, 4], drafter=False) is None and cache.stats.entries == 0


# ----------------------------------------------------------------------------------------------------
# Through the runtime: tiny accepting pairs of every target kind on ONNX Runtime
# ----------------------------------------------------------------------------------------------------

ARCHS = ("llama", "qwen3_5", "gpt_oss", "muse_glimmer", "qwen3_moe")  # dense, hybrid, sliding x2, MoE


@pytest.fixture
def exports(arch_exports):
    """(arch, accepting) -> the export of its tiny pair at block size 8: conftest's session-wide ``arch_exports``
    (windows of 8 in rings of 24 for the sliding ones: a 40-token prompt wraps them), the accepting pair (the copying
    target and drafter), or the random target, whose every layer moves its tokens (qwen3_5's with long-memory linear
    heads)."""
    return arch_exports


@pytest.fixture(params=ARCHS)
def pair_export(request, exports):
    """(arch, export) of each target kind's accepting pair."""
    return request.param, exports(request.param)


def _gens(export, **kw):  # noqa: ANN001, ANN202, ANN003
    import dflash2_trt

    return (dflash2_trt.load(export, backend="ort", threads=1, **kw),
            dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0))


def _conversation(rng: np.random.Generator, first) -> list[tuple[str, list[int], int]]:  # noqa: ANN001
    """(case, prompt, positions a hit restores: dense / stateful) after ``first`` (the result of a 40-token prompt
    whose sequence the cache holds): the next turn (the whole sequence: its end snapshot), a branch inside its answer
    (dense: there; stateful: the prompt's snapshot at 40), the prompt again with one more token (40: a snapshot)."""
    p1, out = first.prompt_tokens, first.tokens
    end = len(p1) + len(out) - 1
    return [("next turn", p1 + out + rng.integers(2, 200, 9).tolist(), (end, end)),
            ("inside the answer", p1 + out[:5] + [7, 8, 9], (len(p1) + 5, len(p1))),
            ("at the prompt's snapshot", p1 + [5], (len(p1), len(p1)))]


def _decode_both(on, off, prompt, T: float = 0.0):  # noqa: ANN001, ANN202
    return tuple(g.generate(prompt, max_new_tokens=24, eos_ids=set(), temperature=T, seed=3, guard=False)
                 for g in (on, off))


def _same_decode(on, off, prompt, want_cached, T: float = 0.0) -> None:  # noqa: ANN001
    """A decode after a hit = the decode from an empty cache: tokens (greedy, or seeded at T > 0), and the drafter
    as good right after the hit (its first three cycles' accepted drafts within 2 of the uncached run's: a
    near-tie may move one, a drafter without its context accepts nothing). ``want_cached``: the positions the
    greedy run restores (the T > 0 run of the same prompt after it may restore more: the greedy run's sequence is
    cached by then)."""
    a, b = _decode_both(on, off, prompt, T)
    assert (a.stats.cached_tokens == want_cached if T == 0 else a.stats.cached_tokens >= want_cached)
    assert b.stats.cached_tokens == 0
    assert a.tokens == b.tokens
    assert sum(b.stats.accepted) > 0
    assert sum(a.stats.accepted[:3]) >= sum(b.stats.accepted[:3]) - 2, \
        f"first cycles' accepted drafts after the hit {a.stats.accepted}, without the cache {b.stats.accepted}"


def test_a_decode_after_a_hit_equals_one_from_an_empty_cache(pair_export):
    """Every target kind, greedy and at T = 0.8 (seeded): hits ending inside a block's answer, at a snapshot and
    between snapshots; the path taken asserted (positions restored, drafts accepted)."""
    arch, export = pair_export
    on, off = _gens(export)
    rng = np.random.default_rng(0)
    with on, off:
        p1 = rng.integers(2, 200, 40).tolist()
        first = on.generate(p1, max_new_tokens=24, eos_ids=set(), guard=False)
        assert first.stats.cached_tokens == 0
        stateful = arch != "llama" and arch != "qwen3_moe"
        for case, prompt, cached in _conversation(rng, first):
            for T in (0.0, 0.8):
                _same_decode(on, off, prompt, cached[stateful], T)
        assert on.prefix_cache.stats.hits == 6


def test_batched_requests_diverging_from_a_cached_prefix(pair_export):
    """The batch loop: four requests sharing a cached prefix and diverging, decoded together (where the backend
    batches the family), each = its own uncached single run; the cache's budget held after evictions (a budget of
    two entries)."""
    arch, export = pair_export
    rng = np.random.default_rng(1)
    p1 = rng.integers(2, 200, 40).tolist()
    on, off = _gens(export)
    with on, off:
        first = on.generate(p1, max_new_tokens=16, eos_ids=set(), guard=False)
        base = p1 + first.tokens
        prompts = [base + rng.integers(2, 200, k).tolist() for k in (1, 3, 6, 9)]
        on.set_batching(max_batch=4, adaptive=False)
        got = [h.result() for h in [on.submit(p, max_new_tokens=16, eos_ids=set()) for p in prompts]]
        want = [off.generate(p, max_new_tokens=16, eos_ids=set(), guard=False) for p in prompts]
        assert [g.tokens for g in got] == [w.tokens for w in want]
        # admitted together, each restores the first sequence
        assert all(g.stats.cached_tokens >= len(base) - 1 for g in got)
        assert sum(sum(g.stats.accepted) for g in got) > 0
        budget = 2 * max(e.nbytes for e in on.prefix_cache._entries)
        on.prefix_cache.budget_bytes = budget
        for p in prompts:
            on.submit(p + [11], max_new_tokens=4, eos_ids=set()).result()
            assert on.prefix_cache.stats.nbytes <= budget
        assert on.prefix_cache.stats.evictions > 0


# ----------------------------------------------------------------------------------------------------
# Planted restore bugs the tests above must catch
# ----------------------------------------------------------------------------------------------------

def _next_turn(export, case: str, check=_same_decode, stateful: bool = False) -> None:  # noqa: ANN001
    """The first turn (a 40-token prompt), then ``check`` on the decode of ``case``'s prompt (``stateful``: the
    target's hits stop at snapshots)."""
    on, off = _gens(export)
    rng = np.random.default_rng(0)
    with on, off:
        first = on.generate(rng.integers(2, 200, 40).tolist(), max_new_tokens=24, eos_ids=set(), guard=False)
        _, prompt, cached = next(c for c in _conversation(rng, first) if c[0] == case)
        check(on, off, prompt, cached[stateful])


def _same_tokens(on, off, prompt, want_cached) -> None:  # noqa: ANN001
    """A random target's greedy decode after a hit = the one from an empty cache (every layer moves its tokens)."""
    a, b = _decode_both(on, off, prompt)
    assert a.stats.cached_tokens == want_cached and a.tokens == b.tokens


def _held_then_overwritten(export, monkeypatch) -> None:  # noqa: ANN001
    """The next turn on the Generator that ran the last one: its K/V buffers (target and drafter) still hold the
    entry's rows, so the restore copies none; after another prompt overwrote them (a stream closed after its first
    token, so no later entry was taken from the buffers), a hit on that entry copies them back. Each decode = the
    one from an empty cache (greedy, tokens)."""
    from dflash2_trt.runtime import kv

    copies: list[int] = []
    put_rows = kv.put_rows

    def counted(arrays, slot, rows):  # noqa: ANN001, ANN202
        copies.append(rows[0].shape[1])
        put_rows(arrays, slot, rows)

    monkeypatch.setattr(kv, "put_rows", counted)
    on, off = _gens(export)
    rng = np.random.default_rng(4)
    with on, off:
        p1 = rng.integers(2, 200, 40).tolist()
        first = on.generate(p1, max_new_tokens=24, eos_ids=set(), guard=False)
        turn2 = p1 + first.tokens + rng.integers(2, 200, 9).tolist()
        copies.clear()
        a, b = _decode_both(on, off, turn2)
        assert a.stats.cached_tokens == len(p1) + len(first.tokens) - 1 and a.tokens == b.tokens
        assert copies == [], f"the runner that holds the entry copied {copies} rows back in"
        # another prompt overwrites the buffers and is closed after its first token: nothing stored after it
        other = on.stream([1] + rng.integers(2, 200, 90).tolist(), max_new_tokens=8, eos_ids=set(), guard=False)
        next(iter(other))
        other.close()
        assert other.result is None and on.prefix_cache.stats.stored == 2
        turn3 = turn2 + a.tokens + [5, 6]
        copies.clear()
        a, b = _decode_both(on, off, turn3)
        assert a.stats.cached_tokens == len(turn2) + len(a.tokens) - 1
        assert a.tokens == b.tokens, "tokens after a hit on overwritten buffers differ from the uncached decode"
        assert copies and min(copies) > 0, "a hit after another prompt overwrote the buffers copied nothing"


def test_a_hit_on_the_buffers_that_hold_it_copies_nothing(exports, monkeypatch):
    """On the random dense target (every layer moves its tokens), whose fused graph writes its new rows' K/V in
    place (the buffer told through KVBuffer.wrote)."""
    _held_then_overwritten(exports("llama", accepting=False), monkeypatch)


def test_a_buffer_that_forgets_what_was_overwritten_is_caught(exports, monkeypatch):
    """Planted: the buffers taken to hold an entry's rows whatever was written since (the write count ignored)."""
    from dflash2_trt.runtime.kv import KVBuffer

    def planted(self, rows, n):  # noqa: ANN001, ANN202
        return bool(rows) and all((r if r.base is None else r.base) is t() for r, t in zip(rows, self._taken))

    monkeypatch.setattr(KVBuffer, "holds", planted)
    with pytest.raises(AssertionError, match="differ from the uncached"):
        _held_then_overwritten(exports("llama", accepting=False), monkeypatch)


def test_a_hit_without_the_drafters_context_is_caught(exports, monkeypatch):
    """The planted bug of engines that restore the target alone: the drafter's context left as garbage (zeros) —
    output still lossless, but the first cycles after the hit draft from nothing."""
    restore = P.PrefixCache.restore

    def planted(self, hit, target, drafter, slot=0):  # noqa: ANN001, ANN202
        restore(self, hit, target, drafter, slot)
        if drafter is not None:
            drafter.restore_context([np.zeros_like(r) for r in drafter.context_rows(hit.length)])

    monkeypatch.setattr(P.PrefixCache, "restore", planted)
    for case in ("next turn", "inside the answer", "at the prompt's snapshot"):
        with pytest.raises(AssertionError, match="accepted"):
            _next_turn(exports("llama"), case)


def test_a_hybrid_state_from_the_snapshot_after_the_hit_is_caught(exports, monkeypatch):
    """On the random qwen3_5 target: a hit between snapshots restores exactly; the planted bug — the K/V cropped
    at the hit, the linear layers' state taken from the next snapshot after it (the request's end) — changes the
    tokens."""
    _next_turn(exports("qwen3_5", False), "inside the answer", _same_tokens, True)
    restore = P.PrefixCache.restore

    def planted(self, hit, target, drafter, slot=0):  # noqa: ANN001, ANN202
        later = [k for k in hit.entry.states if k > hit.length]
        if later:
            states = dict(hit.entry.states)
            states[hit.length] = states[min(later)]
            hit = P.Hit(P.Entry(hit.entry.ids, hit.entry.target_rows, states, hit.entry.drafter_rows,
                                hit.entry.feats, hit.entry.stateful), hit.length)
        restore(self, hit, target, drafter, slot)

    monkeypatch.setattr(P.PrefixCache, "restore", planted)
    with pytest.raises(AssertionError, match="tokens"):
        _next_turn(exports("qwen3_5", False), "inside the answer", _same_tokens, True)


@pytest.mark.parametrize("arch", ["gpt_oss", "muse_glimmer"])
def test_a_ring_restored_unrotated_is_caught(exports, monkeypatch, arch):
    """On the random sliding targets: a hit restores the rings exactly; the planted bug — a ring put back with its
    oldest position in slot 0 (unrotated) while its window positions still say where each position was — changes
    the tokens."""
    from dflash2_trt.runtime.kv import WindowRing

    _next_turn(exports(arch, False), "next turn", _same_tokens, True)
    restore = WindowRing.restore

    def planted(self, slot, snap):  # noqa: ANN001, ANN202
        arrays, positions, floor = snap
        oldest = int(np.argmin(np.where(positions >= 0, positions, np.iinfo(np.int64).max)))
        restore(self, slot, ([np.roll(a, -oldest, axis=1) for a in arrays], positions, floor))

    monkeypatch.setattr(WindowRing, "restore", planted)
    with pytest.raises(AssertionError, match="tokens"):
        _next_turn(exports(arch, False), "next turn", _same_tokens, True)


# ----------------------------------------------------------------------------------------------------
# The C library's twin: a dfl2_session keeps its last sequence (runtime/src/core/prefixCache.h)
# ----------------------------------------------------------------------------------------------------

# A driver (dflash2_trt.bench.capi.run_driver): per run a session made with its options, its requests in turn with
# numpy's uniforms for each request's seed.
_C_SESSIONS = r"""
model = V()
ok(lib.dfl2_model_load(req["export"].encode(), options(req["model"]), C.byref(model)))
out = []
for run in req["runs"]:
    session = V()
    ok(lib.dfl2_session_create(model, options(run["options"]), C.byref(session)))
    out.append([generate(session, prompt, seed) for prompt, seed in run["requests"]])
assert "onnxruntime" not in sys.modules
print(json.dumps(out))
"""

C_NEW = 24


def _c_sessions(build, export, runs: list[tuple[list[str], list[tuple[list[int], int]]]],  # noqa: ANN001
                env: dict | None = None) -> list[list[dict]]:
    """Per run (session options, [(prompt, seed)]) one dfl2_session of the C library over ``export`` (ONNX Runtime, 1
    thread, the op library the Python runtime finds), its requests in turn -> per run, per request {tokens, accepted,
    proposers, cached}."""
    from dflash2_trt.runtime.ort.decode_attention import find_library

    ops = find_library()
    req = {"lib": str(build / "lib" / "libdflash2.so"), "export": str(export),
           "model": ["backend=ort", "threads=1"],
           "runs": [{"options": [f"max_new_tokens={C_NEW}", "eos_ids=", "guard=false", *opts], "requests": reqs}
                    for opts, reqs in runs]}
    return run_driver(_C_SESSIONS, req, {"DFLASH2_ORT_OPS": str(ops or "/nonexistent"), **(env or {})})


def _turns(export, T: float, cases: tuple[str, ...] | None = None):  # noqa: ANN001, ANN202
    """The Python runtime's conversation at temperature ``T`` (a 40-token prompt, then :func:`_conversation`'s cases,
    or those named) through one generator with the prefix cache -> (the requests [(prompt, seed)], its results)."""
    on, _ = _gens(export)
    rng = np.random.default_rng(0)
    with on:
        kw = dict(max_new_tokens=C_NEW, eos_ids=set(), temperature=T, seed=3, guard=False)
        first = on.generate(rng.integers(2, 200, 40).tolist(), **kw)
        prompts = [first.prompt_tokens] + [p for case, p, _ in _conversation(rng, first)
                                           if cases is None or case in cases]
        results = [first] + [on.generate(p, **kw) for p in prompts[1:]]
    return [(p, 3) for p in prompts], results


def _c_equals_twin(got: list[dict], want, off: list[dict]) -> None:  # noqa: ANN001
    """The C session's requests = the Python runtime's with its prefix cache (ids, positions restored, accepted drafts
    and proposers per cycle) and = the C session without prefix reuse (ids)."""
    for i, (g, w, o) in enumerate(zip(got, want, off)):
        assert g["cached"] == w.stats.cached_tokens, (i, g["cached"], w.stats.cached_tokens)
        assert g["tokens"] == w.tokens, f"tokens of request {i}"
        assert g["accepted"] == w.stats.accepted and g["proposers"] == w.stats.proposers, \
            f"accepted drafts of request {i}: {g['accepted']}, the Python runtime's {w.stats.accepted}"
        assert o["cached"] == 0 and o["tokens"] == g["tokens"], f"tokens of request {i} without prefix reuse"


def test_c_session_prefix_reuse_equals_python_twin(capi_build, pair_export):
    """Every target kind, greedy and at T = 0.8 (numpy's uniforms, seed 3): a dfl2_session's conversation — a 40-token
    prompt, the next turn (a hit at the end of the kept sequence), a branch inside its answer (dense: there; stateful:
    the prompt's snapshot, inherited from the first turn), the prompt again with one more token — equals the Python
    runtime's decoding with its prefix cache (ids, positions restored, accepted drafts per cycle) and the same session
    without prefix reuse (ids); hits happen and drafts are accepted after them; a budget below the sequence's bytes
    keeps nothing."""
    arch, export = pair_export
    stateful = arch not in ("llama", "qwen3_moe")
    for T in (0.0, 0.8):
        reqs, want = _turns(export, T)
        on, off, tight = _c_sessions(capi_build, export, [([f"temperature={T}"], reqs),
                                                          ([f"temperature={T}", "prefix_cache_bytes=0"], reqs),
                                                          ([f"temperature={T}", "prefix_cache_bytes=4096"], reqs)])
        _c_equals_twin(on, want, off)
        assert [g["cached"] for g in on[1:]] == [want[1].stats.cached_tokens, 40 + 5 * (not stateful), 40]
        assert sum(sum(g["accepted"]) for g in on[1:]) > 0
        assert [t["cached"] for t in tight] == [0] * len(reqs) and [t["tokens"] for t in tight] == [o["tokens"] for o in off]


def test_c_session_planted_drafter_context_bug_is_caught(capi_build, exports):
    """Negative control: with $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (a hit restores the target but leaves the
    drafter's context zeros) the ids stay lossless but the accepted drafts after each hit differ from the twin's."""
    export = exports("llama")
    reqs, want = _turns(export, 0.0)
    on, off = _c_sessions(capi_build, export, [([], reqs), (["prefix_cache_bytes=0"], reqs)],
                          env={"DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED": "1"})
    with pytest.raises(AssertionError, match="accepted drafts"):
        _c_equals_twin(on, want, off)
    assert [g["tokens"] for g in on] == [o["tokens"] for o in off]


def test_c_session_planted_later_snapshot_bug_is_caught(capi_build, exports):
    """On the random qwen3_5 target (every layer moves its tokens): a hit inside the last answer restores the prompt's
    snapshot and decodes as the twin; with $DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT=1 (the K/V cropped at the hit, the
    linear layers' state from the next snapshot after it) the ids change."""
    export = exports("qwen3_5", False)
    reqs, want = _turns(export, 0.0, ("inside the answer",))
    on, off = _c_sessions(capi_build, export, [([], reqs), (["prefix_cache_bytes=0"], reqs)])
    _c_equals_twin(on, want, off)
    assert on[1]["cached"] == 40
    (planted,) = _c_sessions(capi_build, export, [([], reqs)], env={"DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT": "1"})
    assert planted[1]["cached"] == 40 and planted[1]["tokens"] != off[1]["tokens"]
