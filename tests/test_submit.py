"""The submit queue for servers (``Generator.submit`` -> Handle, one background batch loop per Generator) on the
accepting pair's export: requests submitted from many threads share batch steps (batch sizes > 1 observed) and
every greedy output equals its own ``generate`` output; chunks stream while others decode; ``cancel()`` frees
the slot before it returns, for active and queued requests; bad requests raise at submit and disturb nobody; a
failing step fails only its decoder's requests; ``close()`` fails what is in flight; the loop gets its runners
from the Backend protocol; backends without ``batching`` serve the queue one request after another."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dflash2_trt
from dflash2_trt import DFlash2Error
from helpers import assert_accepts


@pytest.fixture(scope="module")
def gen(acc_export):
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        yield g


def _prompts(g, lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, g._backend.manifest.target.vocab_size, n).tolist() for n in lengths]


def _free_slots(g, mode="greedy"):  # noqa: ANN001, ANN202
    dec = g._loop._decoders[mode]
    return dec.target.free_slots, dec.busy


def test_many_threads_share_batch_steps_and_keep_their_own_output(gen):
    """8 requests from 8 threads into 3 slots (the rest wait), different lengths, T = 0 and T > 0, drafting every
    step: each stream's chunks add up to its Result; greedy ones equal generate(); every one equals the same request
    decoded alone (its own random stream, whatever shares its steps); steps held more than one sequence."""
    gen.set_batching(max_batch=3, adaptive=False)
    prompts = _prompts(gen, [5, 13, 8, 21, 9, 6, 11, 17])
    maxes = [40, 12, 33, 25, 30, 7, 19, 28]
    temps = [0.0, 0.8, 0.0, 1.1, 0.0, 0.0, 0.7, 0.0]
    before = sum(n for size, n in gen.batch_sizes.items() if size > 1)
    out: list = [None] * 8

    def client(i: int) -> None:
        h = gen.submit(prompts[i], maxes[i], temps[i], seed=i, eos_ids=set())
        out[i] = (list(h), h.result())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    alone = []
    for i in range(8):  # each request alone through the same loop
        h = gen.submit(prompts[i], maxes[i], temps[i], seed=i, eos_ids=set())
        alone.append((list(h), h.result()))
    accepted = []
    for i, ((chunks, res), (chunks1, res1)) in enumerate(zip(out, alone)):
        assert [t for c in chunks for t in c.tokens] == res.tokens and len(res.tokens) == maxes[i]
        assert "".join(c.text for c in chunks) == res.text == gen.decode(res.tokens)
        assert chunks[0].accepted is None and len(chunks[0].tokens) == 1  # the prefill's token
        assert [(c.tokens, c.accepted) for c in chunks] == [(c.tokens, c.accepted) for c in chunks1], i
        assert res.tokens == res1.tokens and res.finish_reason == "length"
        if temps[i] == 0:
            assert res.tokens == gen.generate(prompts[i], maxes[i], guard=False, eos_ids=set()).tokens
            accepted += [c.accepted for c in chunks if c.accepted is not None]
    assert_accepts(accepted, 10, "(submitted, greedy)")
    assert sum(n for size, n in gen.batch_sizes.items() if size > 1) > before  # batching happened
    assert max(gen.batch_sizes) == 3
    assert _free_slots(gen) == (3, False)


def test_adaptive_loop_keeps_greedy_output(gen):
    gen.set_batching(max_batch=4, adaptive=True)
    prompts = _prompts(gen, [7, 10, 12, 5, 9], seed=9)
    hs = [gen.submit(p, 20) for p in prompts]
    for p, h in zip(prompts, hs):
        assert h.result().tokens == gen.generate(p, 20, speculative=False).tokens


def test_chunks_stream_while_others_decode(gen):
    """A short request's stream ends while a long one (same batch) is still decoding: chunks are handed over per
    step, not per request."""
    gen.set_batching(max_batch=2, adaptive=False)
    long, short = _prompts(gen, [9, 6], seed=4)
    hl = gen.submit(long, 300, eos_ids=set())
    hs = gen.submit(short, 6, eos_ids=set())
    assert len(hs.result().tokens) == 6
    assert not hl.done
    first = next(iter(hl))
    assert len(first.tokens) == 1
    hl.cancel()


def test_cancel_frees_the_slot_at_once(gen):
    """cancel() of an active request returns with its slot free and its Result 'cancelled' (the tokens so far, a
    prefix of its full output); cancel() of a queued request returns without it ever taking a slot; the request
    that kept decoding is unchanged."""
    gen.set_batching(max_batch=1, adaptive=False)
    a, b, c = _prompts(gen, [8, 5, 7], seed=6)
    ha = gen.submit(a, 400, eos_ids=set())
    hb = gen.submit(b, 30, eos_ids=set())  # waits: one slot
    it = iter(ha)
    got = [next(it) for _ in range(3)]
    hb.cancel()
    rb = hb.result()
    assert rb.finish_reason == "cancelled" and rb.tokens == [] and hb.done
    ha.cancel()
    assert _free_slots(gen) == (1, False)  # freed before cancel() returned
    ra = ha.result()
    assert ra.finish_reason == "cancelled" and 3 <= len(ra.tokens) < 400
    assert [t for ch in got for t in ch.tokens] == ra.tokens[:sum(len(ch.tokens) for ch in got)]
    assert ra.tokens == gen.generate(a, len(ra.tokens), guard=False, eos_ids=set()).tokens
    assert [t for ch in it for t in ch.tokens] == ra.tokens[sum(len(ch.tokens) for ch in got):]  # the rest, then end
    hc = gen.submit(c, 10, eos_ids=set())  # the slot serves on
    assert hc.result().tokens == gen.generate(c, 10, guard=False, eos_ids=set()).tokens
    hc.cancel()  # finished: no effect
    assert hc.result().finish_reason == "length"


BAD = [  # (submit kwargs, part of the error message)
    ({"prompt": [1, 10**6]}, "prompt token id 1000000 out of range"),
    ({"prompt": [1] * 600}, "does not fit the 512 positions"),
    ({"prompt": []}, "empty prompt"),
    ({"prompt": [1, 2], "max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"prompt": [1, 2], "temperature": float("nan")}, "temperature"),
    ({"prompt": [1, 2], "seed": -1}, "seed must be an integer >= 0"),
    ({"prompt": [1, 2], "selector": "bogus"}, "draft mode must be one of"),
    ({"prompt": 3.5}, "prompt must be a str"),
]


def test_bad_requests_raise_at_submit_and_disturb_nobody(gen):
    gen.set_batching(max_batch=2, adaptive=False)
    p = _prompts(gen, [9], seed=8)[0]
    good = gen.submit(p, 60, eos_ids=set())
    for kw, msg in BAD:
        with pytest.raises(DFlash2Error, match=None) as e:
            gen.submit(**kw)
        assert msg in str(e.value), (kw, str(e.value))
    with pytest.raises(DFlash2Error, match="2 values for 3 prompts"):
        gen.generate_batch([p, p, p], max_new_tokens=[1, 2])
    with pytest.raises(DFlash2Error, match="out of range"):  # one bad prompt: none of the batch is queued
        gen.generate_batch([p, [1, 10**6]])
    with pytest.raises(DFlash2Error, match="requests are in flight"):
        gen.set_batching(max_batch=4)
    assert good.result().tokens == gen.generate(p, 60, guard=False, eos_ids=set()).tokens
    assert gen._loop.idle


def test_a_failing_step_fails_its_requests_only(gen, monkeypatch):
    """A decoder whose step raises fails its own requests with DFlash2Error; requests of another draft mode (their
    own decoder) finish; the failed mode serves again afterwards."""
    gen.set_batching(max_batch=2, adaptive=False)
    p, q = _prompts(gen, [7, 8], seed=12)
    hv = gen.submit(p, 12, selector="viterbi", eos_ids=set())
    hv.result()  # the viterbi decoder exists
    dec = gen._loop._decoders["viterbi"]

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("device lost")

    monkeypatch.setattr(dec, "step", broken)
    hg = gen.submit(q, 30, eos_ids=set())
    hv = gen.submit(p, 30, selector="viterbi", eos_ids=set())
    with pytest.raises(DFlash2Error, match="batch step failed: RuntimeError: device lost"):
        hv.result()
    with pytest.raises(DFlash2Error, match="device lost"):
        list(hv)
    assert hg.result().tokens == gen.generate(q, 30, guard=False, eos_ids=set()).tokens
    assert gen.submit(p, 12, selector="viterbi", eos_ids=set()).result().tokens == \
        gen.generate(p, 12, selector="viterbi", guard=False, eos_ids=set()).tokens


def test_close_fails_requests_in_flight(acc_export):
    g = dflash2_trt.load(acc_export, backend="ort", threads=1)
    h = g.submit([3, 4, 5], 500, eos_ids=set())
    next(iter(h))
    g.close()
    with pytest.raises(DFlash2Error, match="closed"):
        h.result()
    with pytest.raises(DFlash2Error, match="closed"):
        g.submit([3, 4, 5], 5)


def test_batching_goes_through_the_backend_protocol(acc_export, monkeypatch):
    """The loop asks its backend for the batch runners (``Backend.batch_target_runner`` / ``batch_draft_runner``)
    and steps exactly those: no backend module is reached around the protocol."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    made: list[tuple[str, object]] = []
    for name in ("batch_target_runner", "batch_draft_runner"):
        def spy(self, *args, _orig=getattr(OrtBackend, name), _name=name):  # noqa: ANN001, ANN002, ANN202
            runner = _orig(self, *args)
            made.append((_name, runner))
            return runner

        monkeypatch.setattr(OrtBackend, name, spy)
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        assert g._backend.batching
        g.set_batching(adaptive=False)  # every step drafts: the batched drafter is made
        prompts = _prompts(g, [5, 8], seed=4)
        hs = [g.submit(p, 6, eos_ids=set()) for p in prompts]
        assert [h.result().tokens for h in hs] == [g.generate(p, 6, guard=False, eos_ids=set()).tokens
                                                   for p in prompts]
        dec = g._loop._decoders["greedy"]
        assert [n for n, _ in made] == ["batch_target_runner", "batch_draft_runner"]
        assert dec.target is made[0][1] and dec._batched is made[1][1]


