"""Triton Inference Server model repository for an export folder, and the bundled server that serves it.

    dflash2 export --target T --drafter D --out EXPORT --triton-repo DIR [triton options]   (= dflash2-export ...)
    dflash2 triton-repo EXPORT --triton-repo DIR [triton options]                           (an existing export)

    triton options: --triton-model-name NAME (dflash2) --triton-instances N (1) --triton-backend auto|ort|trt
                    --triton-selector greedy|viterbi|independent --triton-max-tokens N (128: a request's default)

Layout (written into a temporary folder beside DIR and moved into place whole; an existing DIR is replaced
only when it is a repository we wrote, see :mod:`dflash2_trt.outdir`)::

    DIR/dflash2-repo.json            the files we wrote (Triton reads model folders only)

    DIR/<name>/config.pbtxt          python backend, decoupled (token streaming), inputs/outputs/parameters
    DIR/<name>/1/model.py            triton_templates/dflash2_model.py: the DFlash 2 loop over
                                     ``runtime.open_backend`` (TensorRT when the engines load, else ONNX Runtime;
                                     the choice is logged by the server)
    DIR/<name>/1/export/             the export folder (hard links where the filesystem allows, else copies)
    DIR/<name>_<graph>/config.pbtxt  only when the export has TensorRT engines: one ``tensorrt_plan`` model per
    DIR/<name>_<graph>/1/model.plan  plan (target, drafter context / block / heads) for pipelines composed by
                                     hand (BLS); the drafter heads list the plugin library in their parameters
                                     and it sits beside their plan. These need a GPU and TensorRT: the bundled
                                     CPU server cannot load them.

Every config.pbtxt is built as a ``tritonclient`` ``ModelConfig`` protobuf message and checked by parsing the
written text back (protobuf text format rejects unknown fields).

Serving: ``server_command`` gives the exact ``tritonserver`` command of the PyPI ``nvidia-pytriton`` wheel
(its server runs the python backend on the CPU); ``TritonServer`` starts it on loopback, waits until the
model is ready and stops it (used by the tests). The python backend's stub embeds the interpreter's
``libpython`` in isolated mode: the server's environment carries ``PYTHONPATH`` (a NumPy 1.x folder, see
``numpy1_dir``, then this interpreter's site-packages; model.py adds them itself) and ``LD_LIBRARY_PATH``
(where libpython lives).

Concurrency is ``instance_group`` count (one request per instance at a time, each with its own runners and
caches); the runtime decodes one sequence per runner, so requests are not batched into shared steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import GraphSpec, read_manifest
from dflash2_trt.outdir import TempFolder, check_replace, repo_owner, write_error, write_repo_record
from dflash2_trt.vocabulary import BACKEND_CHOICES, DRAFT_MODES

TEMPLATE = Path(__file__).resolve().parent / "triton_templates" / "dflash2_model.py"
DEFAULT_MODEL_NAME = "dflash2"
EXPORT_SUBDIR = "export"
_TRT_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
              "int32": "TYPE_INT32", "bool": "TYPE_BOOL"}
# the python model's interface (see the template's docstring): name, type, dims
_INPUTS = (("text_input", "TYPE_STRING", [1]), ("input_ids", "TYPE_INT64", [-1]), ("max_tokens", "TYPE_INT32", [1]),
           ("temperature", "TYPE_FP32", [1]), ("seed", "TYPE_INT64", [1]), ("selector_mode", "TYPE_STRING", [1]))
_OUTPUTS = (("output_ids", "TYPE_INT64", [-1]), ("text_output", "TYPE_STRING", [1]), ("accepted", "TYPE_INT32", [-1]),
            ("tau", "TYPE_FP32", [1]))


def _pb():  # noqa: ANN202
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise DFlash2Error("writing a Triton repository needs tritonclient: "
                           "pip install 'dflash2-trt[triton]'") from None
    return model_config_pb2, text_format


def parse_config(text: str) -> Any:
    """config.pbtxt text -> ``ModelConfig``; unknown fields or bad values raise DFlash2Error."""
    pb, text_format = _pb()
    try:
        return text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as e:
        raise DFlash2Error(f"invalid Triton model config: {e}") from None


def _write_config(model_dir: Path, cfg: Any) -> None:
    _, text_format = _pb()
    text = text_format.MessageToString(cfg)
    if parse_config(text) != cfg:  # the written text must say exactly what was built
        raise DFlash2Error(f"{model_dir.name}/config.pbtxt does not round-trip through the ModelConfig parser")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file():
            _link_or_copy(p, dst / p.relative_to(src))


def python_model_config(name: str, instances: int, backend: str, default_mode: str, default_max_tokens: int,
                        max_tokens_limit: int, ort_threads: int, verify_checksums: bool) -> Any:
    pb, _ = _pb()
    cfg = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for n, t, dims in _INPUTS:
        cfg.input.add(name=n, data_type=pb.DataType.Value(t), dims=dims, optional=True)
    for n, t, dims in _OUTPUTS:
        cfg.output.add(name=n, data_type=pb.DataType.Value(t), dims=dims)
    # KIND_CPU: the stub process picks its own device (TensorRT / CUDA EP) through the runtime
    cfg.instance_group.add(count=instances, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    params = {"export_dir": EXPORT_SUBDIR, "backend": backend, "default_selector_mode": default_mode,
              "default_max_tokens": str(default_max_tokens), "max_tokens_limit": str(max_tokens_limit),
              "ort_threads": str(ort_threads), "verify_checksums": "true" if verify_checksums else "false"}
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    return cfg


def _trt_dims(shape: tuple) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def plan_model_config(name: str, graph: GraphSpec, plugin_file: str | None) -> Any:
    """A ``tensorrt_plan`` model for one engine; IO names/types/dims from the export manifest's graph entry."""
    pb, _ = _pb()
    cfg = pb.ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=0, default_model_filename="model.plan")
    for io, field in ((graph.inputs, cfg.input), (graph.outputs, cfg.output)):
        for t in io:
            if t.dtype not in _TRT_TYPES:
                raise DFlash2Error(f"tensor {t.name!r} of {name}: dtype {t.dtype!r} has no Triton type")
            field.add(name=t.name, data_type=pb.DataType.Value(_TRT_TYPES[t.dtype]), dims=_trt_dims(t.shape))
    cfg.instance_group.add(count=1, kind=pb.ModelInstanceGroup.Kind.KIND_GPU)
    if plugin_file:
        # the TensorRT backend loads plugins from --backend-config=tensorrt,plugins=...; recorded here so a
        # pipeline author finds the library (it sits beside the plan)
        cfg.parameters["plugin_library"].string_value = plugin_file
    return cfg


