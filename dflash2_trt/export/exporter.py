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

KV caches use the capacity-buffer convention of :mod:`dflash2_trt.targets.dense` (target) and
:mod:`dflash2_trt.export.onnx_graphs` (drafter context).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (BLOCK_HIDDEN, BLOCK_LAYERS, KV_CAPACITY_STEP, MANIFEST_VERSION,
                                 STATE_MANIFEST_VERSION, ExportManifest, GraphSpec, LinearStateSpec, PluginSpec,
                                 SlidingWindowSpec, TargetSpec, TensorSpec, TokenizerSpec, drafter_context_names,
                                 write_manifest)
from dflash2_trt.outdir import TempFolder, check_replace, export_owner, write_error
from dflash2_trt.validate import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, check_size
from dflash2_trt.vocabulary import DRAFT_MODES, DTYPES, INDEPENDENT, Q8_0, SELECTOR_MODES, head_key

DEFAULT_OPSET = 17
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
#: bump when the graphs' content or conventions change (keys caches of exported models)
EXPORTER_REVISION = 4
_TRACE_BATCH = 2  # graphs are traced with batch 2 so that no batch-1 shape gets baked in


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
    drafter_quantization: str | None = None,
) -> ExportManifest:
    """Export and return the manifest. Raises :class:`DFlash2Error` on bad input; DIR is left untouched
    (absent or as it was) on any failure. ``ort_flavour``: also write the fused ONNX Runtime target
    (``target_ort.onnx``, fp32 only; :mod:`dflash2_trt.export.ort_graph`); ``quantization``: a
    :class:`~dflash2_trt.export.quantize.QuantSpec` (weight-only: MatMulNBits variants of the ORT graphs of an
    fp32 export, and the TensorRT flavour ``target_qdq.onnx`` with explicit Q/DQ weights); ``draft_vocab`` N > 0: the drafter's
    LM head keeps only the N most frequent ids of its training responses (``token_counts.npy``); ``overwrite``:
    replace an export of ours that holds files its manifest does not list (see :mod:`dflash2_trt.outdir`);
    ``drafter_quantization``: none|int8|int4, the ONNX Runtime drafter graphs' MatMulNBits weights (default:
    ``quantization``'s kind), or q8_0, the drafter's own weights rounded onto Q8_0's grid (fp32 graphs; see
    :mod:`dflash2_trt.export.quantize`); drafts are verified, so an fp32 target stays exact with a quantized drafter."""
    from dflash2_trt.export.quantize import QuantSpec, drafter_spec

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
    ort_flavour = ort_flavour and dtype == "fp32"
    draft_quant = drafter_spec(quant, drafter_quantization) if ort_flavour else QuantSpec()
    if not ort_flavour and drafter_quantization not in (None, "none"):
        raise DFlash2Error(f"--drafter-quantize {drafter_quantization}: the quantized drafter is an ONNX Runtime graph "
                           f"of an fp32 export with its ONNX Runtime flavour, not a"
                           + (f" {dtype} export" if dtype != "fp32" else "n export without it (--no-ort-flavour)"))
    draft_q8_0 = drafter_quantization == Q8_0  # (ort_flavour: checked above)
    out = Path(out)
    check_replace(out, "--out", export_owner, overwrite)
    try:
        with TempFolder(out, "export") as t:
            opts = _Options(opset, dtype, block_size, max_seq_len, progress, verify, ort_flavour, quant, draft_quant,
                            draft_q8_0, draft_vocab)
            manifest = _export_into(t.path, Path(target_path), Path(drafter_path), opts)
            if not overwrite:
                check_replace(out, "--out", export_owner)  # again: it may have changed meanwhile
            t.publish()
    except OSError as e:  # disk full, permissions: the temporary folder is gone, ``out`` as it was
        raise write_error(e, out) from None
    return manifest


