"""``dflash2-export``: export a target + DFlash 2 drafter to an ONNX folder (layout: ``exporter`` module).

    dflash2-export --target PATH --drafter PATH --out DIR [--opset N] [--dtype fp32|fp16|bf16]
                   [--block-size N] [--max-seq-len N] [--no-verify] [--quiet] [--engines [engine options]]
    dflash2-export build-engines DIR [engine options]     (TensorRT engines: see ``engines`` module)

--target takes a HF folder, a .gguf file or the alias ``smollm2``; --block-size overrides the drafter's
(weights do not depend on it); --max-seq-len bounds prompt + generated tokens (default: the target's
max_position_embeddings, at most 4096). Prints the folder on success; user errors print one line
``dflash2-export: error: ...`` and exit 1, leaving no partial DIR.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    from dflash2_trt.export.exporter import DEFAULT_OPSET, DTYPES

    p = argparse.ArgumentParser(prog="dflash2-export", description="Export a target + DFlash 2 drafter to ONNX")
    p.add_argument("--target", required=True, help="HF folder, .gguf file, or 'smollm2'")
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    p.add_argument("--max-seq-len", type=int, default=None, help="max prompt + generated tokens")
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime vs PyTorch comparison")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from dflash2_trt.export.engines import add_engine_options

    p.add_argument("--engines", action="store_true", help="then build TensorRT engines (needs TensorRT + a GPU)")
    add_engine_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.errors import DFlash2Error

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["build-engines"]:
        from dflash2_trt.export.engines import cli_main

        return cli_main(args[1:])
    a = _parser().parse_args(args)
    try:
        from dflash2_trt.export.exporter import export_model

        m = export_model(a.target, a.drafter, a.out, opset=a.opset, dtype=a.dtype, block_size=a.block_size,
                         max_seq_len=a.max_seq_len, progress=not a.quiet, verify=not a.no_verify)
    except DFlash2Error as e:
        print(f"dflash2-export: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dflash2-export: interrupted (nothing written)", file=sys.stderr)
        return 1
    print(f"exported {len(m['graphs'])} graphs (opset {m['opset']}, {m['dtype']}, block size {m['block_size']}) "
          f"to {a.out}")
    if a.engines:
        from dflash2_trt.export.engines import run_build

        return run_build(a.out, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
