"""``dflash2 export`` and ``dflash2 build-engines``: the subcommands' flags and entries (wired into
:mod:`dflash2_trt.cli`). ``dflash2-export ARGS`` is ``dflash2 export ARGS`` (the documented
entry point, :func:`dflash2_trt.cli.export_main`).

    dflash2 export --target PATH --drafter PATH --out DIR [--opset N] [--dtype fp32|fp16|bf16]
                   [--block-size N] [--max-seq-len N] [--no-verify] [--quiet] [--engines [engine options]]
                   [--triton-repo REPO [triton options]]
                   [--no-ort-flavour] [--quantize none|int8|int4 [--quant-block-size N] [--quant-accuracy-level N]
                   [--no-quantize-lm-head]] [--verify-cost] [--polygraphy-inputs DIR] [--overwrite]
    dflash2 build-engines DIR [engine options]      (TensorRT engines: see :mod:`dflash2_trt.export.engines`)
    dflash2 triton-repo DIR --triton-repo REPO [triton options] [--overwrite]
                                                    (see :mod:`dflash2_trt.serving.triton.repo`)

--target takes a HF folder, a .gguf file or the alias ``smollm2``; --block-size overrides the drafter's
(weights do not depend on it); --max-seq-len bounds prompt + generated tokens (default: the target's
max_position_embeddings, at most 4096). Prints one line on success; user errors print one line
``<prog>: error: ...`` and exit 1, leaving no partial DIR. An existing DIR (or REPO) is replaced only when it is
ours and its record lists every file in it; ``--overwrite`` also removes files it does not list (TensorRT
engines built since, user files), naming them first (:mod:`dflash2_trt.outdir`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import DRAFTER_QUANTIZATIONS, DTYPES, QUANTIZATIONS


def add_parsers(sub) -> None:  # noqa: ANN001
    from dflash2_trt.export.engines import add_engine_options
    from dflash2_trt.serving.triton.repo import add_triton_options

    p = sub.add_parser("export", help="export a target + DFlash 2 drafter to ONNX (and TensorRT engines)",
                       description="Export a target + DFlash 2 drafter to ONNX")
    p.add_argument("--target", required=True, help="HF folder, .gguf file, or 'smollm2'")
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--opset", type=V.integer(14, 20), default=17)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--block-size", type=V.BLOCK_SIZE, default=None, help="override the drafter's block size")
    p.add_argument("--max-seq-len", type=V.integer(2), default=None, help="max prompt + generated tokens")
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime vs PyTorch comparison")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-ort-flavour", action="store_true",
                   help="skip target_ort.onnx (the fused ONNX Runtime target; written for fp32 exports)")
    p.add_argument("--quantize", choices=QUANTIZATIONS, default="none",
                   help="weight-only MatMulNBits quantization of the ONNX Runtime graphs (fp32 exports)")
    p.add_argument("--quant-block-size", type=V.COUNT, default=32, help="elements per quantization block (K axis)")
    p.add_argument("--quant-accuracy-level", type=V.integer(0, 4), default=0,
                   help="MatMulNBits accuracy_level: 0 (fp32 compute; speculative decoding reproduces the quantized "
                        "target exactly) or 4 (int8 activations: faster, but 1-row and multi-row calls differ)")
    p.add_argument("--no-quantize-lm-head", action="store_true", help="keep the LM head MatMul in fp32")
    p.add_argument("--drafter-quantize", choices=DRAFTER_QUANTIZATIONS, default=None,
                   help="the drafter's weights alone (fp32 exports; drafts are verified, so the target's output is "
                        "unchanged): int8 / int4 MatMulNBits in its ONNX Runtime graphs (int8 activations), or q8_0: "
                        "its weights rounded onto GGUF Q8_0's grid, fp32 graphs the custom-op library reads as 8-bit "
                        "codes (default: as --quantize)")
    p.add_argument("--verify-cost", action="store_true",
                   help="time the fused target's verification (1/4/8/16 rows) here; record a recommended block size")
    p.add_argument("--polygraphy-inputs", metavar="DIR", default=None,
                   help="write real input sets of the TensorRT-bound graphs (and ONNX Runtime's outputs for them) in "
                        "Polygraphy's data-loader format into DIR: polygraphy run GRAPH --trt --onnxrt --load-inputs")
    p.add_argument("--draft-vocab", type=V.NON_NEGATIVE, default=0, metavar="N",
                   help="the drafter's LM head keeps only the N most frequent ids of its training responses "
                        "(the drafter's token_counts.npy): a cheaper head, still lossless; 0 = full vocabulary")
    p.add_argument("--overwrite", action="store_true",
                   help="replace our own export / Triton repository even when it holds files its record does not list "
                        "(TensorRT engines, user files): they are named, then removed")
    p.add_argument("--engines", action="store_true", help="then build TensorRT engines (needs TensorRT + a GPU)")
    add_engine_options(p)
    add_triton_options(p)

    b = sub.add_parser("build-engines", help="build TensorRT engines for an export folder",
                       description="Build TensorRT engines for an export folder")
    b.add_argument("dir", help="export folder (written by dflash2 export)")
    add_engine_options(b)
    b.add_argument("--quiet", action="store_true")

    t = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for an export folder",
                       description="Write a Triton Inference Server model repository for an export folder")
    t.add_argument("dir", help="export folder (written by dflash2 export)")
    add_triton_options(t, required=True)
    t.add_argument("--overwrite", action="store_true",
                   help="replace our own repository even when it holds files its record does not list (named first)")


def run_export(a: argparse.Namespace, prog: str, verify_cost: Callable[[str], None] | None = None,
               polygraphy_inputs: Callable[[str, str], None] | None = None) -> int:
    """The export, then (``--verify-cost``) ``verify_cost(out)``, the caller's timing of the written graphs, and
    (``--polygraphy-inputs DIR``) ``polygraphy_inputs(out, DIR)`` — evaluation, not export, both handed in by the
    top-level CLI (:mod:`dflash2_trt.bench.cli`; export imports no runtime) — then the engines and the Triton
    repository."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.export.quantize import QuantSpec

    if a.verify_cost and verify_cost is None:
        raise DFlash2Error("--verify-cost needs the timing of the dflash2 command (dflash2_trt.cli)")
    if a.polygraphy_inputs and polygraphy_inputs is None:
        raise DFlash2Error("--polygraphy-inputs needs the recording of the dflash2 command (dflash2_trt.cli)")

    quant = QuantSpec(a.quantize, a.quant_block_size, a.quant_accuracy_level, not a.no_quantize_lm_head)
    m = export_model(a.target, a.drafter, a.out, opset=a.opset, dtype=a.dtype, block_size=a.block_size,
                     max_seq_len=a.max_seq_len, progress=not a.quiet, verify=not a.no_verify,
                     ort_flavour=not a.no_ort_flavour, quantization=quant,
                     draft_vocab=a.draft_vocab, overwrite=a.overwrite, drafter_quantization=a.drafter_quantize)
    print(f"exported {len(m.graphs)} graphs (opset {m.opset}, {m.dtype}, block size {m.block_size}) to {a.out}")
    if verify_cost is not None and a.verify_cost:
        verify_cost(a.out)
    if polygraphy_inputs is not None and a.polygraphy_inputs:
        polygraphy_inputs(a.out, a.polygraphy_inputs)
    if a.engines:
        rc = run_build_engines(a, prog, a.out)
        if rc:
            return rc
    if a.triton_repo:  # after the engines, so that the repository carries them
        return run_triton_repo(a, prog, a.out)
    return 0


def run_build_engines(a: argparse.Namespace, prog: str, model_dir: str | None = None) -> int:
    from dflash2_trt.export.engines import run_build

    return run_build(model_dir or a.dir, a, prog)


def run_triton_repo(a: argparse.Namespace, prog: str, model_dir: str | None = None) -> int:
    from dflash2_trt.serving.triton.repo import run_write
    from dflash2_trt.serving.triton.server import serve_hint

    rc = run_write(model_dir or a.dir, a)
    print(serve_hint(a.triton_repo))
    return rc
