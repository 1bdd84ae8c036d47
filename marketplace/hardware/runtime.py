"""The serving runtime of a node: start, stop, status and logs of the Triton server of one slice.

One small interface with three backends, chosen by ``TESSERA_SERVING_RUNTIME``:

* ``process``: runs the ``tritonserver`` binary on the node. When the worker is root, each server runs in a
  sandbox of its own (``sandbox.py``: PID, IPC, mount and network namespaces, firewall rules, a cgroup with the
  slice's limits, its own Unix user without capabilities), isolation ``sandbox``; a root worker on a host that
  cannot make one refuses to start the server rather than run it unconfined. Otherwise (a laptop demo) the
  server runs as the worker's user and the isolation is reported as ``none``.
* ``docker``: the same through the Docker Engine API (the ``docker`` Python SDK) with NVIDIA's Triton
  image, ``--gpus device=<MIG UUID>``, only that slice's repository mounted read-only, a bridge network and
  ports published on the node's private address.
* ``sim``: the simulated Triton server of the demo and the tests (``triton.SimTritonBackend``), started
  and stopped like a real one: a started server has no model loaded (explicit model control).

Every server is started with ``--model-control-mode=explicit`` and with all its APIs (repository, config,
inference, health...) restricted by Triton itself (``--http-restricted-api`` / ``--grpc-restricted-protocol``)
to callers that send a per-server secret only Tessera holds.
Its environment is built from nothing: no database, broker or Redis URL, no secret key, no API key.

Pure Python: Django is not imported here; the services pass everything in a ``ServerSpec``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marketplace.hardware import sandbox as sb

# Every API: the repository, config and shared-memory ones so that no one but Tessera loads a model, and
# inference, metadata, statistics and health as well, since tenants' python models run on the same host and
# could otherwise call (or read the statistics of) another slice's server on its node-private address.
RESTRICTED_APIS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
                   "statistics", "trace", "logging")
SECRET_HEADER = "tessera-repository-key"
NODE_LABEL = "tessera.node"
LOG_FILE = "tritonserver.log"
PID_FILE = "server.pid"
LOG_TAIL_CHARS = 4000
EXIT_TIMEOUT_SECS = 2
USER_MARKER = "tessera slice server"  # the GECOS field of the users Tessera makes: "<marker> <installation>/<name>"
RUNTIME_KINDS = ("process", "docker", "sim")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")


class RuntimeFault(Exception):
    """The server could not be started or stopped; ``str()`` is the operator-facing reason."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything one slice's server needs. ``name`` is unique on the node (``allocation-<id>``)."""

    name: str
    repo_dir: Path
    work_dir: Path
    device_uuid: str  # a GPU group's: its GPUs' UUIDs, comma-separated (CUDA_VISIBLE_DEVICES' list form)
    address: str
    http_port: int
    grpc_port: int
    metrics_port: int
    secret: str
    isolate: bool = True  # a sandbox of its own (process runtime, worker is root)
    gpu_metrics: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    memory_mb: int | None = None  # the slice's memory (the simulator's load check)
    tokens_per_s: float | None = None  # the simulator's performance model
    reach: str = ""  # where clients connect, as the runtime answered at start (empty: ``address``)
    installation: str = "local"  # names the sandbox's user, namespace, cgroup and rules
    limits: sb.Limits | None = None  # the sandbox's limits (None: no sandbox can be made for this spec)
    devices: tuple[str, ...] = ()  # the GPU's device nodes the sandbox lets through
    binds: tuple[str, ...] = ()  # folders the server reads besides its repository (the model store), read-only

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"server name {self.name!r} must match {NAME_RE.pattern}")
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        if len(set(ports)) != 3 or not all(0 < p < 65536 for p in ports):
            raise ValueError(f"three distinct ports in 1..65535 are needed, not {ports}")

    @property
    def unix_user(self) -> str:
        return sb.names(self.installation, self.name).user

    @property
    def device_uuids(self) -> list[str]:
        return [u for u in self.device_uuid.split(",") if u]

    @property
    def http_url(self) -> str:
        return f"http://{_url_host(self.reach or self.address)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.reach or self.address)}:{self.metrics_port}/metrics"

    def restricted_args(self) -> list[str]:
        apis = ",".join(RESTRICTED_APIS)
        return [f"--http-restricted-api={apis}:{SECRET_HEADER}={self.secret}",
                f"--grpc-restricted-protocol={apis}:{SECRET_HEADER}={self.secret}"]

    def server_args(self, repo: str, backends: str | None, address: str | None = None) -> list[str]:
        """tritonserver's command line (the binary excluded). ``--strict-readiness=false``: the server is
        ready when it answers, whatever one model's load did; each model's readiness is its own."""
        address = address or self.address
        args = [f"--model-repository={repo}", "--model-control-mode=explicit",
                f"--http-address={address}", f"--http-port={self.http_port}",
                f"--grpc-address={address}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={address}", f"--metrics-port={self.metrics_port}",
                f"--allow-gpu-metrics={'true' if self.gpu_metrics else 'false'}",
                "--allow-sagemaker=false", "--allow-vertex-ai=false", "--strict-readiness=false",
                f"--exit-timeout-secs={EXIT_TIMEOUT_SECS}", "--log-verbose=0", *self.restricted_args()]
        if backends:
            args.insert(2, f"--backend-directory={backends}")
        return args


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@dataclass
class ServerStatus:
    running: bool
    pid: int | None = None
    exit_code: int | None = None
    container_id: str = ""
    detail: str = ""
    address: str = ""  # where clients reach it (a sandbox's inner address; empty: the spec's address)


