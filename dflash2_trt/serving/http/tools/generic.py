"""The generic tool format, for templates without tool support (SmolLM2's, the demo's), as llama.cpp's generic
handler: the tools are described in a system message and the answer is one JSON object — ``{"tool_calls": [{"name":
..., "arguments": {...}}]}`` for calls, ``{"response": "..."}`` for text — which the grammar forces."""

from __future__ import annotations

import json
from typing import Any

from dflash2_trt.serving.http.tools.common import Parsed, call_item_schema


def system_text(tools: list[dict], forced: bool) -> str:
    """The system message that describes the tools and the answer's shape."""
    lines = ["You can call these tools (JSON Schema of each one's arguments):"]
    for t in tools:
        f = t["function"]
        lines.append(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                 "parameters": f.get("parameters", {})}, ensure_ascii=False))
    lines.append('Answer with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": {...}}]} to call '
                 'tools' + ('.' if forced else ', or {"response": <your answer>} to answer in text.'))
    return "\n".join(lines)


def schema(tools: list[dict], forced: bool, parallel: bool) -> dict:
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": [call_item_schema(t, "arguments") for t in tools]},
                             "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    call_obj = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}
    if forced:
        return call_obj
    text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
            "additionalProperties": False}
    return {"anyOf": [call_obj, text]}


def parse(text: str, tools: list[dict] | tuple = ()) -> Parsed:
    try:
        obj = json.loads(text)
    except ValueError:
        return Parsed(content=text)
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        calls = [(c.get("name", ""), c.get("arguments", {})) for c in obj["tool_calls"] if isinstance(c, dict)]
        return Parsed(content=None, calls=calls)
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return Parsed(content=obj["response"])
    return Parsed(content=text)
