"""The ``dflash2`` command (``dflash2-export`` is ``dflash2 export``): ``dflash2 --help`` lists the subcommands,
``dflash2 SUBCOMMAND --help`` their flags. Each subcommand's flags are defined once, beside it: export /
build-engines / triton-repo in :mod:`dflash2_trt.export.cli`, train / make-data / eval-tau in
:mod:`dflash2_trt.train.cli`, bench / demo in :mod:`dflash2_trt.bench.cli`, serve in :mod:`dflash2_trt.serving.http.cli`,
generate and make-tiny here.
``generate`` and ``bench`` decode through the public API (:func:`dflash2_trt.load`; the PyTorch reference with
--target/--drafter through the same :class:`~dflash2_trt.api.Generator`).

Output of ``generate --json``: one JSON object with ``text``, ``tokens``, ``stats`` {``tau`` (pooled tokens per
cycle), ``cycles``, ``per_position_cumulative``, ``per_position_conditional``, ``oracle_tau``, ``plain_steps``},
``tokens_per_s``, ``finish_reason``, ``capped_by_capacity`` (1 when the cache capacity cuts --max-new-tokens
short, also said on stderr) and, with ``--check-lossless``, ``lossless`` (greedy: output == the target's own
greedy decode; T > 0: the check is distributional and is done by the test suite, so ``lossless`` is null) and
``ar_tokens_per_s``; with --model-dir also ``backend``.

Every bad input prints one line ``dflash2: error: ...`` and exits with code 1, before any work starts where it
can be seen from the flags: a bad value (checked by :mod:`dflash2_trt.validate` as the flags are parsed), an
unknown flag or a bad combination (argparse's errors, also one line and exit 1), and errors found later
(:class:`DFlash2Error`, or the file system's ``OSError``). Folders are written as :mod:`dflash2_trt.outdir`
says: never a folder that dflash2 did not write.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dflash2_trt import validate as V
from dflash2_trt.bench import cli as bench_cli
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.ort_options import add_ort_options, ort_options
from dflash2_trt.runtime.request import SAMPLING_SCALARS, GenerationRequest
from dflash2_trt.serving.http import cli as server_cli
from dflash2_trt.vocabulary import BACKEND_CHOICES, SELECTOR_PRECISIONS, TINY_ARCHS



def _build_parser(prog: str = "dflash2") -> argparse.ArgumentParser:
    from dflash2_trt.export import cli as export_cli
    from dflash2_trt.train import cli as train_cli

    p = V.Parser(prog=prog, description="DFlash 2 speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    export_cli.add_parsers(sub)

    t = sub.add_parser("make-tiny", help="write a tiny random target + drafter pair")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=V.SEED, default=0)
    t.add_argument("--block-size", type=V.BLOCK_SIZE, default=16)
    t.add_argument("--accepting", action="store_true",
                   help="a copying target and a drafter whose drafts are accepted often (tau well above 1)")
    t.add_argument("--arch", choices=TINY_ARCHS, default="llama",
                   help="the target: dense Llama; hybrid Gated DeltaNet (qwen3_5, + MoE: qwen3_5_moe); Qwen3-MoE; "
                        "sliding-window gpt-oss or Muse Glimmer (windows of 8); --accepting: any of them")

    train_cli.add_parser(sub)

    g = sub.add_parser("generate", help="speculative decoding (PyTorch reference, or an exported model)")
    g.add_argument("--target", help="HF folder, .gguf file, or 'smollm2'")
    g.add_argument("--drafter", help="drafter folder (config.json + safetensors)")
    g.add_argument("--model-dir", help="a dflash2-export folder (runs without torch)")
    g.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="runtime backend for --model-dir")
    g.add_argument("--stream", action="store_true", help="print tokens as they are committed (--model-dir)")
    g.add_argument("--prompt", required=True, type=V.text)
    g.add_argument("--max-new-tokens", type=V.COUNT, default=64)
    g.add_argument("--temperature", type=V.NON_NEGATIVE_NUMBER, default=0.0)
    g.add_argument("--threads", type=V.THREADS, default=None, help="ONNX Runtime intra-op threads (--model-dir)")
    add_ort_options(g)
    bench_cli.add_draft_options(g, guard=False)  # off: a seed reproduces the tokens
    g.add_argument("--no-conv", action="store_true", help="turn the dynamic convolutions off (ablation; "
                   "--target/--drafter only: an export has them baked in)")
    g.add_argument("--selector-precision", choices=SELECTOR_PRECISIONS, default=SELECTOR_PRECISIONS[0],
                   help="pair-score precision of the PyTorch selector; bf16 reproduces z-lab's vLLM rounding "
                        "(--target/--drafter only: exported selector graphs are fp32)")
    g.add_argument("--check-lossless", action="store_true", help="also run target-only greedy and compare")
    g.add_argument("--chat", action="store_true", help="render the prompt with the target's chat template")
    g.add_argument("--no-oracle", action="store_true", help="skip the oracle top-K measurement passes")
    g.add_argument("--seed", type=V.SEED, default=0)
    for name, kind in SAMPLING_SCALARS.items():  # the record checks their ranges (docs/python-api.md)
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"sampling transform {name} of the target's law (default: off)")
    g.add_argument("--json", action="store_true")

    bench_cli.add_parsers(sub)
    server_cli.add_parser(sub)
    return p


def _cmd_generate(a: argparse.Namespace) -> int:
    """Speculative decoding of one prompt: an export (--model-dir, no torch) or the PyTorch reference
    (--target/--drafter), both through :class:`dflash2_trt.api.Generator`."""
    from dflash2_trt.bench.oracle import oracle_count

    # the record first: a value out of range is one line before any model loads
    request = GenerationRequest(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                                draft_mode=a.selector, guard=a.guard, min_confidence=a.min_confidence,
                                proposer=a.proposer,
                                **{k: getattr(a, k) for k in SAMPLING_SCALARS if getattr(a, k) is not None})
    if a.model_dir:
        gen = bench_cli.open_generator(a.model_dir, a.backend, a.threads, **ort_options(a))
    else:
        from dflash2_trt.api import Generator
        from dflash2_trt.runtime.torch.backend import HFTokenizer, TorchBackend

        be = TorchBackend(a.target, a.drafter, use_conv=False if a.no_conv else None)
        be.drafter.selector_precision = a.selector_precision
        gen = Generator(be, HFTokenizer(be.target.tokenizer))
    with gen:
        if a.chat and not gen.has_chat_template:
            raise DFlash2Error("--chat: the target's tokenizer has no chat template")
        prompt = gen.encode(a.prompt, chat=a.chat)
        capped = bench_cli.capacity_note(a.max_new_tokens, [len(prompt)], gen.max_positions)
        oracle = None if a.no_oracle else oracle_count
        if a.stream and not a.json:
            chunks = gen.stream(prompt, request=request, oracle=oracle)
            for chunk in chunks:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            r = chunks.result
        else:
            r = gen.generate(prompt, request=request, oracle=oracle)
        s = r.stats
        out: dict = {"text": r.text, "tokens": r.tokens,
                     "stats": {"tau": s.tau, "cycles": s.cycles, "per_position_cumulative": s.acceptance,
                               "per_position_conditional": s.acceptance_conditional, "oracle_tau": s.oracle_tau,
                               "plain_steps": s.plain_steps,
                               "proposer_cycles": {p: s.proposers.count(p) for p in sorted(set(s.proposers))}},
                     "tokens_per_s": s.tokens_per_s, "finish_reason": r.finish_reason, "capped_by_capacity": capped}
        if a.model_dir:
            out["backend"] = gen.backend
        if a.check_lossless:
            if a.temperature > 0:
                out["lossless"] = None
            else:
                base = gen.generate(prompt, request=dataclasses.replace(request, speculative=False))
                out["lossless"] = base.tokens == r.tokens
                out["ar_tokens_per_s"] = base.stats.tokens_per_s
    if a.json:
        print(json.dumps(out))
    else:
        print("" if a.stream else r.text)
        oracle = "-" if s.oracle_tau is None else f"{s.oracle_tau:.2f}"
        print(f"-- {len(r.tokens)} tokens, tau {s.tau:.2f} over {s.cycles} cycles, oracle tau {oracle}, "
              f"{s.tokens_per_s:.1f} tok/s" + (f" on {gen.backend}" if a.model_dir else "")
              + (f", lossless: {out['lossless']}" if a.check_lossless else ""))
    return 1 if a.check_lossless and out.get("lossless") is False else 0


def _cmd_make_tiny(a: argparse.Namespace) -> int:
    from dflash2_trt.tiny import make_tiny

    t, d = make_tiny(a.out, seed=a.seed, block_size=a.block_size, accepting=a.accepting, arch=a.arch)
    print(f"wrote {t} and {d}")
    return 0


def main(argv: list[str] | None = None, prog: str = "dflash2") -> int:
    parser = _build_parser(prog)
    if prog == "dflash2-export":  # the export subcommand is the whole program: no "dflash2-export export"
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["export"].prog = prog
    try:
        a = parser.parse_args(argv)
        if a.cmd == "export":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_export(a, prog, verify_cost=bench_cli.record_verify_cost,
                                         polygraphy_inputs=bench_cli.record_polygraphy_inputs)
        if a.cmd == "build-engines":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_build_engines(a, prog)
        if a.cmd == "triton-repo":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_triton_repo(a, prog)
        if a.cmd == "make-tiny":
            return _cmd_make_tiny(a)
        if a.cmd == "generate":
            bench_cli.check_model_source(parser, a)
            if a.model_dir and a.no_conv:
                parser.error("--no-conv is baked in at export time; it does not apply to --model-dir")
            if a.model_dir and a.selector_precision != SELECTOR_PRECISIONS[0]:
                parser.error("--selector-precision applies to --target/--drafter; exported selector graphs are fp32")
            if a.model_dir is None and a.threads is not None:
                parser.error("--threads applies to --model-dir (ONNX Runtime)")
            if a.model_dir is None and ort_options(a) != {"spinning": None, "panels": None,
                                                                    "weight_codes": True}:
                parser.error("--spinning, --panels and --no-weight-codes apply to --model-dir (ONNX Runtime)")
            return _cmd_generate(a)
        if a.cmd == "bench":
            return bench_cli.run_bench(a, parser)
        if a.cmd == "demo":
            return bench_cli.run_demo(a)
        if a.cmd == "serve":
            return server_cli.run(a)
        if a.cmd in ("train", "make-data", "eval-tau"):
            from dflash2_trt.train import cli as train_cli

            return train_cli.run(a)
        parser.error(f"unknown command {a.cmd}")
    except DFlash2Error as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the file system's answer (disk full, permissions) on a path the user gave
        print(f"{prog}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (nothing written)", file=sys.stderr)
        return 1
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """``dflash2-export ARGS``: the same as ``dflash2 export ARGS`` (its usage and errors say ``dflash2-export``)."""
    return main(["export", *(sys.argv[1:] if argv is None else argv)], prog="dflash2-export")


if __name__ == "__main__":
    sys.exit(main())
