"""Per-token cost and tau of JSON-schema-constrained decoding vs free decoding on the demo export (ONNX Runtime, 1
thread, prefix cache off): speculative and plain, three prompts, 64 tokens each. Run: .venv/bin/python
benchmarks/grammar_cost.py (docs/python-api.md quotes its output)."""
import json, time, numpy as np, dflash2_trt
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.bench.exports import demo_export
g = dflash2_trt.load(demo_export(progress=False), "ort", threads=1, prefix_cache_bytes=0)
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "field": {"type": "string"},
          "born": {"type": "integer"}, "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "field", "born", "facts"], "additionalProperties": False}
gs = GrammarSpec("json_schema", json.dumps(schema))
prompts = ["Describe Marie Curie as JSON with name, field, born and facts.", "Give a JSON record of Isaac Newton.",
           "Return JSON about Ada Lovelace: name, field, born, facts."]
g.grammar_tokenizer()
for spec in (True, False):
  for gram in (None, gs):
    tps, taus, n = [], [], 0
    for p in prompts:
        r = g.generate([{"role": "user", "content": p}], request=GenerationRequest(max_new_tokens=64, grammar=gram, speculative=spec, seed=0, guard=False, proposer="dflash2"))
        tps.append(r.stats.elapsed_s / len(r.tokens)); taus.append(r.stats.tau); n += len(r.tokens)
    print(f"speculative={spec} grammar={'json_schema' if gram else 'none'}: {np.mean(tps)*1e3:.1f} ms/token, tau {np.mean(taus):.2f}, {n} tokens")