def test_unbatched_backend_serves_the_queue_one_by_one(acc_export):
    """The standard (TensorRT-flavour) ONNX graphs have no batched runner: the same loop decodes the submitted
    requests one after another, streaming, cancellable, with generate()'s tokens."""
    from dflash2_trt.api import Generator
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    with Generator(OrtBackend(acc_export, flavour="standard", threads=1), TextTokenizer(acc_export)) as g:
        g.set_batching(adaptive=False)  # the loop runs generate()'s guard only when adaptive
        assert not g._backend.fused and not g._backend.batching
        with pytest.raises(DFlash2Error, match="needs the fused ONNX Runtime target"):
            g._backend.batch_target_runner(2)
        prompts = _prompts(g, [6, 9, 5], seed=2)
        hs = [g.submit(p, 15, eos_ids=set()) for p in prompts]
        for p, h in zip(prompts, hs):
            chunks = list(h)
            assert [t for c in chunks for t in c.tokens] == h.result().tokens
            assert h.result().tokens == g.generate(p, 15, guard=False, eos_ids=set()).tokens
        hl = g.submit(prompts[0], 400, eos_ids=set())  # decoding (holding the runners' lock)
        hq = g.submit(prompts[1], 20, eos_ids=set())  # queued behind it
        next(iter(hl))
        hq.cancel()  # returns before hl finishes
        assert not hl.done and hq.result().finish_reason == "cancelled" and hq.result().tokens == []
        hl.cancel()
        assert hl.result().finish_reason == "cancelled" and len(hl.result().tokens) < 400
        assert g.batch_sizes == {}