@dataclass(frozen=True)
class _Options:
    """What :func:`export_model` was asked for, checked and resolved (the drafter's quantization from the target's)."""

    opset: int
    dtype: str
    block_size: int | None  # None: the drafter's
    max_seq_len: int | None  # None: min(the target's max positions, 4096)
    progress: bool
    verify: bool
    ort_flavour: bool
    quant: Any  # dflash2_trt.export.quantize.QuantSpec: the target's
    draft_quant: Any  # ... the ONNX Runtime drafter graphs' MatMulNBits (quantize.drafter_spec)
    draft_q8_0: bool  # the drafter's weights rounded onto Q8_0's grid
    draft_vocab: int


@dataclass
class _Build:
    """What the export stages share: the loaded models, the ONNX graphs traced so far (file name -> ModelProto)
    and their typed entries (graph key -> :class:`GraphSpec`; inputs/outputs filled once saved)."""

    tmp: Path  # the temporary folder written into
    target: Any  # dflash2_trt.targets.adapter.TargetModel, in the export dtype
    target_dir: Path
    drafter: Any  # dflash2_trt.model.DFlash2Drafter, bound to the target
    dtype: str
    opset: int
    max_seq_len: int
    quant: Any  # dflash2_trt.export.quantize.QuantSpec: the target's
    draft_quant: Any  # ... the ONNX Runtime drafter graphs' MatMulNBits (quantize.drafter_spec)
    draft_q8_0: bool  # the drafter's weights rounded onto Q8_0's grid (quantize.q8_0_drafter)
    layer_ids: list[int]
    models: dict[str, Any] = field(default_factory=dict)
    graphs: dict[str, GraphSpec] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)  # verification figures

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    def add(self, key: str, model: Any, spec: GraphSpec) -> None:
        self.models[spec.file] = model
        self.graphs[key] = spec


def _export_into(tmp: Path, target_path: Path, drafter_path: Path, opts: _Options) -> ExportManifest:
    """The export as named stages, each one step of the progress bar."""
    stages: list[tuple[str, Callable[[_Build], None]]] = [
        ("export target", _trace_target), ("export drafter", _trace_drafter), ("export heads", _trace_heads),
        ("flavours", lambda b: _add_flavours(b, opts.ort_flavour, opts.verify)),
        ("save + onnx.checker", _save_and_check), ("verify vs PyTorch", _verify if opts.verify else lambda b: None)]
    bar = _progress(["load models", *(name for name, _ in stages), "tokenizer + manifest"], opts.progress)
    bar.set_postfix_str("load models")
    b = _load(tmp, target_path, drafter_path, opts)
    for name, stage in stages:
        bar.update(1)
        bar.set_postfix_str(name)
        stage(b)
    bar.update(1)
    bar.set_postfix_str("tokenizer + manifest")
    manifest = _write_manifest(b, opts.draft_vocab)
    bar.update(1)
    bar.close()
    return manifest


def _load(tmp: Path, target_path: Path, drafter_path: Path, opts: _Options) -> _Build:
    """Both models in the export dtype, the drafter bound to the target (at the asked block size, with its LM
    head restricted to ``draft_vocab`` ids, its weights on Q8_0's grid where asked)."""
    import torch

    from dflash2_trt.export.quantize import q8_0_drafter
    from dflash2_trt.model import load_drafter
    from dflash2_trt.model.checkpoint import draft_vocabulary
    from dflash2_trt.targets.adapter import TargetModel, resolve_target_path

    drafter = load_drafter(drafter_path)
    target = TargetModel.load(target_path)
    target.check_drafter(drafter.config)
    target.family.check_exportable(target.model)
    if "linear" in target.family.layer_kinds(target.model.config) and (opts.dtype == "bf16" or opts.quant.enabled):
        raise DFlash2Error(f"a {target.model.config.model_type!r} target exports in fp32 or fp16 without --quantize "
                           f"only (its linear layers' graphs are verified at those)")
    if opts.block_size is not None and opts.block_size != drafter.config.block_size:
        drafter = drafter.at_block_size(opts.block_size)
    max_pos = target.max_positions
    max_seq_len = min(max_pos, 4096) if opts.max_seq_len is None else opts.max_seq_len
    if not 2 <= max_seq_len <= max_pos:
        raise DFlash2Error(f"--max-seq-len must be in [2, {max_pos}] (the target's max_position_embeddings), "
                           f"got {max_seq_len}")
    b = _Build(tmp, target, resolve_target_path(target_path), drafter, opts.dtype, opts.opset, int(max_seq_len),
               opts.quant, opts.draft_quant, opts.draft_q8_0, list(drafter.config.target_layer_ids or []))
    target.model.to(b.torch_dtype)
    drafter.to(b.torch_dtype)
    drafter.bind_target(target.embed_weight, target.lm_head_weight)
    if opts.draft_vocab:
        drafter.restrict_vocab(torch.from_numpy(draft_vocabulary(drafter, opts.draft_vocab)))
    if opts.draft_q8_0:
        b.report["drafter.q8_0_matrices"] = q8_0_drafter(drafter)
    return b


