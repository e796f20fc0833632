"""Qwen3 / Hermes: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside is content."""

from __future__ import annotations

import json
import re

from dflash2_trt.serving.http.tools.common import Parsed, call_item_schema

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def lark(tools: list[dict], parallel: bool) -> str:
    """A forced call (required / named) as a Lark grammar over the call's JSON schema."""
    s = json.dumps({"anyOf": [call_item_schema(t, "arguments") for t in tools]})
    return f'start: call{"+" if parallel else ""}\ncall: "<tool_call>\\n" %json {s} "\\n</tool_call>"\n'


def parse(text: str, tools: list[dict] | tuple = ()) -> Parsed:
    calls = []
    for m in CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and "name" in obj:
            calls.append((obj["name"], obj.get("arguments", {})))
    rest = CALL.sub("", text).strip()
    return Parsed(content=rest or None if calls else text, calls=calls)
