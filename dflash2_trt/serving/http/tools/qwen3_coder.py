"""Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``; a
parameter whose schema is a string keeps its text, any other value is JSON (the text where it does not parse).

A forced call (required / named) follows the function's parameters: each property in its declared order, the
required ones always, a plain string (type string, at most a length bound) as raw text on one line without ``<``, an enum of
strings as one of them, any other schema as JSON validating against it."""

from __future__ import annotations

import json
import re

from dflash2_trt.serving.http.tools.common import Parsed

CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
RAW_KEYS = {"type", "description", "title", "minLength", "maxLength"}  # a string schema written as raw text


def _raw(schema: dict) -> bool:
    return schema.get("type") == "string" and set(schema) <= RAW_KEYS


def _value_rule(schema: dict) -> str:
    if _raw(schema):
        lo, hi = max(1, int(schema.get("minLength", 1))), schema.get("maxLength")
        return f"/[^<\\n]{{{lo},{int(hi)}}}/" if hi is not None else f"/[^<\\n]{{{lo},}}/"
    if schema.get("type") == "string" and isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
    return f"%json {json.dumps(schema)}"


def lark(tools: list[dict], parallel: bool) -> str:
    """A forced call (required / named) as a Lark grammar over each function's parameters."""
    rules, names = [], []
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or {}
        required = set(params.get("required", []))
        parts = []
        for k, s in (params.get("properties") or {}).items():
            item = f'"<parameter={k}>\\n" {_value_rule(s if isinstance(s, dict) else {})} "\\n</parameter>\\n"'
            parts.append(item if k in required else f"({item})?")
        rules.append(f'call{i}: "<tool_call>\\n<function={f["name"]}>\\n" {" ".join(parts)} '
                     f'"</function>\\n</tool_call>"')
        names.append(f"call{i}")
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, "call: " + " | ".join(names), *rules]) + "\n"


def _value(v: str, schema: dict | None):  # noqa: ANN202
    if schema is not None and schema.get("type") == "string":
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v


def parse(text: str, tools: list[dict] | tuple = ()) -> Parsed:
    """``tools``: the request's function definitions (a string parameter keeps its text even where it reads as
    JSON, e.g. "42")."""
    props = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {} for t in tools}
    calls = [(name, {k: _value(v, props.get(name, {}).get(k)) for k, v in PARAM.findall(body)})
             for name, body in CALL.findall(text)]
    rest = CALL.sub("", text).strip()
    return Parsed(content=rest or None if calls else text, calls=calls)
