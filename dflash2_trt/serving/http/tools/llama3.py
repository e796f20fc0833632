"""Llama 3.x: a call is the whole answer as ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``); several separated by ``;``."""

from __future__ import annotations

import json

from dflash2_trt.serving.http.tools.common import Parsed, call_item_schema


def schema(tools: list[dict]) -> dict:
    return {"anyOf": [call_item_schema(t, "parameters") for t in tools]}


def parse(text: str, tools: list[dict] | tuple = ()) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in body.split(";") if body.startswith("{") else []:
        try:
            obj = json.loads(part)
        except ValueError:
            return Parsed(content=text)
        if not (isinstance(obj, dict) and "name" in obj):
            return Parsed(content=text)
        calls.append((obj["name"], obj.get("parameters", obj.get("arguments", {}))))
    return Parsed(content=None, calls=calls) if calls else Parsed(content=text)