def _trace_target(b: _Build) -> None:
    """target.onnx: the family's standard graph (TensorRT, ORT's standard flavour) over KV capacity buffers (and, for
    a family with linear layers, their states)."""
    from dflash2_trt.export import onnx_utils

    family = b.target.family
    args, inputs, outputs, dyn = family.graph_io(b.target.model, _TRACE_BATCH, b.torch_dtype)
    model = onnx_utils.trace(family.TargetGraph(b.target.model, b.layer_ids).eval(), args, inputs, outputs, dyn,
                             b.opset)
    b.add("target", model, GraphSpec(file="target.onnx", role="target"))


def _trace_drafter(b: _Build) -> None:
    """drafter_context.onnx (target features -> context K/V) and drafter_block.onnx (the block's hidden)."""
    import torch

    from dflash2_trt.export import onnx_graphs, onnx_utils

    cfg, tdt, B = b.drafter.config, b.torch_dtype, _TRACE_BATCH
    ctx_names = drafter_context_names(cfg.num_hidden_layers)
    dyn = {"context_features": {0: "batch", 1: "rows"}, "position_ids": {0: "batch", 1: "rows"}}
    dyn.update({n: {0: "batch", 2: "rows"} for n in ctx_names})
    args = (torch.randn(B, 3, cfg.context_in_features, dtype=tdt), torch.arange(3).repeat(B, 1))
    model = onnx_utils.trace(onnx_graphs.DrafterContextGraph(b.drafter).eval(), args,
                             ["context_features", "position_ids"], ctx_names, dyn, b.opset)
    b.add("drafter_context", model, GraphSpec(file="drafter_context.onnx", role="drafter_context"))
    b.add("drafter_block", _trace_block(b, onnx_graphs.DrafterBlockGraph),
          GraphSpec(file="drafter_block.onnx", role="drafter_block"))


def _trace_block(b: _Build, graph: type) -> Any:
    """The block graph ``graph`` (a DrafterBlockGraph class) traced over the drafter's context capacity buffers."""
    import torch

    from dflash2_trt.export import onnx_utils

    cfg, tdt, B = b.drafter.config, b.torch_dtype, _TRACE_BATCH
    ctx_names = drafter_context_names(cfg.num_hidden_layers)
    dyn = {"anchor_ids": {0: "batch"}, "anchor_position": {0: "batch"},
           "context_mask": {0: "batch", 1: "context_capacity"}, BLOCK_HIDDEN: {0: "batch"}}
    dyn.update({n: {0: "batch", 2: "context_capacity"} for n in ctx_names})
    args = (torch.randint(0, b.target.vocab_size, (B,)), torch.tensor([3, 4]), torch.ones(B, 5, dtype=torch.long),
            *[torch.randn(B, cfg.num_key_value_heads, 5, cfg.head_dim, dtype=tdt) for _ in ctx_names])
    return onnx_utils.trace(graph(b.drafter).eval(), args, ["anchor_ids", "anchor_position", "context_mask",
                                                           *ctx_names], [BLOCK_HIDDEN], dyn, b.opset)


