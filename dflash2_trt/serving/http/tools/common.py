"""What the tool-format modules share: the parsed output and the schema of one call."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)


@dataclass
class Parsed:
    """An answer split: ``content`` (None when only calls), ``calls`` [(name, arguments object or JSON text)],
    ``reasoning`` (a thinking template's <think> text)."""

    content: str | None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    reasoning: str | None = None


def call_item_schema(tool: dict, args_key: str) -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             args_key: f.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def split_think(text: str) -> tuple[str | None, str]:
    """Qwen3-style thinking: (the <think> text or None, the rest)."""
    m = THINK.search(text)
    if not m:
        return None, text
    return m.group(1).strip(), (text[: m.start()] + text[m.end():]).strip()
