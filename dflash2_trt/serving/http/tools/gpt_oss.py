"""gpt-oss (harmony): ``<|channel|>analysis<|message|>...`` is reasoning, ``<|channel|>commentary
to=functions.NAME ... <|message|>{args}<|call|>`` a call, ``<|channel|>final<|message|>...`` the content.

A forced call (required / named) is the commentary message itself (no analysis before it): the harmony markers as
the tokenizer's special tokens where it has them (llguidance's ``<|name|>`` references), else as text."""

from __future__ import annotations

import json
import re

from dflash2_trt.serving.http.tools.common import Parsed

MSG = re.compile(r"<\|channel\|>(\w+)(.*?)<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)",
                 re.S)
MARKERS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>")


def lark(tools: list[dict], parallel: bool, special: bool) -> str:
    """A forced call as a Lark grammar: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``
    then the arguments (the function's parameters schema) and ``<|call|>``; parallel calls each in their own
    ``<|start|>assistant`` message. ``special``: the markers are special tokens of the tokenizer."""
    def m(name: str) -> str:
        return f"<|{name}|>" if special else json.dumps(f"<|{name}|>")

    alts = " | ".join(f'"commentary to=functions.{t["function"]["name"]} " {m("constrain")} "json" {m("message")} '
                      f'%json {json.dumps(t["function"].get("parameters") or {"type": "object"})}' for t in tools)
    more = f' ({m("start")} "assistant" call)*' if parallel else ""
    return f"start: call{more}\ncall: {m('channel')} ({alts}) {m('call')}\n"


def parse(text: str, tools: list[dict] | tuple = ()) -> Parsed:
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