def write_triton_repo(export_dir: str | Path, repo_dir: str | Path, *, model_name: str = DEFAULT_MODEL_NAME,
                      instances: int = 1, backend: str = "auto", default_mode: str = "greedy",
                      default_max_tokens: int = 128, ort_threads: int = 0, verify_checksums: bool = True,
                      overwrite: bool = False) -> list[str]:
    """Write the model repository for ``export_dir`` into ``repo_dir``; returns the model names written.
    ``overwrite``: replace a repository of ours that holds files its record does not list (named first)."""
    export_dir, repo = Path(export_dir), Path(repo_dir)
    m = read_manifest(export_dir, verify_checksums=False)  # the server's instances verify them when they load
    if instances < 1:
        raise DFlash2Error(f"--triton-instances must be >= 1, got {instances}")
    if backend not in BACKEND_CHOICES:
        raise DFlash2Error(f"--triton-backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    m.check_draft_mode(default_mode)
    if not 1 <= default_max_tokens <= m.max_seq_len:
        raise DFlash2Error(f"--triton-max-tokens must be in [1, {m.max_seq_len}], got {default_max_tokens}")
    check_replace(repo, "--triton-repo", repo_owner, overwrite)
    try:
        with TempFolder(repo, "triton") as t:
            names = _write_repo(t.path, export_dir, m, model_name, instances, backend, default_mode,
                                default_max_tokens, ort_threads, verify_checksums)
            write_repo_record(t.path)
            if not overwrite:
                check_replace(repo, "--triton-repo", repo_owner)  # again: it may have changed meanwhile
            t.publish()
    except OSError as e:
        raise write_error(e, repo) from None
    return names


def _write_repo(tmp: Path, export_dir: Path, m, model_name: str, instances: int, backend: str,  # noqa: ANN001
                default_mode: str, default_max_tokens: int, ort_threads: int, verify_checksums: bool) -> list[str]:
    """Build the repository in ``tmp``; returns the model names."""
    names = [model_name]
    mdir = tmp / model_name
    _write_config(mdir, python_model_config(model_name, instances, backend, default_mode, default_max_tokens,
                                            m.max_seq_len, ort_threads, verify_checksums))
    (mdir / "1").mkdir()
    shutil.copy2(TEMPLATE, mdir / "1" / "model.py")
    _copy_tree(export_dir, mdir / "1" / EXPORT_SUBDIR)
    if m.engines is not None:
        plug = m.engines.plugin.file if m.engines.plugin else None
        for key, plan in sorted(m.engines.plans.items()):
            name = f"{model_name}_{key}"
            lib = Path(plug).name if plug and m.graphs[key].selector == "plugin" else None
            _write_config(tmp / name, plan_model_config(name, m.graphs[key], f"1/{lib}" if lib else None))
            _link_or_copy(export_dir / plan.file, tmp / name / "1" / "model.plan")
            if lib:
                _link_or_copy(export_dir / plug, tmp / name / "1" / lib)
            names.append(name)
    return names


# -- the bundled server (PyPI nvidia-pytriton) ----------------------------------------------------------------
def pytriton_server_dir() -> Path:
    """``.../pytriton/tritonserver`` of the installed nvidia-pytriton wheel, found without importing pytriton
    (its package imports a client stack the server does not need)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise DFlash2Error("the bundled tritonserver needs nvidia-pytriton: pip install --no-deps nvidia-pytriton")
    d = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (d / "bin" / "tritonserver").is_file():
        raise DFlash2Error(f"{d}/bin/tritonserver is missing (a broken nvidia-pytriton install?)")
    return d


def backend_dir(root: str | Path) -> Path:
    """A ``--backend-directory`` for this interpreter under ``root``: the wheel's python backend with the stub
    built for this Python version (the wheel keeps one per version apart). Links only, made once."""
    server = pytriton_server_dir()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise DFlash2Error(f"nvidia-pytriton has no python backend stub for Python {ver}")
    out = Path(root) / f"triton-backends-py{ver}"
    if (out / "python" / "triton_python_backend_stub").resolve() == stub.resolve():
        return out
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".triton-backends-", dir=root))
    (tmp / "python").mkdir()
    for src in (server / "backends" / "python" / "libtriton_python.so",
                server / "backends" / "python" / "triton_python_backend_utils.py", stub):
        # a link, not a copy: the stub finds its libraries through an $ORIGIN-relative rpath
        (tmp / "python" / src.name).symlink_to(src)
    tmp.chmod(0o755)
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def numpy1_dir() -> Path:
    """Where the NumPy 1.x the server's python needs lives: $DFLASH2_TRITON_NUMPY1, else <venv>/triton-numpy1.

    The python backend of nvidia-pytriton 0.7 is built against the NumPy 1.x C ABI: under NumPy 2 every output
    tensor reaches the server empty ("output tensor shape does not match size of output"). The runtime runs
    unchanged on NumPy 1.26, so the server puts this folder (``pip install --no-deps --target DIR
    numpy==1.26.4``, done by scripts/setup.sh) ahead of the environment's own NumPy."""
    return Path(os.environ.get("DFLASH2_TRITON_NUMPY1", Path(sys.prefix) / "triton-numpy1"))


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: PYTHONPATH = the NumPy 1.x folder + the current PYTHONPATH + this interpreter's
    site-packages (model.py adds them: the isolated stub does not read PYTHONPATH); LD_LIBRARY_PATH += the
    folder of this interpreter's libpython (the stub loads the libpython of its Python version)."""
    import site

    env = dict(os.environ if base is None else base)
    np1 = numpy1_dir()
    if not (np1 / "numpy" / "__init__.py").is_file():
        raise DFlash2Error(f"the Triton python backend needs NumPy 1.x beside this environment: pip install "
                           f"--no-deps --target {np1} numpy==1.26.4 (or set DFLASH2_TRITON_NUMPY1)")
    paths = [str(np1)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(np1)]
    paths += [p for p in site.getsitepackages() if p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    libdir, lib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and lib and (Path(libdir) / lib).exists():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def server_command(repo: str | Path, backends: str | Path, *, address: str = "127.0.0.1", http_port: int = 8000,
                   grpc_port: int = 8001, metrics_port: int = 8002, plugins: list[str] | None = None) -> list[str]:
    """argv of the bundled tritonserver serving ``repo`` (plugins: TensorRT plugin libraries, GPU servers)."""
    argv = [str(pytriton_server_dir() / "bin" / "tritonserver"), f"--model-repository={Path(repo).resolve()}",
            f"--backend-directory={Path(backends).resolve()}", f"--http-address={address}",
            f"--grpc-address={address}", f"--metrics-address={address}", f"--http-port={http_port}",
            f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", "--exit-timeout-secs=10"]
    if plugins:
        argv.append(f"--backend-config=tensorrt,plugins={';'.join(plugins)}")
    return argv


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TritonServer:
    """The bundled tritonserver on loopback, on free ports, logging to ``log_path``.

    ``with TritonServer(repo, backends, log) as srv:`` starts it and waits until every model is ready (or the
    server exits / ``timeout`` passes: DFlash2Error with the log's tail); leaving stops it with SIGINT (in-flight
    requests finish, models unload, stubs exit) and kills it only past ``stop_timeout``.
    """

    def __init__(self, repo: str | Path, backends: str | Path, log_path: str | Path, timeout: float = 120.0,
                 stop_timeout: float = 30.0, extra_env: dict[str, str] | None = None) -> None:
        self.repo, self.log_path, self.timeout, self.stop_timeout = Path(repo), Path(log_path), timeout, stop_timeout
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.argv = server_command(repo, backends, http_port=self.http_port, grpc_port=self.grpc_port,
                                   metrics_port=self.metrics_port)
        self.env = server_env()
        self.env.update(extra_env or {})
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def start(self) -> TritonServer:
        import urllib.request

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DFlash2Error(f"tritonserver exited ({self.proc.returncode}) while starting:\n"
                                   + "\n".join(self.log().splitlines()[-40:]))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise DFlash2Error(f"tritonserver not ready after {self.timeout:.0f} s:\n"
                           + "\n".join(self.log().splitlines()[-40:]))

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            self.returncode = None if self.proc is None else self.proc.returncode
            return self.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            self.returncode = self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the stubs go too
            self.returncode = self.proc.wait()
        return self.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- CLI ----------------------------------------------------------------------------------------------------
def add_triton_options(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--triton-repo", required=required, metavar="DIR",
                   help="write a Triton Inference Server model repository to DIR")
    p.add_argument("--triton-model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--triton-instances", type=V.integer(1, 1024), default=1, help="model instances (concurrent requests)")
    p.add_argument("--triton-backend", choices=BACKEND_CHOICES, default="auto",
                   help="runtime backend inside the server")
    p.add_argument("--triton-selector", choices=DRAFT_MODES, default="greedy",
                   help="default selector mode (a request may choose another)")
    p.add_argument("--triton-max-tokens", type=V.COUNT, default=128, help="default max tokens of a request")


def run_write(export_dir: str | Path, a: argparse.Namespace) -> int:
    """``dflash2 triton-repo`` / ``dflash2 export --triton-repo``: write the repository from parsed options, print
    what was written and the command that serves it (user errors raise DFlash2Error: one line from the CLI)."""
    names = write_triton_repo(export_dir, a.triton_repo, model_name=a.triton_model_name, instances=a.triton_instances,
                              backend=a.triton_backend, default_mode=a.triton_selector,
                              default_max_tokens=a.triton_max_tokens, overwrite=getattr(a, "overwrite", False))
    print(f"wrote Triton model repository {a.triton_repo} (models: {', '.join(names)})")
    try:
        from dflash2_trt.target import cache_dir

        cmd = server_command(a.triton_repo, backend_dir(cache_dir()))
        env = server_env({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "LD_LIBRARY_PATH")})
        print("serve it with:\n  " + " ".join([f"PYTHONPATH={env['PYTHONPATH']}"]
                                           + ([f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}"]
                                              if "LD_LIBRARY_PATH" in env else []) + cmd))
    except DFlash2Error as e:  # no bundled server here: the repository still serves on any Triton
        print(f"(no bundled server to print a command for: {e})")
    return 0


def summary(repo: str | Path) -> dict[str, Any]:
    """{model name: parsed config as a dict} of a written repository (for tests and tools)."""
    from google.protobuf.json_format import MessageToDict

    return {c.parent.name: MessageToDict(parse_config(c.read_text()))
            for c in sorted(Path(repo).glob("*/config.pbtxt"))}
