"""The house's structure, checked: the import graph (no cycle, no arrow from export to a backend, a torch-free
runtime, evaluation imported by nobody below the CLI), one vocabulary, subpackage docstrings, the manifest's
JSON Schema in step with its dataclasses, and the export recipes."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dflash2_trt"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> every dflash2_trt / third-party module it imports (module level and inside functions)."""
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        mod = _module_name(path)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        out[mod] = deps
    return out


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_import_graph_has_no_cycle():
    g = _internal(_imports())
    for m in g:  # a package's __init__ importing its own modules is not an arrow between modules
        g[m] = {d for d in g[m] if not m.startswith(d + ".") and not d.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])


def test_layers_import_only_downward():
    """Layering by subpackage: export imports no runtime backend (``runtime.{ort,trt,torch}`` or the chooser)
    except the TensorRT environment helpers it builds engines with; the public API reaches the backends only
    through the chooser and the protocol (no backend subpackage); only ``runtime.torch`` imports torch or the
    torch-side packages; evaluation code is imported only by itself and the top-level CLI (``dflash2_trt.cli``)."""
    graph = _imports()
    backend_pkgs = ("dflash2_trt.runtime.ort", "dflash2_trt.runtime.trt", "dflash2_trt.runtime.torch")
    export_may_use = {"dflash2_trt.runtime.trt.env", "dflash2_trt.runtime.trt.cuda_api"}

    def in_pkg(d: str, pkgs: tuple[str, ...]) -> bool:
        return any(d == p or d.startswith(p + ".") for p in pkgs)

    for mod, deps in graph.items():
        if mod.startswith("dflash2_trt.serving.triton.templates"):
            continue  # package data: the model file Triton's python backend runs, a runtime client by design
        if mod.startswith("dflash2_trt.export"):
            bad = {d for d in deps if (in_pkg(d, backend_pkgs) and d not in export_may_use
                                       and not any(d.startswith(e + ".") for e in export_may_use))
                   or d == "dflash2_trt.runtime.backends"}
            assert not bad, f"{mod} (export) imports a runtime backend: {bad}"
        if mod.startswith("dflash2_trt.runtime") and not in_pkg(mod, ("dflash2_trt.runtime.torch",)):
            heavy = {d for d in deps if d.split(".")[0] in ("torch", "transformers", "safetensors")
                     or d.startswith(("dflash2_trt.model", "dflash2_trt.targets", "dflash2_trt.train",
                                      "dflash2_trt.export", "dflash2_trt.bench", "dflash2_trt.runtime.torch"))}
            assert not heavy, f"{mod} (runtime) imports torch-side or evaluation code: {heavy}"
        if mod == "dflash2_trt.api":
            bad = {d for d in deps if in_pkg(d, backend_pkgs)}
            assert not bad, f"{mod} imports a backend subpackage (go through runtime.protocol.Backend): {bad}"
        if not in_pkg(mod, ("dflash2_trt.bench", "dflash2_trt.cli")):
            assert not {d for d in deps if d.startswith("dflash2_trt.bench")}, f"{mod} imports evaluation code"


def test_layering_check_sees_subpackages():
    """The check above walks every module, so a new file inside a backend subpackage is covered without a
    hand list (the old list of four files missed export -> runtime.ort_fused)."""
    mods = set(_imports())
    assert {"dflash2_trt.runtime.ort.backend", "dflash2_trt.runtime.ort.fused_target", "dflash2_trt.runtime.trt.backend",
            "dflash2_trt.runtime.torch.backend", "dflash2_trt.export.ort_graph"} <= mods


def test_one_vocabulary():
    """Mode and backend names are spelt out once (dflash2_trt/vocabulary.py)."""
    literal = re.compile(r"""\(\s*["'](greedy|auto|fp32|none)["']\s*,\s*["'](viterbi|ort|fp16|int8)["']""")
    offenders = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                 if p.name != "vocabulary.py" and literal.search(p.read_text())]
    assert not offenders, f"literal mode/backend tuples outside vocabulary.py: {offenders}"


def test_every_subpackage_says_what_it_owns_and_imports():
    for init in PKG.rglob("__init__.py"):
        if init.parent == PKG:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "import" in doc, f"{init.relative_to(ROOT)}: docstring must say what the " \
                                                  f"subpackage owns and what it may import"


def test_every_subpackage_docstring_lists_its_modules():
    """Each module of a subpackage is named (as ``module``) in the subpackage's docstring: what it holds."""
    missing = []
    for init in PKG.rglob("__init__.py"):
        if init.parent == PKG:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing += [f"{init.parent.relative_to(ROOT)}/{m.name}" for m in sorted(init.parent.glob("*.py"))
                    if m.name != "__init__.py" and f"``{m.stem}``" not in doc and f":mod:`.{m.stem}`" not in doc]
    assert not missing, missing


