"""gpt-oss (harmony): ``<|channel|>analysis<|message|>...`` is reasoning, ``<|channel|>commentary
to=functions.NAME ... <|message|>{args}<|call|>`` a call, ``<|channel|>final<|message|>...`` the content."""

from __future__ import annotations

import re

from dflash2_trt.server.tools.common import Parsed

MSG = re.compile(r"<\|channel\|>(\w+)(.*?)<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)",
                 re.S)


def parse(text: str) -> Parsed:
    reasoning, content, calls = [], [], []
    for channel, header, body in MSG.findall(text):
        to = re.search(r"to=functions\.([\w.-]+)", header)
        if to:
            calls.append((to.group(1), body.strip()))
        elif channel == "analysis":
            reasoning.append(body.strip())
        else:
            content.append(body.strip())
    if not (reasoning or content or calls):
        return Parsed(content=text)
    return Parsed(content="\n".join(content) or None, calls=calls, reasoning="\n".join(reasoning) or None)
