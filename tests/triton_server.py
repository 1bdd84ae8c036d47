"""Start and stop a real ``tritonserver`` for tests (not a test module).

The server comes from the ``nvidia-pytriton`` wheel (a dev dependency), which bundles
``pytriton/tritonserver/bin/tritonserver``, the Python backend and one backend stub per Python
version. Recipe (see DESIGN.md, "Triton"): copy the backends folder somewhere writable, put the
stub for the running Python into ``backends/python/``, and start the binary with
``LD_LIBRARY_PATH`` = the wheel's ``nvidia_pytriton.libs`` (bundled libcudart etc.) plus the
Python ``LIBDIR`` (libpython), and ``PATH`` starting with this interpreter's bin directory (the
stub runs that Python, which needs numpy). It runs on CPU-only machines.

    ok, reason = tritonserver_available()
    with running_tritonserver(repo_dir) as (http_url, metrics_url, proc):
        ...  # http_url = "http://127.0.0.1:PORT", metrics_url = "http://127.0.0.1:PORT/metrics"
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
EXIT_TIMEOUT_SECS = 2
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backends: Path  # the wheel's backends/ folder (read-only; copied before use)
    stub: Path  # triton_python_backend_stub for the running Python
    libs: Path  # site-packages/nvidia_pytriton.libs
    python_libdir: Path


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def locate() -> TritonInstall:
    """Find the pytriton-bundled tritonserver; raises FileNotFoundError with the reason."""
    if sys.platform != "linux":
        raise FileNotFoundError(f"the pytriton tritonserver binary runs on Linux only (this is {sys.platform})")
    spec = importlib.util.find_spec("pytriton")  # does not import pytriton itself
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise FileNotFoundError(f"no tritonserver binary at {binary}")
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"{binary} is not executable")
    backends = root / "backends"
    if not (backends / "python" / "libtriton_python.so").is_file():
        raise FileNotFoundError(f"no python backend at {backends / 'python'}")
    stub = root / "python_backend_stubs" / _python_version() / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
        raise FileNotFoundError(f"no python backend stub for Python {_python_version()} (wheel has {have})")
    libs = pkg.parent / "nvidia_pytriton.libs"
    if not libs.is_dir():
        raise FileNotFoundError(f"no bundled libraries at {libs}")
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "")
    if not list(libdir.glob(f"libpython{_python_version()}*.so*")):
        raise FileNotFoundError(f"no shared libpython{_python_version()} in {libdir} (the stub links it)")
    return TritonInstall(binary=binary, backends=backends, stub=stub, libs=libs, python_libdir=libdir)


def server_env(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    ld = [str(install.libs), str(install.python_libdir)]
    if env.get("LD_LIBRARY_PATH"):
        ld.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@functools.cache
def tritonserver_available() -> tuple[bool, str]:
    """(True, "binary path") if a tritonserver can be started here, else (False, why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"the pytriton tritonserver binary is x86_64 only (this is {platform.machine()})"
    try:
        install = locate()
    except FileNotFoundError as exc:
        return False, str(exc)
    if importlib.util.find_spec("numpy") is None:
        return False, "numpy is not installed in this Python (the python backend stub needs it)"
    try:  # proves the dynamic linking works without starting a server
        done = subprocess.run([str(install.binary), "--help"], env=server_env(install), capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{install.binary} --help failed: {exc}"
    out = (done.stdout or "") + (done.stderr or "")
    if "--model-repository" not in out:
        return False, f"{install.binary} --help did not print usage (rc={done.returncode}): {out[-LOG_TAIL_CHARS:]}"
    return True, str(install.binary)


def prepare_backends(install: TritonInstall, dest: Path) -> Path:
    """Copy the wheel's backends/ to ``dest`` and add the stub for the running Python."""
    backends = dest / "backends"
    shutil.copytree(install.backends, backends, ignore=shutil.ignore_patterns("__pycache__"))
    target = backends / "python" / "triton_python_backend_stub"
    shutil.copy2(install.stub, target)
    target.chmod(0o755)
    return backends


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now on 127.0.0.1 (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # local URL
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class TritonProcess:
    process: subprocess.Popen
    http_url: str
    metrics_url: str
    log_path: Path
    workdir: Path
    started_in_s: float = 0.0

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return _tail(self.log_path, chars)


def start_tritonserver(repo_dir: str | os.PathLike, *, timeout: float = START_TIMEOUT_S,
                       extra_args: tuple[str, ...] = (), workdir: Path | None = None) -> TritonProcess:
    """Start tritonserver (explicit model control) on free ports and wait until it is ready.

    Raises RuntimeError (with the server's log tail) if it exits or is not ready within ``timeout``.
    """
    ok, reason = tritonserver_available()
    if not ok:
        raise RuntimeError(f"tritonserver is not available: {reason}")
    install = locate()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="tessera-triton-"))
    backends = workdir / "backends"
    if not backends.is_dir():
        prepare_backends(install, workdir)
    log_path = workdir / "tritonserver.log"
    http_port, grpc_port, metrics_port = free_ports(3)
    args = [
        str(install.binary),
        f"--model-repository={Path(repo_dir).resolve()}",
        "--model-control-mode=explicit",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={EXIT_TIMEOUT_SECS}",
        "--log-verbose=0",
        *extra_args,
    ]
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=server_env(install),
                                cwd=workdir, start_new_session=True)
    server = TritonProcess(process=proc, http_url=f"http://127.0.0.1:{http_port}",
                           metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", log_path=log_path,
                           workdir=workdir)
    deadline = t0 + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode} before it was ready; "
                               f"log tail:\n{server.log_tail()}")
        if _http_ok(f"{server.http_url}/v2/health/ready") and _http_ok(server.metrics_url):
            server.started_in_s = time.monotonic() - t0
            return server
        if time.monotonic() > deadline:
            stop_tritonserver(server)
            raise RuntimeError(f"tritonserver was not ready within {timeout:.0f}s; log tail:\n{server.log_tail()}")
        time.sleep(0.1)


def stop_tritonserver(server: TritonProcess, *, timeout: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, wait, then SIGKILL the server's process group (its python stubs). Returns the exit code."""
    proc = server.process
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind in the server's own session
    return proc.returncode


@contextlib.contextmanager
def running_tritonserver(repo_dir: str | os.PathLike, *, timeout: float = START_TIMEOUT_S,
                         extra_args: tuple[str, ...] = (),
                         keep_workdir: bool = False) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """Yield ``(http_url, metrics_url, process)`` for a ready server; stop it (and clean up) on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="tessera-triton-"))
    try:
        server = start_tritonserver(repo_dir, timeout=timeout, extra_args=extra_args, workdir=workdir)
        try:
            yield server.http_url, server.metrics_url, server.process
        finally:
            stop_tritonserver(server)
    finally:
        if not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
