"""Per-token cost and tau of JSON-schema-constrained decoding vs free decoding on the demo export (ONNX Runtime, 1
thread, prefix cache off): speculative and plain, three prompts, 64 tokens each; and the grammar's own share of the
constrained runs (the time inside runtime/grammar.py's steps: masks, candidate walk, rollback), which is the
per-token cost of the constraint itself (the free and constrained runs decode different text, so their ms / token
and tau compare unlike outputs). Run: .venv/bin/python benchmarks/grammar_cost.py (docs/python-api.md quotes it)."""

import json
import time

import numpy as np

import dflash2_trt
from dflash2_trt.bench.exports import demo_export
from dflash2_trt.runtime import grammar
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.runtime.request import GenerationRequest

SPENT = [0.0, 0.0]  # seconds in the per-token grammar steps; in making the requests' matchers


def timed(fn, slot: int):  # noqa: ANN001, ANN201
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[slot] += time.perf_counter() - t
    return run


for name in ("constrain_draft", "mask_rows", "masked", "advance", "commit"):
    setattr(grammar, name, timed(getattr(grammar, name), 0))
grammar.start = timed(grammar.start, 1)

g = dflash2_trt.load(demo_export(progress=False), "ort", threads=1, prefix_cache_bytes=0)
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "field": {"type": "string"},
          "born": {"type": "integer"}, "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "field", "born", "facts"], "additionalProperties": False}
gs = GrammarSpec("json_schema", json.dumps(schema))
prompts = ["Describe Marie Curie as JSON with name, field, born and facts.", "Give a JSON record of Isaac Newton.",
           "Return JSON about Ada Lovelace: name, field, born, facts."]
g.grammar_tokenizer()
print("| decoding | grammar | ms / token | tau | grammar's share per token | matcher made (ms / request) |")
print("| --- | --- | --- | --- | --- | --- |")
for spec in (True, False):
    for gram in (None, gs):
        tps, taus, total, SPENT[:] = [], [], 0.0, [0.0, 0.0]
        for p in prompts:
            r = g.generate([{"role": "user", "content": p}], request=GenerationRequest(
                max_new_tokens=64, grammar=gram, speculative=spec, seed=0, guard=False, proposer="dflash2"))
            tps.append(r.stats.elapsed_s / len(r.tokens))
            taus.append(r.stats.tau)
            total += r.stats.elapsed_s
        share = f"{100 * SPENT[0] / total:.1f} %" if gram else "—"
        made = f"{SPENT[1] * 1e3 / len(prompts):.0f}" if gram else "—"
        print(f"| {'speculative' if spec else 'plain'} | {'json_schema' if gram else 'none'} | "
              f"{np.mean(tps) * 1e3:.1f} | {np.mean(taus):.2f} | {share} | {made} |")
