"""Real input sets of an export's TensorRT-bound graphs in Polygraphy's data-loader format, for
``polygraphy run GRAPH --trt --onnxrt --load-inputs GRAPH.inputs.json`` (docs/tensorrt.md).

:func:`record` decodes a few random prompts through the export's standard ONNX graphs (the graphs
``dflash2 build-engines`` builds the engines from) on ONNX Runtime and keeps, for each graph it called, the first
``sets`` feeds and what the runtime returned:

    OUT/<graph key>.inputs.json    a list of {input name: array}: polygraphy.json.save_json, what --load-inputs reads
    OUT/<graph key>.outputs.json   the runtime's outputs for those feeds, the same format (a reference to compare with)

Decoding passes through every draft mode of the export, so each decomposed head graph gets its inputs; the plugin
heads hold a node ONNX Runtime runs only with the project's op library (their inputs are the decomposed head's).
Evaluation code (it runs a runtime): ``dflash2 export --polygraphy-inputs DIR`` calls it through the top-level CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.request import GenerationRequest


def record(model_dir: str | Path, out_dir: str | Path, sets: int = 3, prompts: int = 2, tokens: int = 8,
           seed: int = 0) -> dict[str, int]:
    """Write the inputs and outputs files of every standard graph a decode calls -> graph key -> sets written."""
    try:
        from polygraphy.json import save_json
    except ImportError:
        raise DFlash2Error("--polygraphy-inputs needs Polygraphy: pip install polygraphy") from None
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(model_dir, flavour="standard", threads=1)
    calls: dict[str, list[tuple[dict[str, np.ndarray], list[np.ndarray], list[str]]]] = {}
    opened = be.session

    def session(key: str) -> Any:  # every session the runners open records its first ``sets`` calls
        s = opened(key)
        if key not in calls:
            calls[key] = []
            run = s.run

            def recorded(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
                out = run(feed)
                if len(calls[key]) < sets:
                    calls[key].append(({k: np.array(v) for k, v in feed.items()}, [np.array(o) for o in out],
                                       list(s.outputs)))
                return out

            s.run = recorded
        return s

    be.session = session  # type: ignore[method-assign]
    rng = np.random.default_rng(seed)
    V = be.manifest.target.vocab_size
    request = GenerationRequest(max_new_tokens=tokens, eos_ids=set(), proposer="dflash2", guard=False)
    for mode in be.draft_modes:
        target, drafter = be.target_runner(), be.draft_runner(mode)
        for _ in range(prompts):
            prompt = rng.integers(0, V, int(rng.integers(3, 9))).tolist()
            D.speculative_generate(target, drafter, prompt, request)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, got in calls.items():
        save_json([feed for feed, _, _ in got], out / f"{key}.inputs.json")
        save_json([dict(zip(names, outs)) for _, outs, names in got], out / f"{key}.outputs.json")
    return {key: len(got) for key, got in calls.items()}