def test_manifest_schema_matches_the_dataclasses():
    from dflash2_trt import manifest as M

    schema = json.loads(M.SCHEMA_FILE.read_text())

    def check(cls: type, node: dict, where: str) -> None:
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].split("/")[-1]]
        if "oneOf" in node:
            node = next(n for n in node["oneOf"] if n.get("type") != "null")
            if "$ref" in node:
                node = schema["$defs"][node["$ref"].split("/")[-1]]
        props = set(node.get("properties", {}))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert props == fields, f"{where}: schema {sorted(props ^ fields)} differ from {cls.__name__}"
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        assert required <= set(node.get("required", [])), f"{where}: required fields {required}"
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            if dataclasses.is_dataclass(tp):
                check(tp, node["properties"][f.name], f"{where}.{f.name}")
            elif inner and typing.get_origin(tp) is typing.Union:
                check(inner[0], node["properties"][f.name], f"{where}.{f.name}")

    check(M.ExportManifest, schema, "manifest")


def test_manifest_round_trips_and_names_bad_fields(tiny_export):
    from dflash2_trt import DFlash2Error
    from dflash2_trt.manifest import parse_manifest, read_manifest

    m = read_manifest(tiny_export)
    assert parse_manifest(json.loads(json.dumps(m.to_json()))) == m
    data = m.to_json()
    data["graphs"]["target"]["inputs"][0]["shape"] = "batch"
    with pytest.raises(DFlash2Error, match=r"^manifest\.graphs\.target\.inputs\[0\]\.shape must be a list"):
        parse_manifest(data)


