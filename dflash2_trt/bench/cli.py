"""``dflash2 bench`` and ``dflash2 demo``: the subcommands' flags and entries (wired into :mod:`dflash2_trt.cli`;
``dflash2 bench --help`` / ``dflash2 demo --help`` list the flags), and the helpers the CLI's decoding commands
share (opening an export through :func:`dflash2_trt.load`, the draft-mode flags, the cache-capacity note).

``bench``: speculative and plain autoregressive decoding of the same target on the same backend, prompt by
prompt, through one :class:`dflash2_trt.api.Generator`; a table, or with ``--json`` one object with the keys of
:func:`dflash2_trt.bench.harness.summarize` plus ``backend``, ``selector``, ``temperature``, ``max_new_tokens``,
``capped_by_capacity`` (prompts whose --max-new-tokens the cache capacity cut short; also said once on stderr),
``guard`` and ``min_confidence``. ``--target/--drafter`` are exported once into the cache first.
``demo``: SmolLM2-135M-Instruct with the drafter shipped in the package (exported once into the cache); one chat
prompt (its text, then the bench table; ``--json``: the bench keys plus ``text``), or ``--prompts SET``.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash2_trt import validate as V
from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, DEMO_MAX_SEQ_LEN, DEMO_PROMPT, demo_drafter_path
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.ort_options import add_ort_options, ort_options
from dflash2_trt.vocabulary import (BACKEND_CHOICES, DEFAULT_PROPOSER, DRAFTER_QUANTIZATIONS, INDEPENDENT,
                                    PROPOSERS, SELECTOR_MODES)


def add_parsers(sub) -> None:  # noqa: ANN001
    b = sub.add_parser("bench", help="speculative vs autoregressive decoding, side by side",
                       description="Speculative vs autoregressive decoding of the same target, side by side")
    b.add_argument("--model-dir", help="a dflash2-export folder")
    b.add_argument("--target", help="HF folder, .gguf file, or 'smollm2' (exported once into the cache)")
    b.add_argument("--drafter", help="drafter folder (with --target)")
    b.add_argument("--prompts", required=True, help="humaneval | mtbench | FILE.jsonl")
    _bench_options(b)
    _export_options(b)

    d = sub.add_parser("demo", help="SmolLM2-135M-Instruct + the packaged DFlash 2 drafter: export once, decode, "
                                    "compare with autoregressive decoding",
                       description="SmolLM2-135M-Instruct + the packaged DFlash 2 drafter, side by side with "
                                   "autoregressive decoding")
    x = d.add_mutually_exclusive_group()
    x.add_argument("--prompt", default=None, type=V.text, help=f"text (chat-rendered); default: {DEMO_PROMPT!r}")
    x.add_argument("--prompts", default=None, help="humaneval | mtbench | FILE.jsonl: benchmark the demo pair "
                                                   "instead (the keys of `dflash2 bench --json`)")
    _bench_options(d, max_new_tokens=96, repeats=3)  # one short prompt: its timing varies run to run
    _export_options(d, draft_vocab=DEMO_DRAFT_VOCAB)


def add_draft_options(p: argparse.ArgumentParser, guard: bool = True) -> None:
    """--selector MODE | --no-selector, into one ``selector`` draft mode; --guard (default ``guard``);
    --min-confidence; --proposer."""
    x = p.add_mutually_exclusive_group()
    x.add_argument("--selector", choices=SELECTOR_MODES, default=SELECTOR_MODES[0], help="path selection mode")
    x.add_argument("--no-selector", dest="selector", action="store_const", const=INDEPENDENT,
                   help="independent argmax / sample per row (DFlash v1, or the selector-off ablation)")
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=guard,
                   help="plain target steps while measured acceptance does not pay for a cycle, probing again "
                        f"later (lossless; decided from measured timings; default {'on' if guard else 'off'})")
    p.add_argument("--min-confidence", type=V.PROBABILITY, default=0.0,
                   help="verify only the leading draft rows whose cumulative drafter confidence reaches this "
                        "(lossless; 0 = every row)")
    p.add_argument("--proposer", choices=PROPOSERS, default=DEFAULT_PROPOSER,
                   help="who drafts: the DFlash 2 drafter, prompt lookup (n-gram continuations of the context; "
                        "no match = a plain step) or, per cycle, whichever measured acceptance favours (lossless; default: %(default)s)")


def _export_options(b: argparse.ArgumentParser, draft_vocab: int = 0, drafter_quantize: str = "none") -> None:
    """Export options of the cached export that ``bench --target --drafter`` and ``demo`` make."""
    b.add_argument("--block-size", type=V.BLOCK_SIZE, default=None,
                   help="export at this block size (default: the drafter's own; cached export)")
    b.add_argument("--draft-vocab", type=V.NON_NEGATIVE, default=draft_vocab, metavar="N",
                   help="export with the drafter's LM head restricted to its N most frequent ids, 0 = all "
                        f"(default {draft_vocab}; cached export)")
    b.add_argument("--drafter-quantize", choices=DRAFTER_QUANTIZATIONS, default=drafter_quantize,
                   help="export with the drafter's weights quantized (as dflash2 export --drafter-quantize; the "
                        f"target's output is unchanged; default {drafter_quantize}; cached export)")


def _cached_export_options(a: argparse.Namespace) -> dict:
    """The non-default export options of ``_export_options`` (defaults keep the cache key of a plain export)."""
    opts = {"block_size": a.block_size, "draft_vocab": a.draft_vocab,
            "drafter_quantization": None if a.drafter_quantize == "none" else a.drafter_quantize}
    return {k: v for k, v in opts.items() if v}


def _bench_options(b: argparse.ArgumentParser, max_new_tokens: int = 128, repeats: int = 1) -> None:
    b.add_argument("--limit", type=V.COUNT, default=None, help="first N prompts")
    b.add_argument("--repeats", type=V.COUNT, default=repeats,
                   help="decode each prompt N times each way, interleaved; the fastest run of each counts "
                        "(default %(default)s)")
    b.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    b.add_argument("--temperature", type=V.NON_NEGATIVE_NUMBER, default=0.0)
    add_draft_options(b)
    b.add_argument("--max-new-tokens", type=V.COUNT, default=max_new_tokens)
    b.add_argument("--seed", type=V.SEED, default=0)
    b.add_argument("--no-oracle", action="store_true", help="skip the oracle top-K measurement passes")
    b.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    b.add_argument("--threads", type=V.THREADS, default=None, help="ONNX Runtime intra-op threads")
    add_ort_options(b)
    b.add_argument("--plot", help="draw the per-position acceptance curve into FILE.png")
    b.add_argument("--json", action="store_true")


def open_generator(model_dir: str, backend: str, threads: int | None = None, **ort: bool | None):  # noqa: ANN201
    """:func:`dflash2_trt.load` (``ort``: :func:`~dflash2_trt.ort_options.ort_options`), saying on stderr which
    backend runs and why."""
    import dflash2_trt

    gen = dflash2_trt.load(model_dir, backend, threads=threads, **ort)
    print(f"dflash2: {gen.note}", file=sys.stderr)
    return gen


def check_model_source(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Exactly one of --model-dir and the --target/--drafter pair (``generate`` and ``bench``)."""
    if a.model_dir and (a.target or a.drafter):
        parser.error("give either --model-dir or --target/--drafter, not both")
    if not a.model_dir and not (a.target and a.drafter):
        parser.error("give --model-dir DIR, or both --target and --drafter")