class ServingRuntime(ABC):
    kind: str = ""

    @abstractmethod
    def isolation(self, spec: ServerSpec) -> str:
        """"sandbox", "container", "none" or "sim": what keeps this server from the others and the node."""

    @abstractmethod
    def start(self, spec: ServerSpec) -> ServerStatus:
        """Start the server (does not wait for ready); a server already running for ``spec`` is kept."""

    @abstractmethod
    def stop(self, spec: ServerSpec, timeout: float = 20.0) -> int | None:
        """Stop it (SIGTERM, then SIGKILL); a server that is not running is a no-op. Returns its exit code."""

    @abstractmethod
    def status(self, spec: ServerSpec) -> ServerStatus: ...

    @abstractmethod
    def logs(self, spec: ServerSpec, chars: int = LOG_TAIL_CHARS) -> str: ...

    @abstractmethod
    def running(self, work_root: Path, node: str) -> list[str]:
        """Names of the servers this runtime has running for ``node`` (found without the database; several
        simulated nodes may share one host)."""

    def cleanup(self, spec: ServerSpec) -> None:  # noqa: B027 - optional
        """Remove what start() made besides the repository (the server's Unix user...)."""

    def hand_over(self, spec: ServerSpec) -> None:  # noqa: B027 - optional
        """Give files Tessera wrote into the repository to the server's user (process runtime, isolated)."""

    def census(self, spec: ServerSpec) -> sb.Census | None:
        """What runs in the server's sandbox and which of its limits were hit (None: not sandboxed)."""
        return None

    def kill_model(self, spec: ServerSpec, model: str) -> int:
        """Kill one model's processes (a python model's stubs and all they forked); how many were killed."""
        return 0

    def trim_log(self, spec: ServerSpec) -> bool:
        """Keep the server's log file bounded (runtimes whose log is a file the server appends to)."""
        return False


# --------------------------------------------------------------------------------------------------
# The tritonserver installation: the binary, its libraries, the python backend and its stub
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    libs: Path | None  # extra LD_LIBRARY_PATH (pytriton's bundled libraries)
    backends: Path  # backends/ with python/ (and its stub)
    stub: Path | None  # the python backend stub to put into backends/python/, if not there yet


def _python_version_of(python: str) -> tuple[str, str]:
    """(X.Y, LIBDIR) of a Python interpreter."""
    code = "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); print(sysconfig.get_config_var('LIBDIR'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeFault(f"the python backend's Python {python} does not run: {exc}") from None
    version, libdir = out.split()[:2]
    return version, libdir


@functools.cache
def python_info(python: str) -> tuple[str, str]:
    return _python_version_of(python)


@functools.cache
def python_prefixes(python: str) -> tuple[str, ...]:
    """``sys.prefix`` and ``sys.base_prefix`` of a Python interpreter (once per process)."""
    code = "import sys; print(sys.prefix); print(sys.base_prefix)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30,
                             check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeFault(f"the python backend's Python {python} does not run: {exc}") from None
    return tuple(dict.fromkeys(out))


