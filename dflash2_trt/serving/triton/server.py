"""Serving a Triton model repository (written by :mod:`dflash2_trt.serving.triton.repo`) with the bundled
server of the PyPI ``nvidia-pytriton`` wheel, which runs the python backend on the CPU (standard library only;
no torch).

``server_command`` gives the exact ``tritonserver`` command; ``serve_hint`` the line ``dflash2 triton-repo``
prints; ``TritonServer`` starts it on loopback, waits until the model is ready and stops it (used by the tests).
The python backend's stub embeds the interpreter's ``libpython`` in isolated mode: the server's environment
carries ``PYTHONPATH`` (a NumPy 1.x folder, see ``numpy1_dir``, then this interpreter's site-packages;
model.py adds them itself) and ``LD_LIBRARY_PATH`` (where libpython lives).
"""

from __future__ import annotations

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

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.paths import cache_dir


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


def serve_hint(repo: str | Path) -> str:
    """The command (with its environment) that serves ``repo`` on the bundled server, or why there is none."""
    try:
        cmd = server_command(repo, backend_dir(cache_dir()))
        env = server_env({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "LD_LIBRARY_PATH")})
    except DFlash2Error as e:  # no bundled server here: the repository still serves on any Triton
        return f"(no bundled server to print a command for: {e})"
    return "serve it with:\n  " + " ".join([f"PYTHONPATH={env['PYTHONPATH']}"]
                                          + ([f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}"]
                                             if "LD_LIBRARY_PATH" in env else []) + cmd)
