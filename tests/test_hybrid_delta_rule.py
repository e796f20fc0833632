"""The hybrid family's delta rule as exported (``targets/hybrid.py`` ``_delta_rule``) where an unstable solve breaks:
its ONNX graph on ONNX Runtime against a float64 row-by-row recurrence (the NumPy twin below) on aligned keys (one
token repeated, two alternating), no decay (g = 0), beta near 1, and calls of every length 1..64, within 1e-4
relative — the Neumann-series solve of ``bench/unstable_delta_rule.py``, planted, fails it. Then a tiny qwen3_5
target with long-memory heads exported and run through the ONNX Runtime runtime against transformers on
repeated-token prompts (logits within 1e-4; greedy output equal on every prompt), and the exporter's check
refusing the planted graph."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.bench.unstable_delta_rule import doubling_delta_rule
from dflash2_trt.targets import hybrid
from helpers import long_memory_heads, make_pair

TOL = 1e-4  # relative to the reference's largest magnitude


def recurrence(q, k, v, g, beta, s0):  # noqa: ANN001, ANN201
    """The gated delta rule row by row in float64 (transformers' recurrent form): q, k [B, H, S, dk], v [B, H, S, dv],
    g, beta [B, H, S], s0 [B, H, dk, dv] -> (outputs [B, H, S, dv], state after each row [B, S, H, dk, dv])."""
    q, k, v, g, beta, st = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, s0))
    outs, states = [], []
    for t in range(q.shape[2]):
        st = st * np.exp(g[:, :, t])[..., None, None]
        delta = (v[:, :, t] - np.einsum("bhk,bhkv->bhv", k[:, :, t], st)) * beta[:, :, t, None]
        st = st + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(np.einsum("bhk,bhkv->bhv", q[:, :, t], st))
        states.append(st)
    return np.stack(outs, 2), np.stack(states, 1)


class _Rule(torch.nn.Module):
    def __init__(self, rule) -> None:  # noqa: ANN001
        super().__init__()
        self.rule = rule

    def forward(self, q, k, v, g, beta, s0, rows):  # noqa: ANN001, ANN201
        return self.rule(q, k, v, g, beta, s0, rows)


def _session(rule, tmp_path, name: str):  # noqa: ANN001, ANN202
    """``rule`` traced as the exporter traces the target graph (rows and state rows dynamic), on ONNX Runtime."""
    import onnxruntime as ort

    from dflash2_trt.export.onnx_utils import trace, trt_parser_refusals

    S, dk, dv = 5, 16, 16
    args = (torch.randn(1, 2, S, dk), torch.randn(1, 2, S, dk), torch.randn(1, 2, S, dv), -torch.rand(1, 2, S),
            torch.rand(1, 2, S), torch.randn(1, 2, dk, dv), torch.arange(S))
    names = ["q", "k", "v", "g", "beta", "s0", "rows"]
    dyn = {n: {2: "rows"} for n in ("q", "k", "v", "g", "beta")} | {"rows": {0: "state_rows"}}
    model = trace(_Rule(rule), args, names, ["out", "states"], dyn, 17)
    assert trt_parser_refusals(model) == []  # no Loop / If, every node in TensorRT's parser table
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _case(rng: np.random.Generator, S: int, keys: str, decay: str, beta: float | None) -> dict[str, np.ndarray]:
    """One call's inputs: keys 'one' (one token repeated: aligned), 'two' (two alternating) or 'random'; decay
    'none' (g = 0), 'long' (0.987 a row) or 'random'; beta fixed or random in (0, 1)."""
    H, dk, dv = 2, 16, 16
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    k = rng.standard_normal((1, H, S, dk))
    if keys != "random":
        base = rng.standard_normal((1, H, 2, dk))
        k = base[:, :, [0] * S] if keys == "one" else base[:, :, [t % 2 for t in range(S)]]
    g = {"none": np.zeros((1, H, S)), "long": np.full((1, H, S), math.log(0.987)),
         "random": -rng.random((1, H, S))}[decay]
    return {"q": unit(rng.standard_normal((1, H, S, dk))) / 4, "k": unit(k),
            "v": rng.standard_normal((1, H, S, dv)).astype(np.float32), "g": g.astype(np.float32),
            "beta": (np.full((1, H, S), beta) if beta is not None else rng.random((1, H, S))).astype(np.float32),
            "s0": rng.standard_normal((1, H, dk, dv)).astype(np.float32), "rows": np.arange(S, dtype=np.int64)}


CASES = [("one", "none", 0.95), ("one", "none", 1.0), ("two", "none", 0.99), ("one", "long", 0.95),
         ("two", "long", 1.0), ("random", "random", None)]


def _worst_error(sess, lengths) -> dict[int, float]:  # noqa: ANN001
    """Rows of a call -> the largest relative error of outputs and states over CASES against the recurrence."""
    rng = np.random.default_rng(0)
    worst = {}
    for S in lengths:
        errs = []
        for case in CASES:
            feed = _case(rng, S, *case)
            out, states = sess.run(None, feed)
            ref_out, ref_states = recurrence(*(feed[n] for n in ("q", "k", "v", "g", "beta", "s0")))
            errs += [np.abs(out - ref_out).max() / np.abs(ref_out).max(),
                     np.abs(states - ref_states).max() / np.abs(ref_states).max()]
        worst[S] = float(max(errs))
    return worst


def test_the_graph_equals_a_float64_recurrence_on_repeated_tokens(tmp_path):
    """Every call length 1..64, every adversarial case: within 1e-4 of the float64 recurrence."""
    worst = _worst_error(_session(hybrid._delta_rule, tmp_path, "stable"), range(1, hybrid.MAX_CALL_ROWS + 1))
    assert max(worst.values()) < TOL, {S: e for S, e in worst.items() if e >= TOL}


def test_the_planted_doubling_solve_fails_it(tmp_path):
    """Negative control: the Neumann-series solve is fine on short calls and far off on long aligned ones."""
    worst = _worst_error(_session(doubling_delta_rule, tmp_path, "doubling"), (4, 32, 64))
    assert worst[4] < TOL and worst[32] > 1.0 and worst[64] > 1e6, worst


def test_a_planted_inverse_one_level_short_fails_it(tmp_path, monkeypatch):
    """Negative control: the blocked inverse one level short (blocks up to 32 rows) is exact to 32 rows and wrong
    past them — which random prompts cannot tell, and these cases do."""
    monkeypatch.setattr(hybrid, "_LEVELS", hybrid._LEVELS - 1)
    worst = _worst_error(_session(hybrid._delta_rule, tmp_path, "short"), (32, 33, 64))
    assert worst[32] < TOL and worst[33] > TOL and worst[64] > TOL, worst


# ----------------------------------------------------------------------------------------------------
# A long-memory target, end to end
# ----------------------------------------------------------------------------------------------------

def _long_memory_pair(tmp_path_factory, name: str):  # noqa: ANN202
    """make-tiny's qwen3_5 pair with long-memory linear heads (helpers.long_memory_heads)."""
    pair = make_pair(tmp_path_factory, name, arch="qwen3_5")
    long_memory_heads(pair / "target")
    return pair


def _repeated_prompts(vocab: int) -> list[list[int]]:
    return [[7] * 64, [7, 9] * 32, [5] * 20 + [11, 12] * 40, [3, 3, 3, 4] * 37]


@pytest.fixture(scope="module")
def long_memory(tmp_path_factory):
    """(pair, HF target, ORT backend, export folder) of the long-memory pair exported by dflash2-export (its check passing)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.targets.adapter import TargetModel

    pair = _long_memory_pair(tmp_path_factory, "long_memory")
    out = tmp_path_factory.mktemp("export") / "long_memory"
    export_model(pair / "target", pair / "drafter", out, progress=False, max_seq_len=512)
    return pair, TargetModel.load(pair / "target"), OrtBackend(out), out


def _hf_logits(t, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    with torch.no_grad():
        return t.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def test_a_long_memory_target_equals_transformers_on_repeated_tokens(long_memory):
    """Prompts of repeated tokens (fed in calls of at most 64 rows) then single steps: logits within 1e-4 of
    transformers' whole-sequence forward; the export's own report includes its repeated-token check."""
    _, t, be, _ = long_memory
    assert {f"target.repeated{i}.logits[0]" for i in range(3)} <= set(be.manifest.verification)
    r = be.target_runner()
    for ids in _repeated_prompts(t.vocab_size):
        r.reset()
        got = np.concatenate([r.forward(ids[:-3])[0]] + [r.forward([i])[0] for i in ids[-3:]])
        want = _hf_logits(t, ids)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < TOL, (len(ids), err)


def test_a_long_memory_target_decodes_as_transformers_greedy(long_memory):
    """Greedy decoding through the runtime (plain and speculative, guard off) = transformers' greedy continuation,
    every prompt (counted, not one prompt's argmax)."""
    import dflash2_trt

    _, t, _, out = long_memory
    differing = []
    with dflash2_trt.load(out, backend="ort", threads=2) as gen:
        for ids in _repeated_prompts(t.vocab_size):
            with torch.no_grad():
                want = t.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(ids):].tolist()
            plain = gen.generate(ids, max_new_tokens=12, eos_ids=set(), speculative=False).tokens
            spec = gen.generate(ids, max_new_tokens=12, eos_ids=set(), guard=False).tokens
            differing += [ids] if plain != want or spec != want else []
    assert differing == []


def test_the_exporter_refuses_the_planted_graph(tmp_path_factory, long_memory, monkeypatch):
    """Negative control for the export check: the doubling solve planted into the target graph passes random
    prompts but not the repeated-token one, so dflash2-export refuses it in one line."""
    from dflash2_trt.export.exporter import export_model

    pair = long_memory[0]
    monkeypatch.setattr(hybrid, "_delta_rule", doubling_delta_rule)
    with pytest.raises(DFlash2Error, match=r"export check: target\.repeated\d\.logits\[0\] differs"):
        export_model(pair / "target", pair / "drafter", tmp_path_factory.mktemp("export") / "planted",
                     progress=False, max_seq_len=512)