def _trace_heads(b: _Build) -> None:
    """drafter_head_independent.onnx (the rows' logits) and, with a selector, the selector heads."""
    import torch

    from dflash2_trt.export import onnx_graphs, onnx_utils

    cfg = b.drafter.config
    model = onnx_utils.trace(onnx_graphs.DrafterHeadLogits(b.drafter).eval(),
                             (torch.randn(_TRACE_BATCH, cfg.block_size, cfg.hidden_size, dtype=b.torch_dtype),),
                             [BLOCK_HIDDEN], ["logits"], {BLOCK_HIDDEN: {0: "batch"}, "logits": {0: "batch"}}, b.opset)
    b.add(head_key(INDEPENDENT), model, GraphSpec(file="drafter_head_independent.onnx", role="drafter_head",
                                                  mode=INDEPENDENT))
    if b.drafter.use_selector:
        _export_selector_heads(b)


def _add_flavours(b: _Build, ort_flavour: bool, verify: bool) -> None:
    """The TensorRT Q/DQ target of a quantized export, and the fused ONNX Runtime flavour (+ its quantized
    variants), each checked in memory."""
    if b.quant.enabled:  # TensorRT flavour: explicit Q/DQ weights in standard ONNX (build-engines uses it)
        from dflash2_trt.export import quantize

        qdq = quantize.qdq_graph(b.models["target.onnx"], b.quant, b.target.vocab_size)
        b.add(quantize.QDQ_KEY, qdq, GraphSpec(file=quantize.QDQ_FILE, role="target", flavour="qdq"))
        if verify:
            b.report.update(quantize.verify_qdq(qdq, b.models["target.onnx"]))
    if ort_flavour and b.dtype == "fp32":
        from dflash2_trt.export import ort_graph

        rope_rows = -(-b.max_seq_len // KV_CAPACITY_STEP) * KV_CAPACITY_STEP  # the largest KV capacity
        models, graphs, report = ort_graph.ort_flavour(b.models, b.graphs, b.target, b.layer_ids, rope_rows,
                                                       b.opset, b.quant, b.draft_quant, verify)
        b.models.update(models)
        b.graphs.update(graphs)
        b.report.update(report)
        from dflash2_trt.export import onnx_graphs

        why = "the drafter's weights are quantized" if b.draft_quant.enabled else \
            onnx_graphs.fused_layers_unsupported(b.drafter)
        if why is None:  # checked by the runtime's tests: the export cannot load the custom-op library
            b.add(BLOCK_LAYERS, _trace_block(b, onnx_graphs.DrafterBlockLayersGraph),
                  GraphSpec(file=f"{BLOCK_LAYERS}.onnx", role="drafter_block", flavour="ort"))
        else:
            b.report["drafter_block_layers"] = f"not exported: {why}"


def _save_and_check(b: _Build) -> None:
    """Every graph saved with one shared weight file, its inputs/outputs recorded, and ``onnx.checker``."""
    from dflash2_trt.export import onnx_utils

    onnx_utils.save_with_shared_weights(b.models, b.tmp)
    for key, spec in b.graphs.items():
        io = onnx_utils.describe_io(b.models[spec.file])
        b.graphs[key] = dataclasses.replace(
            spec, inputs=tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in io["inputs"]),
            outputs=tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in io["outputs"]))
    for spec in b.graphs.values():
        if spec.flavour != "ort":  # onnx.checker knows no com.microsoft op: ORT itself checked those
            onnx_utils.check_graph(b.tmp / spec.file)


def _verify(b: _Build) -> None:
    """ONNX Runtime against PyTorch (:mod:`dflash2_trt.export.verify`); a graph ORT cannot run fails."""
    import numpy as np

    from dflash2_trt.export import verify as V

    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        b.report["skipped"] = "onnxruntime is not installed"
        return
    npdt = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[b.dtype]
    try:
        if b.dtype == "bf16":  # ORT's CPU provider has no bf16 kernels: check the graphs' fp32 twins
            b.report.update(_verify_bf16(b))
        else:
            b.report.update(V.verify_target(b.tmp / "target.onnx", b.target, b.layer_ids, b.dtype, npdt))
            b.report.update(V.verify_drafter({k: b.tmp / g.file for k, g in b.graphs.items()}, b.drafter, b.dtype,
                                             npdt))
    except DFlash2Error:
        raise
    except Exception as e:  # a graph that ORT cannot run is a failed export, never a skipped check
        raise DFlash2Error(f"export check failed ({b.dtype}): {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300]}") from None