def capacity_note(max_new_tokens: int, prompt_lens: list[int], max_positions: int) -> int:
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


def record_verify_cost(model_dir: str) -> None:
    """``dflash2 export --verify-cost``: time the fresh export's fused target here, record the block size it
    recommends in the manifest (:func:`dflash2_trt.bench.verify_cost.record`) and say it."""
    from dflash2_trt.bench import verify_cost

    vc = verify_cost.record(model_dir)
    print(f"recommended block size on this machine: {vc.recommended_block_size} (assuming each "
          f"draft row is accepted with probability {vc.assumed_acceptance} given the previous one)")


def record_polygraphy_inputs(model_dir: str, out_dir: str) -> None:
    """``dflash2 export --polygraphy-inputs DIR``: the TensorRT-bound graphs' input sets
    (:func:`dflash2_trt.bench.polygraphy_inputs.record`), and say what was written."""
    from dflash2_trt.bench import polygraphy_inputs

    sets = polygraphy_inputs.record(model_dir, out_dir)
    print(f"polygraphy input sets in {out_dir}: " + ", ".join(f"{k} {n}" for k, n in sorted(sets.items())))


def run_bench(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dflash2_trt.bench import harness
    from dflash2_trt.bench.prompts import load_prompts

    check_model_source(parser, a)
    if a.plot:
        harness.check_plot(a.plot)
    items = load_prompts(a.prompts, a.limit)
    model_dir = a.model_dir
    if model_dir is None:
        from dflash2_trt.export.cache import cached_export

        model_dir = str(cached_export(a.target, a.drafter, progress=not a.json, **_cached_export_options(a)))
    elif _cached_export_options(a):
        raise DFlash2Error("--block-size / --draft-vocab / --drafter-quantize shape the export made from "
                           "--target/--drafter; with --model-dir, export with them instead")
    return _bench_and_report(a, model_dir, items)


def run_demo(a: argparse.Namespace) -> int:
    from dflash2_trt.bench.prompts import load_prompts
    from dflash2_trt.export.cache import cached_export

    if a.plot:
        from dflash2_trt.bench.harness import check_plot

        check_plot(a.plot)
    # the prompts before the export: a bad prompt set is one line before minutes of work, not after
    items = load_prompts(a.prompts, a.limit) if a.prompts is not None else None
    drafter = demo_drafter_path()
    if not a.json:
        print(f"dflash2: demo pair: SmolLM2-135M-Instruct + {drafter.name} (exported once into the cache)",
              file=sys.stderr)
    model_dir = str(cached_export("smollm2", drafter, progress=not a.json, max_seq_len=DEMO_MAX_SEQ_LEN,
                                  **_cached_export_options(a)))
    if items is not None:
        return _bench_and_report(a, model_dir, items)
    items = [{"messages": [{"role": "user", "content": a.prompt or DEMO_PROMPT}]}]
    return _bench_and_report(a, model_dir, items, show_text=True)


def _bench_and_report(a: argparse.Namespace, model_dir: str, items: list, show_text: bool = False) -> int:
    """Speculative + autoregressive runs, table or JSON; ``show_text``: also the first prompt's speculative
    output (``text``)."""
    from dflash2_trt.bench import harness
    from dflash2_trt.bench.prompts import encode_items

    with open_generator(model_dir, a.backend, a.threads, **ort_options(a)) as gen:
        gen.check_selector(a.selector)
        prompts = encode_items(items, lambda text: gen.encode(text, chat=False), gen.encode)
        capped = capacity_note(a.max_new_tokens, [len(p) for p in prompts], gen.max_positions)
        r = harness.run_bench(gen, prompts, a.max_new_tokens, a.temperature, a.seed, not a.no_oracle,
                              set() if a.ignore_eos else None, progress=True, texts=show_text, guard=a.guard,
                              selector=a.selector, min_confidence=a.min_confidence, proposer=a.proposer,
                              repeats=a.repeats)
        backend, codes = gen.backend, gen.weight_codes
    texts = r.pop("texts", None)
    r = {"backend": backend, "weight_codes": codes, **r, "selector": a.selector, "temperature": a.temperature,
         "max_new_tokens": a.max_new_tokens, "capped_by_capacity": capped, "guard": "on" if a.guard else "off",
         "min_confidence": a.min_confidence, "proposer": a.proposer, "repeats": a.repeats}
    if texts:
        r["text"] = texts[0]
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        if texts:
            print(texts[0])
            print("--")
        print(harness.format_table(r), flush=True)
    if a.plot:  # last: a failing plot never loses the figures printed above
        harness.plot(r, a.plot)
    return 0
