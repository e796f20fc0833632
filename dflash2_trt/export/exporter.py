"""Export a target + DFlash 2 drafter pair into a self-contained ONNX folder (``dflash2-export``).

Written into DIR (atomically: built in a hidden temporary sibling folder, moved into place only when every
graph passed ``onnx.checker`` and, where ONNX Runtime can run it, the comparison with PyTorch)::

    target.onnx                     input_ids, position_ids, attention_mask, past_key_values.{i}.key/.value
                                    -> logits, context_features, present.{i}.key/.value (new rows only)
    drafter_context.onnx            (a) context_features, position_ids -> context.{i}.key/.value (new rows)
    drafter_block.onnx              (b) anchor_ids, anchor_position, context_mask, context.{i}.key/.value
                                    -> hidden [B, bs, H]
    drafter_head_{mode}.onnx        (c) hidden, anchor_ids, temperature, uniforms
                                    -> cand_ids, path_ids, proposal_probs; selector as standard ONNX ops
    drafter_head_{mode}.plugin.onnx same, selector = one trt.plugins::DFlash2PathSelector node (TensorRT)
    weights.bin                     every initializer >= 1 KiB, stored once (shared by all graphs)
    tokenizer.json, tokenizer_config.json[, chat_template.jinja, special_tokens_map.json]
    manifest.json                   see :mod:`dflash2_trt.manifest`

KV caches use the capacity-buffer convention of :mod:`dflash2_trt.export.onnx_graphs`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (FORMAT, KV_CAPACITY_STEP, MANIFEST_FILE, MANIFEST_VERSION, ExportManifest,
                                 drafter_context_names, parse_manifest, target_kv_names,
                                 target_present_names, write_manifest)
from dflash2_trt.outdir import TempFolder, check_replace, export_owner, write_error
from dflash2_trt.validate import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, check_size
from dflash2_trt.vocabulary import DRAFT_MODES, DTYPES, INDEPENDENT, SELECTOR_MODES, head_key

DEFAULT_OPSET = 17
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
#: bump when the graphs' content or conventions change (keys caches of exported models)
EXPORTER_REVISION = 3


def _progress(steps: list[str], enabled: bool):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=len(steps), desc="dflash2-export", unit="step", file=sys.stderr, disable=not enabled,
                bar_format="{desc}: {n}/{total} |{bar:20}| {postfix} [{elapsed}]")


def export_model(
    target_path: str | Path,
    drafter_path: str | Path,
    out: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    dtype: str = "fp32",
    block_size: int | None = None,
    max_seq_len: int | None = None,
    progress: bool = True,
    verify: bool = True,
    ort_flavour: bool = True,
    quantization: Any = None,
    draft_vocab: int = 0,
    overwrite: bool = False,
) -> ExportManifest:
    """Export and return the manifest. Raises :class:`DFlash2Error` on bad input; DIR is left untouched
    (absent or as it was) on any failure. ``ort_flavour``: also write the fused ONNX Runtime target
    (``target_ort.onnx``, fp32 only; :mod:`dflash2_trt.export.ort_graph`); ``quantization``: a
    :class:`~dflash2_trt.export.quantize.QuantSpec` (weight-only: MatMulNBits variants of the ORT graphs of an
    fp32 export, and the TensorRT flavour ``target_qdq.onnx`` with explicit Q/DQ weights); ``draft_vocab`` N > 0: the drafter's
    LM head keeps only the N most frequent ids of its training responses (``token_counts.npy``); ``overwrite``:
    replace an export of ours that holds files its manifest does not list (see :mod:`dflash2_trt.outdir`)."""
    from dflash2_trt.export.quantize import QuantSpec

    quant = quantization if quantization is not None else QuantSpec()
    if quant.enabled and dtype == "bf16":
        raise DFlash2Error(f"--quantize {quant.kind} takes fp32 (ONNX Runtime + TensorRT graphs) or fp16 (TensorRT "
                           "Q/DQ target) exports, not bf16")
    if dtype not in DTYPES:
        raise DFlash2Error(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(opset, int) or not 14 <= opset <= 20:
        raise DFlash2Error(f"--opset must be in [14, 20] (the TorchScript exporter's range), got {opset}")
    if draft_vocab < 0:
        raise DFlash2Error(f"--draft-vocab must be >= 0 (0: the full vocabulary), got {draft_vocab}")
    check_size("--block-size", block_size, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
    out = Path(out)
    check_replace(out, "--out", export_owner, overwrite)
    try:
        with TempFolder(out, "export") as t:
            manifest = _export_into(t.path, Path(target_path), Path(drafter_path), opset, dtype, block_size,
                                    max_seq_len, progress, verify, ort_flavour and dtype == "fp32", quant,
                                    draft_vocab)
            if not overwrite:
                check_replace(out, "--out", export_owner)  # again: it may have changed meanwhile
            t.publish()
    except OSError as e:  # disk full, permissions: the temporary folder is gone, ``out`` as it was
        raise write_error(e, out) from None
    return manifest


def _export_into(tmp: Path, target_path: Path, drafter_path: Path, opset: int, dtype: str,
                 block_size: int | None, max_seq_len: int | None, progress: bool, verify: bool, ort_flavour: bool,
                 quant: Any, draft_vocab: int) -> ExportManifest:
    import numpy as np
    import torch

    from dflash2_trt import __version__
    from dflash2_trt.export import onnx_graphs, onnx_utils
    from dflash2_trt.export import selector_contract as sc
    from dflash2_trt.model import load_drafter
    from dflash2_trt.model.checkpoint import draft_vocabulary
    from dflash2_trt.target import TargetModel, resolve_target_path

    steps = ["load models", "export target", "export drafter", "export heads", "save", "onnx.checker",
             "verify vs PyTorch", "tokenizer + manifest"]
    bar = _progress(steps, progress)

    def step(i: int) -> None:
        bar.set_postfix_str(steps[i])
        if i:
            bar.update(1)

    step(0)
    drafter = load_drafter(drafter_path)
    target = TargetModel.load(target_path)
    target_dir = resolve_target_path(target_path)
    target.check_drafter(drafter.config)
    onnx_graphs.check_target_supported(target.model)
    if block_size is not None and block_size != drafter.config.block_size:
        drafter = drafter.at_block_size(block_size)
    cfg = drafter.config
    max_pos = target.max_positions
    if max_seq_len is None:
        max_seq_len = min(max_pos, 4096)
    if not 2 <= max_seq_len <= max_pos:
        raise DFlash2Error(f"--max-seq-len must be in [2, {max_pos}] (the target's max_position_embeddings), "
                           f"got {max_seq_len}")
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    npdt = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[dtype]
    target.model.to(tdt)
    drafter.to(tdt)
    drafter.bind_target(target.embed_weight, target.lm_head_weight)
    if draft_vocab:
        drafter.restrict_vocab(torch.from_numpy(draft_vocabulary(drafter, draft_vocab)))
    layer_ids = list(cfg.target_layer_ids or [])
    hf_cfg = target.model.config
    nl, kvh = target.num_layers, int(hf_cfg.num_key_value_heads)
    d = int(target.model.model.layers[0].self_attn.head_dim)
    B = 2  # traced with batch 2 so no batch-1 shape gets baked in
    bs = cfg.block_size
    dkvh, dd = cfg.num_key_value_heads, cfg.head_dim
    models: dict[str, Any] = {}
    graph_meta: dict[str, dict] = {}

    step(1)
    kv_names = target_kv_names(nl)
    present = target_present_names(nl)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
           "attention_mask": {0: "batch", 1: "capacity_plus_sequence"}, "logits": {0: "batch", 1: "sequence"},
           "context_features": {0: "batch", 1: "sequence"}}
    dyn.update({n: {0: "batch", 2: "capacity"} for n in kv_names})
    dyn.update({n: {0: "batch", 2: "sequence"} for n in present})
    args = (torch.randint(0, target.vocab_size, (B, 3)), torch.arange(3).repeat(B, 1),
            torch.ones(B, 4 + 3, dtype=torch.long), *[torch.zeros(B, kvh, 4, d, dtype=tdt) for _ in kv_names])
    models["target.onnx"] = onnx_utils.trace(onnx_graphs.TargetGraph(target.model, layer_ids).eval(), args,
                                             ["input_ids", "position_ids", "attention_mask", *kv_names],
                                             ["logits", "context_features", *present], dyn, opset)
    graph_meta["target"] = {"file": "target.onnx", "role": "target", "selector": None, "mode": None}

    step(2)
    ctx_names = drafter_context_names(cfg.num_hidden_layers)
    dyn = {"context_features": {0: "batch", 1: "rows"}, "position_ids": {0: "batch", 1: "rows"}}
    dyn.update({n: {0: "batch", 2: "rows"} for n in ctx_names})
    args = (torch.randn(B, 3, cfg.context_in_features, dtype=tdt), torch.arange(3).repeat(B, 1))
    models["drafter_context.onnx"] = onnx_utils.trace(onnx_graphs.DrafterContextGraph(drafter).eval(), args,
                                                      ["context_features", "position_ids"], ctx_names, dyn, opset)
    graph_meta["drafter_context"] = {"file": "drafter_context.onnx", "role": "drafter_context", "selector": None,
                                     "mode": None}
    dyn = {"anchor_ids": {0: "batch"}, "anchor_position": {0: "batch"},
           "context_mask": {0: "batch", 1: "context_capacity"}, "hidden": {0: "batch"}}
    dyn.update({n: {0: "batch", 2: "context_capacity"} for n in ctx_names})
    args = (torch.randint(0, target.vocab_size, (B,)), torch.tensor([3, 4]), torch.ones(B, 5, dtype=torch.long),
            *[torch.randn(B, dkvh, 5, dd, dtype=tdt) for _ in ctx_names])
    models["drafter_block.onnx"] = onnx_utils.trace(onnx_graphs.DrafterBlockGraph(drafter).eval(), args,
                                                    ["anchor_ids", "anchor_position", "context_mask", *ctx_names],
                                                    ["hidden"], dyn, opset)
    graph_meta["drafter_block"] = {"file": "drafter_block.onnx", "role": "drafter_block", "selector": None,
                                   "mode": None}

    step(3)
    models["drafter_head_independent.onnx"] = onnx_utils.trace(
        onnx_graphs.DrafterHeadLogits(drafter).eval(), (torch.randn(B, bs, cfg.hidden_size, dtype=tdt),), ["hidden"],
        ["logits"], {"hidden": {0: "batch"}, "logits": {0: "batch"}}, opset)
    graph_meta[head_key(INDEPENDENT)] = {"file": "drafter_head_independent.onnx", "role": "drafter_head",
                                         "selector": None, "mode": INDEPENDENT}
    if drafter.use_selector:
        _export_selector_heads(drafter, cfg, B, tdt, dtype, opset, models, graph_meta)

    qdq_report: dict[str, Any] = {}
    if quant.enabled:  # TensorRT flavour: explicit Q/DQ weights in standard ONNX (build-engines uses it)
        from dflash2_trt.export import quantize

        models[quantize.QDQ_FILE] = quantize.qdq_graph(models["target.onnx"], quant, target.vocab_size)
        graph_meta[quantize.QDQ_KEY] = {"file": quantize.QDQ_FILE, "role": "target", "selector": None, "mode": None,
                                        "flavour": "qdq"}
        if verify:
            qdq_report = quantize.verify_qdq(models[quantize.QDQ_FILE], models["target.onnx"])
    ort_report: dict[str, Any] = {}
    if ort_flavour:  # fused ORT target (+ quantized ORT variants); checked against PyTorch in memory
        from dflash2_trt.export import ort_graph

        rope_rows = -(-int(max_seq_len) // KV_CAPACITY_STEP) * KV_CAPACITY_STEP  # the largest KV capacity
        ort_report = ort_graph.add_ort_flavour(models, graph_meta, target, layer_ids, rope_rows, opset, quant, verify)

    step(4)
    onnx_utils.save_with_shared_weights(models, tmp)
    for key, meta in graph_meta.items():
        meta.update(onnx_utils.describe_io(models[meta["file"]]))

    step(5)
    ort_only = {m["file"] for m in graph_meta.values() if m.get("flavour") == "ort"}
    for name in models:
        if name not in ort_only:  # onnx.checker knows no com.microsoft op: ORT itself checked those above
            onnx_utils.check_graph(tmp / name)

    step(6)
    report: dict[str, Any] = {}
    if verify:
        from dflash2_trt.export import verify as V

        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            report["skipped"] = "onnxruntime is not installed"
        else:
            try:
                if dtype == "bf16":  # ORT's CPU provider has no bf16 kernels: check the graphs' fp32 twins
                    report.update(_verify_bf16(tmp, graph_meta, target, drafter, layer_ids))
                else:
                    report.update(V.verify_target(tmp / "target.onnx", target, layer_ids, dtype, npdt))
                    report.update(V.verify_drafter({k: tmp / m["file"] for k, m in graph_meta.items()}, drafter,
                                                   dtype, npdt))
                report.update(ort_report)
                report.update(qdq_report)
            except DFlash2Error:
                raise
            except Exception as e:  # a graph that ORT cannot run is a failed export, never a skipped check
                raise DFlash2Error(f"export check failed ({dtype}): {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:300]}") from None

    step(7)
    tok_files = []
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy2(target_dir / name, tmp / name)
            tok_files.append(name)
    if "tokenizer.json" not in tok_files:
        raise DFlash2Error(f"target folder {target_dir} has no tokenizer.json (needed at run time)")
    chat = (target_dir / "chat_template.jinja").is_file() or bool(
        _json_get(target_dir / "tokenizer_config.json", "chat_template"))
    manifest = parse_manifest({
        "format": FORMAT,
        "manifest_version": MANIFEST_VERSION,
        "project_version": __version__,
        "exporter_revision": EXPORTER_REVISION,
        "opset": opset,
        "dtype": dtype,
        "max_seq_len": int(max_seq_len),
        "kv_capacity_step": KV_CAPACITY_STEP,
        "target": {
            "model_type": hf_cfg.model_type, "vocab_size": target.vocab_size, "num_layers": nl,
            "hidden_size": target.hidden_size, "num_key_value_heads": kvh, "head_dim": d,
            "max_positions": max_pos, "eos_token_ids": sorted(target.eos_ids()), "layer_ids": layer_ids,
            "source": str(target_dir),
        },
        "drafter": cfg.to_dict(),
        "plugin": {"op_type": sc.OP_TYPE, "domain": sc.DOMAIN, "plugin_version": sc.PLUGIN_VERSION,
                   "plugin_namespace": sc.PLUGIN_NAMESPACE},
        "graphs": graph_meta,
        "weights": onnx_utils.WEIGHTS_FILE,
        "tokenizer": {"files": tok_files, "chat_template": chat},
        "verification": report,
        "quantization": quant.manifest(),
        "draft_vocab": int(draft_vocab),
    })
    manifest = write_manifest(tmp, manifest)
    bar.update(1)
    bar.close()
    return manifest


def _export_selector_heads(drafter, cfg, B: int, tdt, dtype: str, opset: int, models: dict,  # noqa: ANN001
                           graph_meta: dict) -> None:
    """drafter_head_{greedy,viterbi}.onnx (decomposed selector) and their .plugin.onnx twins."""
    import numpy as np
    import torch

    from dflash2_trt.export import onnx_graphs, onnx_utils
    from dflash2_trt.export import selector_contract as sc

    bs, L, K, r = cfg.block_size, cfg.num_draft_rows, cfg.selector_top_k, cfg.selector_rank
    head = onnx_utils.trace(onnx_graphs.DrafterHeadBase(drafter).eval(), (torch.randn(B, bs, cfg.hidden_size, dtype=tdt),),
                            ["hidden"], ["cand_ids", "unary", "hidden_proj"],
                            {"hidden": {0: "batch"}, "cand_ids": {0: "batch"}, "unary": {0: "batch"},
                             "hidden_proj": {0: "batch"}}, opset)
    cs = drafter.candidate_selector
    sel_names = [n for n, _, _ in sc.INPUTS if n not in ("pred_codebook", "succ_codebook")]
    sel_args = (torch.randint(0, cfg.vocab_size, (B, L, K), dtype=torch.int32),
                torch.randn(B, L, K).sort(-1, descending=True).values, torch.randn(B, L, r, dtype=tdt),
                torch.randint(0, cfg.vocab_size, (B,), dtype=torch.int32), torch.tensor([0.0, 1.0]),
                torch.rand(B, L))
    for mode in SELECTOR_MODES:
        sel = onnx_utils.trace(onnx_graphs.DecomposedSelector(cs.predecessor_codebook, cs.successor_codebook, mode).eval(),
                               sel_args, sel_names, ["path_ids", "proposal_probs"],
                               {n: {0: "batch"} for n in [*sel_names, "path_ids", "proposal_probs"]}, opset)
        models[f"drafter_head_{mode}.onnx"] = onnx_utils.merge_selector(head, sel)
        graph_meta[head_key(mode)] = {"file": f"drafter_head_{mode}.onnx", "role": "drafter_head",
                                      "selector": "decomposed", "mode": mode}
        cb = [w.detach().float().numpy() if dtype != "bf16" else w.detach().view(torch.int16).numpy().view(np.uint16)
              for w in (cs.predecessor_codebook, cs.successor_codebook)]
        if dtype == "fp16":
            cb = [w.astype(np.float16) for w in cb]
        plug = onnx_utils.plugin_selector_graph(cb[0], cb[1], L, K, r, mode, dtype, opset)
        models[f"drafter_head_{mode}.plugin.onnx"] = onnx_utils.merge_selector(head, plug)
        graph_meta[head_key(mode, plugin=True)] = {"file": f"drafter_head_{mode}.plugin.onnx",
                                                   "role": "drafter_head", "selector": "plugin", "mode": mode}


def _verify_bf16(tmp: Path, graph_meta: dict, target, drafter, layer_ids: list[int]) -> dict:  # noqa: ANN001
    """A bf16 export's check on a CPU: the fp32 twin of each checked graph (:func:`onnx_utils.fp32_twin`: the
    export's structure and bf16 weights, fp32 arithmetic) against the PyTorch models upcast the same way
    (exact: bf16 values are fp32 values), within the fp32 bounds — every decision equal. What it cannot see,
    the rounding of bf16 arithmetic, is the bf16 runtime's (TensorRT's); the manifest records how it checked."""
    import numpy as np
    import torch

    from dflash2_trt.export import onnx_utils
    from dflash2_trt.export import verify as V

    keys = {"drafter_context", "drafter_block", *(head_key(m) for m in DRAFT_MODES)} & set(graph_meta)
    target.model.float()
    drafter.float()
    try:
        with tempfile.TemporaryDirectory(prefix="dflash2-bf16-") as d:
            twin = lambda name: onnx_utils.fp32_twin(tmp / name, Path(d) / name)  # noqa: E731
            report = {"bf16_checked_as": "fp32 twins: the bf16 weights in fp32 arithmetic"}
            report.update(V.verify_target(twin("target.onnx"), target, layer_ids, "fp32", np.float32))
            report.update(V.verify_drafter({k: twin(graph_meta[k]["file"]) for k in keys}, drafter, "fp32",
                                           np.float32))
    finally:
        target.model.to(torch.bfloat16)
        drafter.to(torch.bfloat16)
    return report


def _json_get(path: Path, key: str) -> Any:
    import json

    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