def _write_manifest(b: _Build, draft_vocab: int) -> ExportManifest:
    """The tokenizer files copied beside the graphs, and the typed manifest (checksums filled) written."""
    from dflash2_trt import __version__
    from dflash2_trt.export import onnx_utils
    from dflash2_trt.export import selector_contract as sc
    from dflash2_trt.export.quantize import Q8_0_MANIFEST

    tok_files = []
    for name in TOKENIZER_FILES:
        if (b.target_dir / name).is_file():
            shutil.copy2(b.target_dir / name, b.tmp / name)
            tok_files.append(name)
    if "tokenizer.json" not in tok_files:
        raise DFlash2Error(f"target folder {b.target_dir} has no tokenizer.json (needed at run time)")
    chat = (b.target_dir / "chat_template.jinja").is_file() or bool(
        _json_get(b.target_dir / "tokenizer_config.json", "chat_template"))
    t = b.target
    hf = getattr(t.model.config, "text_config", None) or t.model.config  # a vision-language model: its LM's
    kinds = tuple(t.family.layer_kinds(hf))
    attn = next(getattr(layer, "self_attn", None) or layer.mixer for layer in t.model.get_decoder().layers
                if hasattr(layer, "self_attn") or hasattr(getattr(layer, "mixer", None), "o_proj"))  # Nemotron-H: mixer
    # the KV buffers' shape: the family's where its layers differ (Gemma 4), else the config's
    kv_layout = t.family.kv_layout(hf) if hasattr(t.family, "kv_layout") else (int(hf.num_key_value_heads),
                                                                               int(attn.head_dim))
    manifest = ExportManifest(
        opset=b.opset, dtype=b.dtype, max_seq_len=b.max_seq_len,
        target=TargetSpec(model_type=t.model.config.model_type, vocab_size=t.vocab_size, num_layers=t.num_layers,
                          hidden_size=t.hidden_size, num_key_value_heads=kv_layout[0], head_dim=kv_layout[1],
                          max_positions=t.max_positions,
                          eos_token_ids=tuple(sorted(t.eos_ids())), layer_ids=tuple(b.layer_ids),
                          source=str(b.target_dir), layer_kinds=kinds if set(kinds) != {"attention"} else (),
                          linear_state=LinearStateSpec(**t.family.linear_state_shapes(hf)) if "linear" in kinds
                          else None,
                          sliding_window=SlidingWindowSpec(**t.family.sliding_window_spec(
                              hf, b.drafter.config.block_size)) if "sliding" in kinds else None),
        drafter=b.drafter.config.to_dict(),
        plugin=PluginSpec(op_type=sc.OP_TYPE, domain=sc.DOMAIN, plugin_version=sc.PLUGIN_VERSION,
                          plugin_namespace=sc.PLUGIN_NAMESPACE),
        graphs=dict(b.graphs), tokenizer=TokenizerSpec(files=tuple(tok_files), chat_template=chat),
        kv_capacity_step=KV_CAPACITY_STEP, quantization=b.quant.manifest(),
        drafter_quantization=Q8_0_MANIFEST if b.draft_q8_0 else b.draft_quant.manifest(),
        draft_vocab=int(draft_vocab), weights=onnx_utils.WEIGHTS_FILE, verification=dict(b.report),
        project_version=__version__, exporter_revision=EXPORTER_REVISION,
        manifest_version=MANIFEST_VERSION if set(kinds) == {"attention"} else STATE_MANIFEST_VERSION)
    return write_manifest(b.tmp, manifest)


