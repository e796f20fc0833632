"""Per-token cost and tau of JSON-schema-constrained decoding vs free decoding on the demo export (ONNX Runtime, 1
thread, prefix cache off): twenty prompts asking for a scientist as JSON, 64 tokens each, speculative and plain,
free and under one JSON schema. The grammar's own share of the constrained runs is the time inside runtime/grammar.py's steps (masks,
candidate walk, rollback) over the decoding time: the per-token cost of the constraint itself (the free and
constrained runs decode different text, so their ms / token and tau compare unlike outputs).

    .venv/bin/python benchmarks/grammar_cost.py [--json benchmarks/results/grammar_cost.json]

docs/python-api.md quotes its result file."""

import argparse
import json
import time

import numpy as np

import dflash2_trt
from dflash2_trt.bench.exports import demo_export
from dflash2_trt.bench.machine import describe
from dflash2_trt.runtime import grammar
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.runtime.request import GenerationRequest

SPENT = [0.0, 0.0]  # seconds in the per-token grammar steps; in making the requests' matchers
PEOPLE = ["Marie Curie", "Isaac Newton", "Ada Lovelace", "Albert Einstein", "Charles Darwin", "Galileo Galilei",
          "Nikola Tesla", "Alan Turing", "Rosalind Franklin", "Louis Pasteur", "Johannes Kepler", "Michael Faraday",
          "Gregor Mendel", "Niels Bohr", "Dmitri Mendeleev", "Carl Linnaeus", "Max Planck", "Emmy Noether",
          "James Clerk Maxwell", "Richard Feynman"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "field": {"type": "string"},
          "born": {"type": "integer"}, "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "field", "born", "facts"], "additionalProperties": False}


def timed(fn, slot: int):  # noqa: ANN001, ANN201
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[slot] += time.perf_counter() - t
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the rows and the machine to this file")
    a = ap.parse_args()
    for name in ("constrain_draft", "mask_rows", "masked", "advance", "commit"):
        setattr(grammar, name, timed(getattr(grammar, name), 0))
    grammar.start = timed(grammar.start, 1)
    g = dflash2_trt.load(demo_export(progress=False), "ort", threads=1, prefix_cache_bytes=0)
    gs = GrammarSpec("json_schema", json.dumps(SCHEMA))
    g.grammar_tokenizer()
    rows = []
    print("| decoding | grammar | ms / token | tau | grammar's share per token | matcher made (ms / request) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for spec, gram in ((True, None), (True, gs), (False, None), (False, gs)):
        tps, taus, total, SPENT[:] = [], [], 0.0, [0.0, 0.0]
        for p in PEOPLE:
            r = g.generate([{"role": "user", "content": f"Describe {p} as JSON with name, field, born and facts."}],
                           request=GenerationRequest(max_new_tokens=64, grammar=gram, speculative=spec, seed=0,
                                                     guard=False, proposer="dflash2"))
            tps.append(r.stats.elapsed_s / len(r.tokens))
            taus.append(r.stats.tau)
            total += r.stats.elapsed_s
        row = {"decoding": "speculative" if spec else "plain",
               "grammar": "json_schema" if gram else "none",
               "ms_per_token": float(np.mean(tps) * 1e3), "tau": float(np.mean(taus)) if spec else None,
               "grammar_share": SPENT[0] / total if gram else None,
               "matcher_ms": SPENT[1] * 1e3 / len(PEOPLE) if gram else None}
        rows.append(row)
        print(f"| {row['decoding']} | {row['grammar']} | {row['ms_per_token']:.1f} | "
              f"{'—' if row['tau'] is None else format(row['tau'], '.2f')} | "
              f"{'—' if gram is None else format(100 * row['grammar_share'], '.1f') + ' %'} | "
              f"{'—' if gram is None else format(row['matcher_ms'], '.0f')} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/grammar_cost.py --json " + a.json,
                       "prompts": len(PEOPLE), "max_new_tokens": 64, "rows": rows}, f, indent=1)
    g.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
