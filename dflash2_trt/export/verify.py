"""Export-time checks of the ONNX graphs against the PyTorch reference models, run with ONNX Runtime.

* target: the HF model (through :class:`~dflash2_trt.targets.adapter.TargetModel`) on random tokens vs the target
  graph run in two chunks through a capacity buffer (prefill, then continuation) — logits and context
  features;
* drafter: :class:`~dflash2_trt.model.DFlash2Drafter` (extend_context, block_forward, draft_from_hidden) on
  random features vs the context → block → head graphs, for both selector modes, argmax and sampling.

Tolerances (``TOL``) are relative to the reference's magnitude. Decisions (argmax, top-K candidates, selected
paths) must agree exactly at fp32; at fp16 a fraction may differ (``MIN_MATCH``: rounding moves near ties).
Proposal probabilities are always compared, as distributions over token ids, on every row whose chosen path
before it agrees (all rows at fp32, at least row 0 otherwise). ONNX Runtime's CPU provider has no bf16
kernels, so a bf16 export is checked through fp32 twins of its graphs (its bf16 weights in fp32 arithmetic)
against the upcast PyTorch models, at the fp32 bounds (``exporter._verify_bf16``). A graph ORT cannot run
fails the export; nothing is ever turned into "skipped".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (TARGET_STATE_ROWS, LinearStateSpec, drafter_context_names, target_kv_names,
                                  target_state_names)
from dflash2_trt.vocabulary import SELECTOR_MODES

TOL = {"fp32": 2e-3, "fp16": 5e-2}
# fraction of decisions that must equal PyTorch's: (argmax and top-K candidates, selected paths)
# (fp16 logits of magnitude ~100 round in steps of 0.06, so near-equal candidates may swap places in top-K)
MIN_MATCH = {"fp32": (1.0, 1.0), "fp16": (0.75, 0.8)}
# the repeated-token prompts every target check runs beside the random one: one token for a hybrid target's longest
# call (its linear layers' max_rows_per_call), the length where an unstable solve of the delta rule shows, for
# REPEATED_TOKENS tokens (how far a repeated token drives a head depends on the token: its beta and decay)
REPEATED_ROWS = 64
REPEATED_TOKENS = 3


def _close(name: str, got: np.ndarray, want: np.ndarray, tol: float, report: dict) -> None:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise DFlash2Error(f"export check: {name} has shape {got.shape}, PyTorch gives {want.shape}")
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = float(np.abs(got - want).max()) / scale if want.size else 0.0
    report[name] = err
    if not np.isfinite(err) or err > tol:
        raise DFlash2Error(f"export check: {name} differs from PyTorch by {err:.3g} (relative; tolerance {tol})")


def _decisions(name: str, got: np.ndarray, want: np.ndarray, report: dict, min_frac: float) -> None:
    frac = float(np.mean(np.asarray(got) == np.asarray(want)))
    report[name + "_match"] = frac
    if frac < min_frac:
        raise DFlash2Error(f"export check: {name} agrees with PyTorch on only {frac:.0%} of entries")


def session(path: Path):  # noqa: ANN201
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _repeated(rng: np.random.Generator, vocab: int, n_one: int, n_two: int) -> np.ndarray:
    """n_one copies of one token, then n_two of two alternating — what indentation, whitespace runs and a list's
    separators do to a target (aligned keys: where an unstable solve of a linear layer's rows cancels)."""
    a, b, c = rng.integers(0, vocab, 3)
    return np.concatenate([np.full(n_one, a), np.tile([b, c], n_two)[:n_two]]).astype(np.int64)


def verify_target(path: Path, target, layer_ids: list[int], dtype: str, np_dtype, seed: int = 0) -> dict:  # noqa: ANN001
    """Two chunks (n1 + n2 rows) through a capacity buffer vs one HF pass over all rows: random tokens (7 + 5) and
    repeated ones (:data:`REPEATED_ROWS` of one token, then 5 of two alternating; for :data:`REPEATED_TOKENS`
    tokens). A target with linear or sliding layers: :func:`verify_state_target`."""
    cfg = getattr(target.model.config, "text_config", None) or target.model.config
    if set(target.family.layer_kinds(cfg)) != {"attention"}:
        return verify_state_target(path, target, layer_ids, dtype, np_dtype, seed)
    rng = np.random.default_rng(seed)
    sess = session(path)
    report: dict = {}
    _two_chunks(sess, target, cfg, layer_ids, rng.integers(0, target.vocab_size, 12), 7, dtype, np_dtype, "target",
                report)
    for i in range(REPEATED_TOKENS):
        _two_chunks(sess, target, cfg, layer_ids, _repeated(rng, target.vocab_size, REPEATED_ROWS, 5), REPEATED_ROWS,
                    dtype, np_dtype, f"target.repeated{i}", report)
    return report


def _two_chunks(sess, target, cfg, layer_ids: list[int], ids: np.ndarray, n1: int, dtype: str, np_dtype,  # noqa: ANN001
                name: str, report: dict) -> None:
    """ids[:n1] then ids[n1:] through a capacity buffer against one HF pass: logits, features, argmax."""
    target.reset(layer_ids)
    want_logits, want_feats = target.forward(torch.from_numpy(ids))
    nl = target.num_layers
    kvh = int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    cap = len(ids)
    past = [np.zeros((1, kvh, cap, d), dtype=np_dtype) for _ in range(2 * nl)]
    logits, feats = [], []
    n = 0
    for chunk in (ids[:n1], ids[n1:]):
        S = len(chunk)
        mask = np.zeros((1, cap + S), dtype=np.int64)
        mask[0, :n] = 1
        mask[0, cap:] = 1
        feed = {"input_ids": chunk.reshape(1, -1).astype(np.int64),
                "position_ids": np.arange(n, n + S, dtype=np.int64).reshape(1, -1), "attention_mask": mask}
        feed.update(zip(target_kv_names(nl), past))
        out = sess.run(None, feed)
        logits.append(out[0][0])
        feats.append(out[1][0])
        for i, p in enumerate(out[2:]):
            past[i][:, :, n:n + S] = p
        n += S
    tol = TOL[dtype]
    _close(f"{name}.logits", np.concatenate(logits), want_logits.float().numpy(), tol, report)
    _close(f"{name}.context_features", np.concatenate(feats).astype(np.float32), want_feats.float().numpy(), tol,
           report)
    _decisions(f"{name}.argmax", np.concatenate(logits).argmax(-1), want_logits.argmax(-1).numpy(), report,
               MIN_MATCH[dtype][0])


def verify_drafter(paths: dict[str, Path], drafter, dtype: str, np_dtype, seed: int = 0) -> dict:  # noqa: ANN001
    """Context → block → head graphs vs the PyTorch drafter on random features (n context rows)."""
    from dflash2_trt.model.drafter import DraftContext

    cfg = drafter.config
    rng = np.random.default_rng(seed)
    n, cap = 9, 12
    L = cfg.num_draft_rows
    feats = rng.standard_normal((n, cfg.context_in_features)).astype(np.float32)
    anchor = int(rng.integers(0, cfg.vocab_size))
    tdtype = drafter.fc.weight.dtype
    with torch.no_grad():
        ctx = DraftContext()
        drafter.extend_context(ctx, torch.from_numpy(feats).to(tdtype), 0)
        h_ref = drafter.block_forward(torch.tensor([anchor]), torch.tensor([n]), ctx.k, ctx.v)
    report: dict = {}
    tol = TOL[dtype]
    # (a) context
    out = session(paths["drafter_context"]).run(None, {
        "context_features": feats[None].astype(np_dtype), "position_ids": np.arange(n, dtype=np.int64)[None]})
    for i in range(cfg.num_hidden_layers):
        _close(f"drafter_context.{i}.key", out[2 * i], ctx.k[i].float().numpy(), tol, report)
        _close(f"drafter_context.{i}.value", out[2 * i + 1], ctx.v[i].float().numpy(), tol, report)
    # (b) block, through a capacity buffer with stale slots
    feed = {"anchor_ids": np.array([anchor], dtype=np.int64), "anchor_position": np.array([n], dtype=np.int64),
            "context_mask": (np.arange(cap) < n).astype(np.int64)[None]}
    for j, name in enumerate(drafter_context_names(cfg.num_hidden_layers)):
        buf = rng.standard_normal((1, out[0].shape[1], cap, out[0].shape[3])).astype(np_dtype)  # stale garbage
        buf[:, :, :n] = out[j]
        feed[name] = buf
    h = session(paths["drafter_block"]).run(None, feed)[0]
    _close("drafter_block.hidden", h, h_ref.float().numpy(), tol, report)
    # (c) heads, fed the reference hidden so selector decisions are compared on equal inputs
    logits = session(paths["drafter_head_independent"]).run(None, {"hidden": h_ref.numpy().astype(np_dtype)})[0]
    with torch.no_grad():
        ref_logits = drafter.logits(h_ref[:, 1:]).float().numpy()
    _close("drafter_head_independent.logits", logits, ref_logits, tol, report)
    _decisions("drafter_head_independent.argmax", logits.argmax(-1), ref_logits.argmax(-1), report,
               MIN_MATCH[dtype][0])
    for mode in SELECTOR_MODES:
        if f"drafter_head_{mode}" not in paths:
            continue
        sess = session(paths[f"drafter_head_{mode}"])
        for temp in (0.0, 0.8):
            u = rng.random((1, L), dtype=np.float32)
            with torch.no_grad():
                drafter_mode = drafter.draft_from_hidden(h_ref, torch.tensor([anchor]), mode, temp,
                                                         torch.from_numpy(u) if temp > 0 else None)
            cand, path, q = sess.run(None, {"hidden": h_ref.numpy().astype(np_dtype),
                                            "anchor_ids": np.array([anchor], dtype=np.int32),
                                            "temperature": np.array([temp], dtype=np.float32), "uniforms": u})
            key = f"drafter_head_{mode}.T{temp}"
            _decisions(key + ".cand_ids", cand, drafter_mode.cand.numpy(), report, MIN_MATCH[dtype][0])
            _decisions(key + ".path_ids", path, drafter_mode.tokens.numpy(), report, MIN_MATCH[dtype][1])
            # proposals over token ids (a reordered near-tie among the candidates moves no mass), on the rows
            # whose chosen path before them agrees (the proposal is conditional on it): every row at fp32
            got_q = np.zeros((L, cfg.vocab_size), dtype=np.float64)  # [L, V]
            np.put_along_axis(got_q, cand[0].astype(np.int64), q[0].astype(np.float64), axis=-1)
            ref_path = drafter_mode.tokens.numpy()[0]
            rows = np.concatenate([[True], np.cumprod(path[0] == ref_path)[:-1].astype(bool)])  # [L]
            report[key + ".proposal_rows_compared"] = float(rows.sum())
            _close(key + ".proposal_probs", got_q[rows], drafter_mode.proposal.numpy()[0][rows], tol, report)
    return report



def verify_state_target(path: Path, target, layer_ids: list[int], dtype: str, np_dtype, seed: int = 0) -> dict:  # noqa: ANN001
    """A target with linear or sliding layers: a prompt chunk (for sliding layers longer than their ring, so that it
    wraps), a 5-row call asking every row's state, a rollback to 2 of its rows (the runtime's rules:
    :class:`~dflash2_trt.runtime.linear_state.LinearStates`, :class:`~dflash2_trt.runtime.kv.WindowRing`), then 3
    new rows — the logits and features of every call against HF passes over the sequence each call continues. Run on
    random tokens and on repeated ones (a prompt of one token, at least :data:`REPEATED_ROWS` long — the longest
    call of a linear layer —, then two tokens alternating; for :data:`REPEATED_TOKENS` tokens)."""
    from dflash2_trt.manifest import SlidingWindowSpec

    rng = np.random.default_rng(seed)
    cfg = getattr(target.model.config, "text_config", None) or target.model.config
    kinds = target.family.layer_kinds(cfg)
    ring_spec = SlidingWindowSpec(**target.family.sliding_window_spec(cfg, 1)) if "sliding" in kinds else None
    # a prompt that wraps the ring when that costs at most a few hundred rows (a linear layer's call: <= 64 rows)
    n_prompt = ring_spec.ring_slots + 7 if ring_spec is not None and ring_spec.ring_slots <= 500 else 7
    sess = session(path)
    report: dict = {"target.ring_wrapped": float(n_prompt > ring_spec.ring_slots)} if ring_spec is not None else {}
    calls = lambda ids, name: _state_calls(sess, target, cfg, kinds, ring_spec, layer_ids, ids, dtype, np_dtype,  # noqa: E731
                                           name, report)
    calls(rng.integers(0, target.vocab_size, n_prompt + 8), "target")
    for i in range(REPEATED_TOKENS):
        calls(_repeated(rng, target.vocab_size, max(n_prompt, REPEATED_ROWS), 8), f"target.repeated{i}")
    return report


def _state_calls(sess, target, cfg, kinds: list[str], ring_spec, layer_ids: list[int], ids: np.ndarray,  # noqa: ANN001
                 dtype: str, np_dtype, name: str, report: dict) -> None:
    """ids = prompt, a 5-row block and 3 fresh rows: the calls of :func:`verify_state_target`."""
    from dflash2_trt.manifest import TARGET_WINDOW_POSITIONS
    from dflash2_trt.runtime.kv import WindowRing, layer_feed, split_present
    from dflash2_trt.runtime.linear_state import LinearStates

    names = target_state_names(kinds)
    kvh, d = target.family.kv_layout(cfg) if hasattr(target.family, "kv_layout") else (  # Gemma 4: per-layer shapes
        int(cfg.num_key_value_heads), int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads))
    states = LinearStates([i for i, k in enumerate(kinds) if k == "linear"],
                          LinearStateSpec(**target.family.linear_state_shapes(cfg)), np_dtype) \
        if "linear" in kinds else None
    ring = WindowRing(kinds.count("sliding"), kvh, d, np_dtype, ring_spec) if ring_spec is not None else None
    n_prompt = len(ids) - 8
    cap = n_prompt + 16
    kv = [np.zeros((1, kvh, cap, d), dtype=np_dtype) for _ in range(2 * kinds.count("attention"))]
    prompt, block, fresh = ids[:n_prompt], ids[n_prompt:n_prompt + 5], ids[n_prompt + 5:]
    n = 0
    for step, (chunk, keep) in enumerate(((prompt, n_prompt), (block, 2), (fresh, 3))):
        S = len(chunk)
        mask = np.zeros((1, cap + S), dtype=np.int64)
        mask[0, :n] = 1
        mask[0, cap:] = 1
        feed = {"input_ids": chunk.reshape(1, -1).astype(np.int64), "attention_mask": mask,
                "position_ids": np.arange(n, n + S, dtype=np.int64).reshape(1, -1)}
        by_kind: dict[str, list[np.ndarray]] = {"attention": kv}
        if states is not None:
            feed[TARGET_STATE_ROWS] = np.arange(S, dtype=np.int64)
            by_kind["linear"] = states.feed()
        if ring is not None:
            by_kind["sliding"], feed[TARGET_WINDOW_POSITIONS] = ring.feed()
        feed.update(zip(names, layer_feed(kinds, by_kind)))
        out = sess.run(None, feed)
        new = split_present(kinds, out[2:])
        for buf, x in zip(kv, new["attention"]):
            buf[:, :, n:n + S] = x
        if states is not None:
            states.update(new["linear"], 0, {0: S}, True)
            states.rollback(keep)
        if ring is not None:
            ring.write(0, n, new["sliding"])
            ring.crop(0, n + keep)
        history = np.concatenate([prompt, block[:2]]) if step == 2 else np.concatenate([prompt, block])[:n]
        target.reset(layer_ids)
        want_logits, want_feats = target.forward(torch.from_numpy(np.concatenate([history, chunk])))
        tol = TOL[dtype]
        _close(f"{name}.logits[{step}]", out[0][0], want_logits[n:].float().numpy(), tol, report)
        _close(f"{name}.context_features[{step}]", out[1][0].astype(np.float32), want_feats[n:].float().numpy(),
               tol, report)
        _decisions(f"{name}.argmax[{step}]", out[0][0].argmax(-1), want_logits[n:].argmax(-1).numpy(), report,
                   MIN_MATCH[dtype][0])
        n += keep
