"""ONNX Runtime's options of :func:`dflash2_trt.load` as command-line flags, shared by the commands that load an
export (``generate --model-dir``, ``bench``, ``demo``, ``serve``). Imports only the standard library.
"""

from __future__ import annotations

import argparse


def add_ort_options(p: argparse.ArgumentParser) -> None:
    """ONNX Runtime's options of :func:`dflash2_trt.load` (``--threads`` is beside each command's): --[no-]spinning,
    --[no-]panels (default: the environment's or the CPU's choice), --no-weight-codes; :func:`ort_options` reads
    them back."""
    p.add_argument("--spinning", action=argparse.BooleanOptionalAction, default=None,
                   help="ONNX Runtime: the target session's workers spin between ops (default: on, or "
                        "$DFLASH2_ORT_SPINNING); --no-spinning on a CPU shared with other work")
    p.add_argument("--panels", action=argparse.BooleanOptionalAction, default=None,
                   help="ONNX Runtime: the custom-op library's PanelMatMul in place of ORT's MatMul (default: where "
                        "its kernels run AVX-512, or $DFLASH2_ORT_PANELS)")
    p.add_argument("--no-weight-codes", dest="weight_codes", action="store_false",
                   help="ONNX Runtime: the panel kernels compute from the fp32 weights even where an exact weight code "
                        "fits (the same numbers)")


def ort_options(a: argparse.Namespace) -> dict:
    """The :func:`dflash2_trt.load` keywords of :func:`add_ort_options`' flags."""
    return {"spinning": a.spinning, "panels": a.panels, "weight_codes": a.weight_codes}