def locate_triton(binary: str = "", python: str = "") -> TritonInstall:
    """The configured binary, else the one the nvidia-pytriton wheel ships (CPU machines, tests).

    Raises RuntimeFault naming what is missing.
    """
    if binary:
        path = Path(binary)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise RuntimeFault(f"tritonserver binary {path} is missing or not executable (TESSERA_TRITONSERVER)")
        root = path.parent.parent
        return TritonInstall(binary=path, libs=None, backends=root / "backends", stub=None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeFault("no tritonserver: set TESSERA_TRITONSERVER to the binary, or install nvidia-pytriton")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    path = root / "bin" / "tritonserver"
    if not path.is_file():
        raise RuntimeFault(f"no tritonserver binary at {path}")
    version, _ = python_info(python or sys.executable)
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeFault(f"nvidia-pytriton has no python backend stub for Python {version}")
    return TritonInstall(binary=path, libs=pkg.parent / "nvidia_pytriton.libs", backends=root / "backends",
                         stub=stub)


def _reachable_by_others(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that other users cannot traverse, or None."""
    path = path.resolve()
    for folder in [*reversed(path.parents), path] if path.is_dir() else reversed(path.parents):
        try:
            mode = folder.stat().st_mode
        except OSError:
            return folder
        if not mode & stat.S_IXOTH:
            return folder
    return None


def stage_install(install: TritonInstall, dest: Path) -> TritonInstall:
    """Copy the installation to ``dest`` (once; world-readable) so per-slice users can run it wherever the
    worker's own files live. A finished copy is marked by ``dest/.complete``."""
    done = dest / ".complete"
    if not done.is_file():
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "bin").mkdir(parents=True)
        shutil.copy2(install.binary, tmp / "bin" / "tritonserver")
        if install.libs is not None:
            shutil.copytree(install.libs, tmp / "libs")
        shutil.copytree(install.backends, tmp / "backends", ignore=shutil.ignore_patterns("__pycache__"))
        if install.stub is not None:
            shutil.copy2(install.stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        for folder, _dirs, files in os.walk(tmp):
            os.chmod(folder, 0o755)
            for f in files:
                p = Path(folder) / f
                p.chmod(0o755 if os.access(p, os.X_OK) else 0o644)
        (tmp / ".complete").write_text(str(install.binary))
        with contextlib.suppress(FileExistsError, OSError):
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        shutil.rmtree(tmp, ignore_errors=True)
    return TritonInstall(binary=dest / "bin" / "tritonserver", libs=(dest / "libs") if (dest / "libs").is_dir()
                         else None, backends=dest / "backends", stub=None)


# --------------------------------------------------------------------------------------------------
# process
# --------------------------------------------------------------------------------------------------

def _pid_file(work_dir: Path) -> list[str]:
    """The pid file's lines: pid, node, repository, the address clients reach the server at."""
    try:
        return (work_dir / PID_FILE).read_text().split("\n")
    except OSError:
        return []


def _read_pid(work_dir: Path) -> int | None:
    try:
        return int(_pid_file(work_dir)[0].split()[0])
    except (ValueError, IndexError):
        return None


def _alive(pid: int, repo_dir: Path) -> bool:
    """The process exists, is not a zombie, and is a tritonserver (or the sandbox holding one) serving this
    repository."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if status.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return False
    repo = str(repo_dir).encode()
    return b"--model-repository=" + repo in cmdline or (repo in cmdline and sb.INNER_REPO.encode() in cmdline)


class ProcessRuntime(ServingRuntime):
    """``tritonserver`` processes on this host. ``python``: the Python the python backend stub embeds (same
    X.Y as its stub, with numpy; readable by the per-slice users). A root worker runs each server in its own
    sandbox (``sandbox.Sandbox``); ``sandbox`` is that host's sandbox maker."""

    kind = "process"

    def __init__(self, *, binary: str = "", python: str = "", runtime_dir: Path | None = None,
                 run_as_root: bool | None = None, sandbox: sb.Sandbox | None = None) -> None:
        self.binary = binary
        self.python = python or sys.executable
        self.runtime_dir = runtime_dir
        self.is_root = (os.geteuid() == 0) if run_as_root is None else run_as_root
        self.sandbox = sandbox or sb.Sandbox(installation="local")
        self._children: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def isolation(self, spec: ServerSpec) -> str:
        return "sandbox" if spec.isolate and self.is_root else "none"

    # -- users -------------------------------------------------------------------------------
    @staticmethod
    def _marker(spec: ServerSpec) -> str:
        return f"{USER_MARKER} {spec.installation}/{spec.name}"

    def _begin_user(self, spec: ServerSpec) -> subprocess.Popen | None:
        """Start ``useradd`` for the server's own user unless Tessera made it before (it syncs the account files:
        tens of ms, spent while the sandbox's network is made; ``_user_made`` waits for it); any other account of
        that name is refused, never used."""
        name = spec.unix_user
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            if entry.pw_gecos != self._marker(spec):
                raise RuntimeFault(f"a Unix account named {name} exists and was not made by Tessera for this server "
                                   f"(its comment is {entry.pw_gecos!r}): refusing to run a slice as it")
            return None
        cmd = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
               "--shell", "/usr/sbin/nologin", "--user-group", "--comment", self._marker(spec), name]
        try:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            raise RuntimeFault(f"could not create the server's Unix user {name}: {exc}") from None

    def _user_made(self, spec: ServerSpec, proc: subprocess.Popen | None) -> tuple[int, int]:
        name = spec.unix_user
        if proc is not None:
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeFault(f"could not create the server's Unix user {name}: useradd hung") from None
            if proc.returncode != 0:
                raise RuntimeFault(f"could not create the server's Unix user {name}: useradd exited "
                                   f"{proc.returncode}: {(out or '').strip()[:300]}")
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid

    def _remove_user(self, spec: ServerSpec) -> None:
        try:
            entry = pwd.getpwnam(spec.unix_user)
        except KeyError:
            return
        if entry.pw_gecos != self._marker(spec):
            return  # not ours: never touched
        try:
            done = subprocess.run(["userdel", spec.unix_user], capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeFault(f"could not remove the server's Unix user {spec.unix_user}: {exc}") from None
        if done.returncode != 0:
            raise RuntimeFault(f"could not remove the server's Unix user {spec.unix_user}: userdel exited "
                               f"{done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")

    def hand_over(self, spec: ServerSpec) -> None:
        if self.isolation(spec) != "sandbox":
            return
        try:
            entry = pwd.getpwnam(spec.unix_user)
        except KeyError:
            return
        _chown_tree(spec.repo_dir, entry.pw_uid, entry.pw_gid)
        spec.repo_dir.chmod(0o700)

    def cleanup(self, spec: ServerSpec) -> None:
        """The sandbox (cgroups, firewall rules, network namespace) and the server's user. Raises RuntimeFault
        when one of them could not be removed (never silently)."""
        if self.isolation(spec) != "sandbox":
            return
        try:
            self.sandbox.remove(spec.name)
        except sb.SandboxFault as exc:
            raise RuntimeFault(f"the sandbox of {spec.name} could not be removed: {exc}") from None
        self._remove_user(spec)

    # -- start / stop ------------------------------------------------------------------------
    def _install(self, spec: ServerSpec) -> TritonInstall:
        """The installation to run: a configured one as it is (a sandbox binds its root read-only); the wheel's
        staged once with the python backend's stub in backends/python, world-readable."""
        install = locate_triton(self.binary, self.python)
        if install.stub is not None:
            install = stage_install(install, self.runtime_dir or spec.work_dir.parent / ".runtime")
        return install

    def _environment(self, spec: ServerSpec, install: TritonInstall, home: Path) -> dict[str, str]:
        """Built from nothing: nothing of the worker's environment (database, broker, secrets) leaks in."""
        _, libdir = python_info(self.python)
        ld = [str(p) for p in (install.libs, libdir) if p]
        return {
            "PATH": os.pathsep.join([str(Path(self.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            "LD_LIBRARY_PATH": os.pathsep.join(ld),
            "CUDA_VISIBLE_DEVICES": spec.device_uuid,
            "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8",
        }

    def _python_binds(self) -> list[Path]:
        """The python backend's Python outside /usr (its prefix), read-only in the sandbox."""
        return [Path(p) for p in python_prefixes(self.python) if not p.startswith("/usr")]

    def _check_sandbox(self, install: TritonInstall) -> None:
        why = self.sandbox.unavailable()
        if why is not None:
            raise RuntimeFault(f"the slice's sandbox cannot be made on this node: {why} (TESSERA_SERVING_ISOLATE=0 "
                               f"runs servers unconfined, for a laptop demo only)")
        py_blocked = _reachable_by_others(Path(python_info(self.python)[1]))
        if py_blocked is not None:
            raise RuntimeFault(f"the python backend's Python {self.python} is not readable by the per-slice "
                               f"users ({py_blocked} is closed): set TESSERA_TRITON_PYTHON to a Python "
                               f"that other users can run, with numpy (e.g. Debian's python3 with "
                               f"python3-numpy)")

    def start(self, spec: ServerSpec) -> ServerStatus:
        current = self.status(spec)
        if current.running:
            return current
        install = self._install(spec)
        spec.work_dir.mkdir(parents=True, exist_ok=True)
        spec.work_dir.chmod(0o700)
        spec.repo_dir.mkdir(parents=True, exist_ok=True)
        sandboxed = self.isolation(spec) == "sandbox"
        if sandboxed:
            self._check_sandbox(install)
        else:
            busy = _ports_in_use(spec.address, (spec.http_port, spec.grpc_port, spec.metrics_port))
            if busy:
                raise RuntimeFault(f"port(s) {', '.join(map(str, busy))} on {spec.address} are already in use")
        log_path = spec.work_dir / LOG_FILE
        reach = spec.address
        with open(log_path, "ab") as log:
            os.chmod(log_path, 0o600)
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} starting\n".encode())
            log.flush()
            with contextlib.ExitStack() as stack:
                fds: tuple[int, ...] = ()
                if sandboxed:
                    seccomp = stack.enter_context(open(self._seccomp(), "rb"))
                    fds = (seccomp.fileno(),)
                    args, env, cwd, reach = self._sandboxed(spec, install, seccomp.fileno())
                else:
                    home = spec.work_dir / "home"
                    home.mkdir(exist_ok=True)
                    args = [str(install.binary),
                            *spec.server_args(str(spec.repo_dir.resolve()), str(install.backends))]
                    env, cwd = self._environment(spec, install, home), str(home)
                try:
                    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=cwd, start_new_session=True, close_fds=True, pass_fds=fds)
                except OSError as exc:
                    if sandboxed:
                        with contextlib.suppress(sb.SandboxFault):
                            self.sandbox.remove(spec.name)
                    raise RuntimeFault(f"could not start {install.binary}: {exc}") from None
        (spec.work_dir / PID_FILE).write_text(f"{proc.pid}\n{spec.labels.get(NODE_LABEL, '')}\n"
                                              f"{spec.repo_dir.resolve()}\n{reach}\n")
        with self._lock:
            self._children[spec.name] = proc
        return ServerStatus(running=True, pid=proc.pid, address=reach)

    def _seccomp(self) -> Path:
        try:
            return self.sandbox.seccomp()
        except (ImportError, OSError, RuntimeError) as exc:  # no libseccomp
            raise RuntimeFault(f"the sandbox's seccomp filter could not be built (Debian: libseccomp2): "
                               f"{exc}") from None

    def _sandboxed(self, spec: ServerSpec, install: TritonInstall,
                   seccomp_fd: int) -> tuple[list[str], dict[str, str], str, str]:
        """Make the server's sandbox (user, cgroups, network) and the command that starts it there."""
        if spec.limits is None:
            raise RuntimeFault(f"no sandbox limits for {spec.name}")
        making = self._begin_user(spec)
        try:
            self.sandbox.make_cgroups(spec.name, spec.limits)
            net = self.sandbox.make_network(spec.name, (spec.http_port, spec.grpc_port, spec.metrics_port),
                                            spec.address)
        except sb.SandboxFault as exc:
            with contextlib.suppress(sb.SandboxFault):
                self.sandbox.remove(spec.name)
            if making is not None:
                making.wait(timeout=30)
            raise RuntimeFault(f"the slice's sandbox could not be made: {exc}") from None
        try:
            uid, gid = self._user_made(spec, making)
        except RuntimeFault:
            with contextlib.suppress(sb.SandboxFault):
                self.sandbox.remove(spec.name)
            raise
        _chown_tree(spec.repo_dir, uid, gid)
        spec.repo_dir.chmod(0o700)
        etc = sb.passwd_files(spec.work_dir / "etc", spec.unix_user, uid, gid)
        spec.work_dir.chmod(0o755)  # etc/ must be readable where bwrap binds it; the log stays 0600
        binds = [*self._python_binds(), *(Path(b) for b in spec.binds)]
        _, libdir = python_info(self.python)
        inner = sb.INNER_TRITON
        env = {
            "PATH": os.pathsep.join([str(Path(self.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            "LD_LIBRARY_PATH": os.pathsep.join([*([f"{inner}/libs"] if install.libs else []), libdir]),
            "CUDA_VISIBLE_DEVICES": spec.device_uuid,
            "HOME": sb.INNER_HOME, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        }
        argv = [f"{inner}/bin/tritonserver", *spec.server_args(sb.INNER_REPO, f"{inner}/backends", net.inner_ip)]
        root = install.binary.parent.parent
        args = self.sandbox.command(spec.name, uid=uid, gid=gid, argv=argv, env=env, repo=spec.repo_dir.resolve(),
                                    runtime=root, binds=binds, etc=etc, devices=spec.devices, limits=spec.limits,
                                    seccomp_fd=seccomp_fd)
        return args, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, "/", net.client_address

    def _reap(self, spec: ServerSpec) -> int | None:
        with self._lock:
            proc = self._children.get(spec.name)
        if proc is None:
            return None
        code = proc.poll()
        if code is not None:
            with self._lock:
                self._children.pop(spec.name, None)
        return code

    def status(self, spec: ServerSpec) -> ServerStatus:
        lines = _pid_file(spec.work_dir)
        pid = _read_pid(spec.work_dir)
        with self._lock:
            child = self._children.get(spec.name)
        # our own child that has not exited runs (its command line reads empty while it execs: sh -> ip -> bwrap)
        if pid is not None and (_alive(pid, spec.repo_dir.resolve())
                                or (child is not None and child.pid == pid and child.poll() is None)):
            return ServerStatus(running=True, pid=pid, address=lines[3] if len(lines) > 3 else "")
        # reaped only once seen dead: polled before the check, a child exiting in between lost its code
        return ServerStatus(running=False, pid=pid, exit_code=self._reap(spec))

    def stop(self, spec: ServerSpec, timeout: float = 20.0) -> int | None:
        st = self.status(spec)
        sandboxed = self.isolation(spec) == "sandbox"
        if st.running and st.pid:
            target = (self.sandbox.server_pid(spec.name) if sandboxed else None) or st.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGTERM)  # tritonserver itself: it unloads its models and exits
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.status(spec).running:
                time.sleep(0.05)
            if self.status(spec).running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.pid, signal.SIGKILL)
        if sandboxed:  # whatever is left in its cgroup (stubs, what they forked)
            with contextlib.suppress(sb.SandboxFault):
                self.sandbox.kill(spec.name)
        elif st.pid:  # its python stubs, in the server's own session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(st.pid, signal.SIGKILL)
        code = self._reap(spec)
        with self._lock:
            proc = self._children.pop(spec.name, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            (spec.work_dir / PID_FILE).unlink()
        return code

    def census(self, spec: ServerSpec) -> sb.Census | None:
        if self.isolation(spec) != "sandbox":
            return None
        return self.sandbox.census(spec.name)

    def kill_model(self, spec: ServerSpec, model: str) -> int:
        if self.isolation(spec) != "sandbox":
            return 0
        return sum(self.sandbox.kill_tree(spec.name, pid) for pid in self.sandbox.stub_pids(spec.name, model))

    def logs(self, spec: ServerSpec, chars: int = LOG_TAIL_CHARS) -> str:
        return _tail(spec.work_dir / LOG_FILE, chars)

    def trim_log(self, spec: ServerSpec) -> bool:
        """Keep the server's log (which its models write to) under half the sandbox's file-size limit, so that the
        limit never stops the server: past that, only its last MiB is kept. Returns whether it was trimmed."""
        limit = (spec.limits.file_size_mib if spec.limits else 1024) * 1024 * 1024 // 2
        return _trim(spec.work_dir / LOG_FILE, limit)

    def running(self, work_root: Path, node: str) -> list[str]:
        names = []
        for pid_file in sorted(work_root.glob(f"*/{PID_FILE}")):
            folder = pid_file.parent
            lines = _pid_file(folder)
            pid = _read_pid(folder)
            if len(lines) > 1 and lines[1] not in ("", node):
                continue  # another (simulated) node's server on this host
            repo = Path(lines[2]) if len(lines) > 2 and lines[2] else Path("/nonexistent")
            if pid and _alive(pid, repo):
                names.append(folder.name)
        return names


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)


def _ports_in_use(address: str, ports: tuple[int, ...]) -> list[int]:
    busy = []
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError:
                busy.append(port)
    return busy


def _trim(path: Path, limit: int, keep: int = 1024 * 1024) -> bool:
    """Cut a log its writer appends to (O_APPEND) down to its last ``keep`` bytes once it is over ``limit``."""
    try:
        if path.stat().st_size <= limit:
            return False
        with open(path, "r+b") as f:
            f.seek(-min(keep, limit), os.SEEK_END)
            tail = f.read()
            f.seek(0)
            f.write(b"--- earlier log trimmed by Tessera ---\n" + tail)
            f.truncate()
        return True
    except OSError:
        return False


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars * 4))
            return f.read().decode("utf-8", errors="replace")[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# docker
# --------------------------------------------------------------------------------------------------

CONTAINER_REPO = "/models"
CONTAINER_UID = "65534:65534"  # nobody: the image's files are readable, nothing of the node's is owned by it


def bridge_name(spec: ServerSpec) -> str:
    return sb.names(spec.installation, spec.name).host_if.removesuffix("h") + "d"


def network_spec(spec: ServerSpec) -> dict[str, Any]:
    """The keyword arguments of ``docker.from_env().networks.create`` for one slice's own bridge network (no
    other container on it), named so that the node's firewall rules (``sandbox.host_rules``) can name its bridge:
    they drop every connection the container opens, to the node and through it."""
    return {
        "name": sb.names(spec.installation, spec.name).netns,
        "driver": "bridge",
        "options": {"com.docker.network.bridge.name": bridge_name(spec),
                    "com.docker.network.bridge.enable_icc": "false"},
        "labels": {"tessera.server": spec.name, **spec.labels},
    }


def container_spec(spec: ServerSpec, image: str, model_store: Path | None = None) -> dict[str, Any]:
    """The keyword arguments of ``docker.from_env().containers.run`` for one slice's server, with the process
    sandbox's guarantees: NVIDIA's Triton image, only this slice's MIG device (``--gpus device=<uuid>``), only its
    repository mounted read-only (and the MSP's model store, read-only at the same path as on the node: a vLLM
    library model's ``model.json`` names its weights there), its own bridge network (``network_spec``) with its
    three ports published on the node's serving address and nothing else let in, the slice's memory (no swap),
    process and CPU-weight limits, private IPC and a private ``/tmp`` and ``/dev/shm`` of bounded size, a read-only
    root file system, no capabilities, no new privileges, an unprivileged user, no core files and a cap on any
    file's size."""
    limits = spec.limits or sb.Limits(memory_mib=spec.memory_mb or 4096, pids=4096, cpu_weight=100)
    volumes = {str(spec.repo_dir.resolve()): {"bind": CONTAINER_REPO, "mode": "ro"}}
    if model_store is not None:
        store = str(Path(model_store).resolve())
        if store == CONTAINER_REPO or store.startswith(CONTAINER_REPO + "/"):
            raise ValueError(f"the model store {store} would hide the repository mounted at {CONTAINER_REPO}")
        volumes[store] = {"bind": store, "mode": "ro"}
    memory = f"{limits.memory_mib}m"
    fsize = limits.file_size_mib * 1024 * 1024
    return {
        "image": image,
        "name": f"tessera-{spec.name}",
        "command": ["tritonserver", *_container_args(spec)],
        "detach": True,
        # the container sees only the requested devices, renumbered from 0
        "environment": {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(spec.device_uuids)))},
        "device_requests": [{"Driver": "nvidia", "DeviceIDs": spec.device_uuids, "Capabilities": [["gpu"]]}],
        "volumes": volumes,
        "network": network_spec(spec)["name"],
        "ports": {"8000/tcp": (spec.address, spec.http_port), "8001/tcp": (spec.address, spec.grpc_port),
                  "8002/tcp": (spec.address, spec.metrics_port)},
        "labels": {"tessera.server": spec.name, **spec.labels},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.tmpfs_mib}m"},
        "ipc_mode": "private",
        "shm_size": f"{limits.tmpfs_mib}m",
        "mem_limit": memory,
        "memswap_limit": memory,  # the same: no swap
        "pids_limit": limits.pids,
        "cpu_shares": max(2, limits.cpu_weight * 1024 // 100),
        "ulimits": [{"Name": "core", "Soft": 0, "Hard": 0}, {"Name": "fsize", "Soft": fsize, "Hard": fsize}],
        "user": CONTAINER_UID,
        "restart_policy": {"Name": "no"},
    }


def _container_args(spec: ServerSpec) -> list[str]:
    inside = ServerSpec(name=spec.name, repo_dir=Path(CONTAINER_REPO), work_dir=spec.work_dir,
                        device_uuid=spec.device_uuid, address="0.0.0.0", http_port=8000, grpc_port=8001,
                        metrics_port=8002, secret=spec.secret, gpu_metrics=spec.gpu_metrics)
    return inside.server_args(CONTAINER_REPO, None)


class DockerRuntime(ServingRuntime):
    """Triton containers through the Docker Engine API. Each slice's container is on its own bridge network, its
    ports published on the node's serving address; the node's nftables rules (``sandbox.host_rules``, the process
    sandbox's) drop every connection it opens, to the node itself and through it (the worker needs the host's
    network namespace and CAP_NET_ADMIN for them)."""

    kind = "docker"

    def __init__(self, image: str, client: Any = None, model_store: Path | None = None,
                 sandbox: sb.Sandbox | None = None) -> None:
        self.image = image
        self._client = client
        self.model_store = model_store
        self.sandbox = sandbox or sb.Sandbox(installation="local")

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import docker  # only on docker nodes
            except ImportError:
                raise RuntimeFault("the docker runtime needs the docker Python package (pip install docker)") from None
            try:
                # mypy resolves `docker` to the repository's docker/ folder (no __init__), not the docker SDK
                self._client = docker.from_env()  # type: ignore[attr-defined]
            except Exception as exc:  # docker.errors.DockerException and socket errors
                raise RuntimeFault(f"no Docker engine: {exc}") from None
        return self._client

    def isolation(self, spec: ServerSpec) -> str:
        return "container"

    def _container(self, spec: ServerSpec) -> Any:
        found = self.client.containers.list(all=True, filters={"label": f"tessera.server={spec.name}"})
        return found[0] if found else None

    def _network(self, spec: ServerSpec) -> Any:
        want = network_spec(spec)
        found = self.client.networks.list(names=[want["name"]])
        return found[0] if found else self.client.networks.create(**want)

    def start(self, spec: ServerSpec) -> ServerStatus:
        c = self._container(spec)
        if c is not None and c.status == "running":
            return ServerStatus(running=True, container_id=c.id)
        if c is not None:
            c.remove(force=True)
        kwargs = container_spec(spec, self.image, self.model_store)
        from docker.types import DeviceRequest, Ulimit

        kwargs["device_requests"] = [DeviceRequest(driver="nvidia", device_ids=spec.device_uuids,
                                                   capabilities=[["gpu"]])]
        kwargs["ulimits"] = [Ulimit(name=u["Name"], soft=u["Soft"], hard=u["Hard"]) for u in kwargs["ulimits"]]
        try:
            self._network(spec)
        except Exception as exc:  # docker.errors.*
            raise RuntimeFault(f"docker could not make the network of {kwargs['name']}: {exc}") from None
        try:  # before the container runs: it never has a moment without them
            self.sandbox.apply_firewall(spec.name, bridge_name(spec))
        except sb.SandboxFault as exc:
            raise RuntimeFault(f"the firewall of {kwargs['name']} could not be set: {exc}") from None
        try:
            c = self.client.containers.run(**kwargs)
        except Exception as exc:  # docker.errors.* (image missing, device refused...)
            raise RuntimeFault(f"docker could not start {kwargs['name']}: {exc}") from None
        return ServerStatus(running=True, container_id=c.id)

    def status(self, spec: ServerSpec) -> ServerStatus:
        c = self._container(spec)
        if c is None:
            return ServerStatus(running=False)
        c.reload()
        code = c.attrs.get("State", {}).get("ExitCode")
        return ServerStatus(running=c.status == "running", container_id=c.id,
                            exit_code=None if c.status == "running" else code)

    def stop(self, spec: ServerSpec, timeout: float = 20.0) -> int | None:
        c = self._container(spec)
        if c is None:
            return None
        with contextlib.suppress(Exception):
            c.stop(timeout=int(timeout))
        c.reload()
        code = c.attrs.get("State", {}).get("ExitCode")
        c.remove(force=True)
        return code

    def cleanup(self, spec: ServerSpec) -> None:
        try:
            self.sandbox.remove_firewall(spec.name)
            for net in self.client.networks.list(names=[network_spec(spec)["name"]]):
                net.remove()
        except Exception as exc:  # docker.errors.*, SandboxFault
            raise RuntimeFault(f"the network of {spec.name} could not be removed: {exc}") from None

    def logs(self, spec: ServerSpec, chars: int = LOG_TAIL_CHARS) -> str:
        c = self._container(spec)
        return c.logs(tail=200).decode("utf-8", errors="replace")[-chars:] if c is not None else ""

    def running(self, work_root: Path, node: str) -> list[str]:
        return [c.labels["tessera.server"] for c in
                self.client.containers.list(filters={"label": [f"{NODE_LABEL}={node}", "tessera.server"]})]


# --------------------------------------------------------------------------------------------------
# sim
# --------------------------------------------------------------------------------------------------

def _sim_http() -> bool:
    """TESSERA_SIM_TRITON_HTTP: simulated servers also answer Triton's HTTP protocol on their port (the demo and
    the gateway tests: the gateway reaches a simulated slice over HTTP as it reaches a real one)."""
    from django.conf import settings

    return bool(getattr(settings, "TESSERA_SIM_TRITON_HTTP", False))


class SimRuntime(ServingRuntime):
    """Starts and stops the process-wide simulated Triton server of a slice (``triton.SimTritonBackend``):
    a started server answers ready with nothing loaded and requires the per-server secret for its
    repository API, as a real one started by ``ProcessRuntime`` does; a stopped one answers nothing."""

    kind = "sim"

    def __init__(self) -> None:
        self._specs: dict[str, ServerSpec] = {}
        self._pids: dict[str, int] = {}
        self._next_pid = 40000

    @staticmethod
    def _server(spec: ServerSpec):
        from marketplace.hardware import triton

        return triton.get_triton_backend("sim", repo_dir=spec.repo_dir, memory_mb=spec.memory_mb,
                                         tokens_per_s=spec.tokens_per_s)

    def isolation(self, spec: ServerSpec) -> str:
        return "sim"

    def start(self, spec: ServerSpec) -> ServerStatus:
        current = self.status(spec)
        if current.running:
            return current
        spec.repo_dir.mkdir(parents=True, exist_ok=True)
        server = self._server(spec)
        server.boot(restricted=(SECRET_HEADER, spec.secret))
        if _sim_http():
            from marketplace.hardware import sim_http

            sim_http.serve(server, spec.address, spec.http_port, (SECRET_HEADER, spec.secret))
        self._next_pid += 1
        self._specs[spec.name], self._pids[spec.name] = spec, self._next_pid
        return ServerStatus(running=True, pid=self._next_pid)

    def status(self, spec: ServerSpec) -> ServerStatus:
        server = self._server(spec)
        running = server.server_ready and spec.name in self._pids
        return ServerStatus(running=running, pid=self._pids.get(spec.name),
                            exit_code=None if running else server.exit_code)

    def stop(self, spec: ServerSpec, timeout: float = 20.0) -> int | None:
        spec = self._specs.pop(spec.name, spec)  # the one it was started with (memory, rate)
        self._pids.pop(spec.name, None)
        server = self._server(spec)
        if server.server_ready:
            server.shut_down(exit_code=0)
        self._stop_front(spec)
        return 0

    def kill(self, spec: ServerSpec) -> None:
        """What ``kill -9`` does to a real server (tests, the fault drill)."""
        self._server(spec).shut_down(exit_code=-9)
        self._stop_front(spec)

    @staticmethod
    def _stop_front(spec: ServerSpec) -> None:
        if _sim_http():
            from marketplace.hardware import sim_http

            sim_http.stop(spec.address, spec.http_port)

    def logs(self, spec: ServerSpec, chars: int = LOG_TAIL_CHARS) -> str:
        return self._server(spec).log_text()[-chars:]

    def running(self, work_root: Path, node: str) -> list[str]:
        return sorted(n for n, spec in self._specs.items()
                      if spec.labels.get(NODE_LABEL, "") in ("", node) and self._server(spec).server_ready)
