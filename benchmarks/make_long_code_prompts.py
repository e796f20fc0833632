"""The long-prompt set: raw Python source to continue (no chat template), ~1.3k SmolLM2 tokens each (the first top-level
def/class on, cut at the last line that fits), from CPython 3.11's standard library (PSF License 2.0, permissive; the
interpreter that runs this script ships the files and LICENSE.txt). Writes ``benchmarks/prompts/long_code.jsonl``
({"prompt", "source"} per line), which ``--prompts benchmarks/prompts/long_code.jsonl`` and ``--sets`` of the
benchmarks read::

    python benchmarks/make_long_code_prompts.py [--tokens 1300]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILES = ["textwrap.py", "heapq.py", "fractions.py", "statistics.py", "difflib.py", "shlex.py", "argparse.py",
         "json/decoder.py", "configparser.py", "dataclasses.py", "enum.py", "functools.py", "csv.py", "calendar.py",
         "string.py", "ipaddress.py", "pprint.py", "tokenize.py", "graphlib.py", "bisect.py", "random.py",
         "colorsys.py"]


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from dflash2_trt.targets.adapter import resolve_target_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "prompts" / "long_code.jsonl"))
    a = ap.parse_args(argv)
    tok = Tokenizer.from_file(str(resolve_target_path("smollm2") / "tokenizer.json"))
    lib = Path(sysconfig.get_paths()["stdlib"])
    lines_out = []
    for f in FILES:
        src = (lib / f).read_text()
        lines = src.splitlines(keepends=True)
        # skip the module docstring / licence header: start at the first top-level def or class
        start = next((i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))), 0)
        text, n = "", 0
        for ln in lines[start:]:
            n2 = len(tok.encode(text + ln).ids)
            if n2 > a.tokens:
                break
            text, n = text + ln, n2
        if n < a.tokens * 0.8:
            continue  # too short a file
        lines_out.append(json.dumps({"prompt": text, "source": f"CPython 3.11 Lib/{f} (PSF License 2.0)"}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines_out) + "\n")
    print(f"wrote {len(lines_out)} prompts to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
