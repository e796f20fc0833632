"""Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``; a
parameter's value is JSON where it parses, else the text."""

from __future__ import annotations

import json
import re

from dflash2_trt.server.tools.common import Parsed

CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _value(v: str):  # noqa: ANN202
    try:
        return json.loads(v)
    except ValueError:
        return v


def parse(text: str) -> Parsed:
    calls = [(name, {k: _value(v) for k, v in PARAM.findall(body)}) for name, body in CALL.findall(text)]
    rest = CALL.sub("", text).strip()
    return Parsed(content=rest or None if calls else text, calls=calls)