def _export_selector_heads(b: _Build) -> None:
    """drafter_head_{greedy,viterbi}.onnx (decomposed selector) and their .plugin.onnx twins."""
    import numpy as np
    import torch

    from dflash2_trt.export import onnx_graphs, onnx_utils
    from dflash2_trt.export import selector_contract as sc

    cfg, tdt, B = b.drafter.config, b.torch_dtype, _TRACE_BATCH
    bs, L, K, r = cfg.block_size, cfg.num_draft_rows, cfg.selector_top_k, cfg.selector_rank
    head = onnx_utils.trace(onnx_graphs.DrafterHeadBase(b.drafter).eval(), (torch.randn(B, bs, cfg.hidden_size, dtype=tdt),),
                            [BLOCK_HIDDEN], ["cand_ids", "unary", "hidden_proj"],
                            {BLOCK_HIDDEN: {0: "batch"}, "cand_ids": {0: "batch"}, "unary": {0: "batch"},
                             "hidden_proj": {0: "batch"}}, b.opset)
    cs = b.drafter.candidate_selector
    sel_names = [n for n, _, _ in sc.INPUTS if n not in ("pred_codebook", "succ_codebook")]
    sel_args = (torch.randint(0, cfg.vocab_size, (B, L, K), dtype=torch.int32),
                torch.randn(B, L, K).sort(-1, descending=True).values, torch.randn(B, L, r, dtype=tdt),
                torch.randint(0, cfg.vocab_size, (B,), dtype=torch.int32), torch.tensor([0.0, 1.0]),
                torch.rand(B, L))
    for mode in SELECTOR_MODES:
        sel = onnx_utils.trace(onnx_graphs.DecomposedSelector(cs.predecessor_codebook, cs.successor_codebook, mode).eval(),
                               sel_args, sel_names, ["path_ids", "proposal_probs"],
                               {n: {0: "batch"} for n in [*sel_names, "path_ids", "proposal_probs"]}, b.opset)
        b.add(head_key(mode), onnx_utils.merge_selector(head, sel),
              GraphSpec(file=f"drafter_head_{mode}.onnx", role="drafter_head", selector="decomposed", mode=mode))
        cb = [w.detach().float().numpy() if b.dtype != "bf16" else w.detach().view(torch.int16).numpy().view(np.uint16)
              for w in (cs.predecessor_codebook, cs.successor_codebook)]
        if b.dtype == "fp16":
            cb = [w.astype(np.float16) for w in cb]
        plug = onnx_utils.plugin_selector_graph(cb[0], cb[1], L, K, r, mode, b.dtype, b.opset)
        b.add(head_key(mode, plugin=True), onnx_utils.merge_selector(head, plug),
              GraphSpec(file=f"drafter_head_{mode}.plugin.onnx", role="drafter_head", selector="plugin", mode=mode))


def _verify_bf16(b: _Build) -> dict:
    """A bf16 export's check on a CPU: the fp32 twin of each checked graph (:func:`onnx_utils.fp32_twin`: the
    export's structure and bf16 weights, fp32 arithmetic) against the PyTorch models upcast the same way
    (exact: bf16 values are fp32 values), within the fp32 bounds — every decision equal. What it cannot see,
    the rounding of bf16 arithmetic, is the bf16 runtime's (TensorRT's); the manifest records how it checked."""
    import numpy as np
    import torch

    from dflash2_trt.export import onnx_utils
    from dflash2_trt.export import verify as V

    keys = {"drafter_context", "drafter_block", *(head_key(m) for m in DRAFT_MODES)} & set(b.graphs)
    b.target.model.float()
    b.drafter.float()
    try:
        with tempfile.TemporaryDirectory(prefix="dflash2-bf16-") as d:
            twin = lambda name: onnx_utils.fp32_twin(b.tmp / name, Path(d) / name)  # noqa: E731
            report = {"bf16_checked_as": "fp32 twins: the bf16 weights in fp32 arithmetic"}
            report.update(V.verify_target(twin("target.onnx"), b.target, b.layer_ids, "fp32", np.float32))
            report.update(V.verify_drafter({k: twin(b.graphs[k].file) for k in keys}, b.drafter, "fp32",
                                           np.float32))
    finally:
        b.target.model.to(torch.bfloat16)
        b.drafter.to(torch.bfloat16)
    return report


def _json_get(path: Path, key: str) -> Any:
    import json

    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