def test_recipes_are_valid_bash_and_the_tiny_one_runs(tmp_path):
    recipes = sorted((ROOT / "export").glob("*.sh"))
    assert {p.name for p in recipes} >= {"tiny-cpu-ort.sh", "smollm2-cpu-ort.sh", "qwen3-zlab-trt.sh",
                                         "jetson-orin.sh"}
    for p in recipes:
        subprocess.run(["bash", "-n", str(p)], check=True)
    env = dict(os.environ, OUT=str(tmp_path / "tiny"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the venv's dflash2
    r = subprocess.run(["bash", str(ROOT / "export" / "tiny-cpu-ort.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "lossless: True" in r.stdout and (tmp_path / "tiny" / "manifest.json").is_file()


def test_jetson_recipe_expects_an_int8_export(tiny_export):
    """The Jetson recipe defaults to int8 per-channel (TensorRT 10.3 is not shown to parse int4's opset 21): an
    export of another quantization is refused in one line before any engine is built."""
    env = dict(os.environ, EXPORT=str(tiny_export),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(["bash", str(ROOT / "export" / "jetson-orin.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "is quantized 'none', this recipe expects 'int8'" in r.stderr, r.stderr


# tests that check a benchmark script itself (its helpers, its table) load it by path: the script is their subject
_SCRIPT_SUBJECTS = {("test_bench.py", "ort_side_by_side.py"), ("test_trt_gpu_check_scripts.py", "trt_gpu_check.py")}


def _benchmark_imports(source: str, test_name: str) -> list[str]:
    """How a test's source reaches into benchmarks/: imports of a benchmark module by name, benchmarks/ put on
    sys.path, a benchmark loaded by path (unless it is one of ``_SCRIPT_SUBJECTS``)."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"import {n}" for n in names if n.split(".")[0] in scripts | {"benchmarks"}]
        if not isinstance(node, ast.Call):
            continue
        called = ast.unparse(node.func)
        consts = {c.value for arg in node.args for c in ast.walk(arg)
                  if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        if called in ("sys.path.insert", "sys.path.append") and any("benchmarks" in c for c in consts):
            found.append(ast.unparse(node))
        if called.endswith("spec_from_file_location") and any("benchmarks" in c for c in consts):
            found += [f"loads benchmarks/{c}" for c in sorted(consts)
                      if c.endswith(".py") and (test_name, c) not in _SCRIPT_SUBJECTS]
    return found


def test_no_test_imports_benchmarks():
    """Fixtures (the demo's export, the identity export) live in the package (``bench.exports``): no test imports a
    benchmark script or puts benchmarks/ on sys.path, so editing a benchmark cannot break the suite. Two tests load
    the script they check by its path (``_SCRIPT_SUBJECTS``)."""
    offenders = {p.name: hits for p in sorted((ROOT / "tests").glob("*.py"))
                 if (hits := _benchmark_imports(p.read_text(), p.name))}
    assert not offenders, offenders


def test_benchmark_import_check_sees_each_way_in():
    """Negative controls for the check above: each way a test could reach benchmarks/ is reported."""
    ways = {
        "from ort_op_profile import parse_profile": "import ort_op_profile",
        "import make_smollm2_drafter": "import make_smollm2_drafter",
        "from benchmarks.verify_rows import main": "import benchmarks.verify_rows",
        'sys.path.insert(0, str(ROOT / "benchmarks"))': "sys.path.insert(0, str(ROOT / 'benchmarks'))",
        'spec = importlib.util.spec_from_file_location("m", ROOT / "benchmarks" / "cycle_profile.py")':
            "loads benchmarks/cycle_profile.py",
    }
    for source, expected in ways.items():
        assert _benchmark_imports(source, "test_x.py") == [expected], source
    subject = 'spec = importlib.util.spec_from_file_location("m", ROOT / "benchmarks" / "trt_gpu_check.py")'
    assert _benchmark_imports(subject, "test_trt_gpu_check_scripts.py") == []
    assert _benchmark_imports("from dflash2_trt.bench.exports import demo_export", "test_x.py") == []


# -- C++ function length ----------------------------------------------------------------------------------------

_CPP_STRIP = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_CPP_NOT_FUNCTION = re.compile(r"\b(namespace|class|struct|enum|union|extern)\b|=\s*$|^\s*$")
_CPP_FUNCTION_END = re.compile(r"\)\s*((const|override|noexcept|final|mutable)\b\s*|->\s*[\w:<>,*&\s]+)*$")
MAX_CPP_FUNCTION_LINES = 100


def cpp_function_lengths(source: str) -> list[tuple[str, int]]:
    """(signature, lines from its first line to its closing brace) of every function body of C++ source that is not
    inside another function: free and member functions, constructors (comments and literals ignored; a lambda or a
    block counts toward the function it sits in)."""
    text = _CPP_STRIP.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), source)
    out: list[tuple[str, int]] = []
    depth, head_start = 0, 0
    inside: tuple[int, str, int] | None = None  # (depth, signature, first line) of the open function
    for i, ch in enumerate(text):
        if ch == "{" and inside is None:
            head = text[head_start:i]
            if not _CPP_NOT_FUNCTION.search(head) and "(" in head and _CPP_FUNCTION_END.search(head.rstrip()):
                first = head_start + len(head) - len(head.lstrip())
                inside = (depth, " ".join(head.split()), text.count("\n", 0, first) + 1)
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if inside is not None and depth == inside[0]:
                out.append((inside[1], text.count("\n", 0, i) + 2 - inside[2]))
                inside = None
        if ch in ";{}" and inside is None:
            head_start = i + 1
    return out


def test_no_cpp_function_over_100_lines():
    """The C library's functions (runtime/src) read as small named steps, as the Python twins do: none is longer than
    100 lines from its signature to its closing brace."""
    long = [f"{p.relative_to(ROOT)}: {sig[:80]} ({n} lines)" for p in sorted((ROOT / "runtime" / "src").rglob("*"))
            if p.suffix in (".cpp", ".h") for sig, n in cpp_function_lengths(p.read_text(encoding="utf-8"))
            if n > MAX_CPP_FUNCTION_LINES]
    assert not long, long
    assert len([1 for p in (ROOT / "runtime" / "src").rglob("*.cpp")
                for _ in cpp_function_lengths(p.read_text(encoding="utf-8"))]) > 300  # the scan sees the functions


def test_cpp_function_length_sees_functions_and_nothing_else():
    """Negative controls for the scan: a long free function, member function and constructor are measured from their
    signature; namespaces, classes, initialisers, lambdas and braces in comments or strings are not functions."""
    body = "\n".join(f"    x += {i};" for i in range(101))
    src = f"""namespace a
{{
// not a function: f() {{
struct S
{{
    int f() const
    {{
{body}
    }}
    S(int x)
        : mX(x)
    {{
    }}
    int mX;
}};
int const table[] = {{1, 2}};
void g(int x) noexcept
{{
    auto h = [&](int y) {{ return y; }};
    char const* s = "}} {{";
{body}
}}
}} // namespace a
"""
    got = cpp_function_lengths(src)
    assert [(sig.split("(")[0], n) for sig, n in got] == [("int f", 104), ("S", 4), ("void g", 106)], got


# Graph input / output names of the per-layer state: spelt in dflash2_trt/manifest.py only.
STATE_NAME = re.compile(r"^(past_key_values|present|past_conv|past_recurrent|present_conv|present_recurrent|context)\.")


def state_names_spelt(source: str) -> list[str]:
    """String literals (f-strings included, docstrings left out) that begin a per-layer state's graph name."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    docs |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # an f-string's parts
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant):
            head = str(n.values[0].value)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            head = n.value
        else:
            continue
        if STATE_NAME.match(head):
            found.append(head)
    return found


def test_state_graph_names_are_spelt_in_the_manifest_module_only():
    """Every exporter, verifier and runner takes the KV / linear-state input and output names from manifest.py."""
    bad = {}
    for f in PKG.rglob("*.py"):
        if f.name != "manifest.py" and (names := state_names_spelt(f.read_text(encoding="utf-8"))):
            bad[str(f.relative_to(ROOT))] = names
    assert not bad, bad


def test_state_name_check_sees_an_f_string_and_spares_docstrings():
    src = '"""past_key_values.{i}.key in a docstring."""\nx = {f"past_key_values.{i}.{k}": 1, "present.0.key": 2}\n'
    assert sorted(state_names_spelt(src)) == ["past_key_values.", "present.0.key"]
