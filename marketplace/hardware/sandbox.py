"""The sandbox of one slice's Triton server (``process`` runtime, worker running as root).

A tenant's model code (a python-backend model, a custom backend) is an untrusted Unix process on the node. It is
contained by the kernel, not by a list of files it should not read:

* **namespaces** (bubblewrap): its own PID namespace (it sees only its own server and stubs, not the worker's or
  another slice's command lines), IPC and UTS namespaces, a mount namespace built from nothing: ``/usr`` (the
  runtime, the python backend's Python) read-only, the staged tritonserver read-only at ``/opt/tessera/triton``,
  its own repository read-only at ``/models``, a private ``/tmp``, ``/dev/shm`` and home on tmpfs (removed with the
  server; their pages count against the slice's memory limit), a minimal ``/dev`` plus the slice's GPU device nodes;
  no ``/sys`` unless a GPU needs it, nothing of ``var/``, other slices or Tessera;
* **its own network namespace** (iproute2): a veth pair with a /30 from ``subnet``; the server listens on the inner
  address; nftables on the host drops every connection the slice opens (to the node's services bound to any
  address, to other slices, through the host) and, inside, every packet that does not answer a connection made to
  it; with no default route nothing outside is even routable. Loopback inside is the namespace's own, so the
  node's 127.0.0.1 services (PostgreSQL, Redis, RabbitMQ, the web app, the gateway) are not there at all. Where
  the node's serving address is not loopback (a gateway on another host), a DNAT rule maps that address's three
  ports to the inner address; nothing else is forwarded in;
* **a cgroup** (v1 or v2) with the slice's memory (swap included), process and CPU-weight limits: exceeding one
  stops this slice's model (the kernel's OOM killer or a failed fork), never the node; the counters say which;
* **its own Unix user** (``tessera-<installation>-<allocation>``, created and removed by Tessera, never an existing
  account), no capabilities, no new privileges (``setpriv``), and rlimits (no core files, a cap on the size of one
  file so its log cannot fill the node's disk).

Pure Python: Django is not imported here; the runtime passes everything in.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tessera.sandbox")
TOOLS = ("bwrap", "ip", "nft", "setpriv", "prlimit")
INNER_TRITON = "/opt/tessera/triton"  # the staged tritonserver, inside
INNER_REPO = "/models"  # the slice's repository, inside
INNER_HOME = "/slice"
TABLE_PREFIX = "tessera_"
HOST_LOCK = Path("/run/tessera-sandbox.lock")
# The kernel's interface-name limit is 15 characters: "ts" + 8 hex + "h"/"p".
IFNAME_LEN = 15


class SandboxFault(Exception):
    """The sandbox could not be set up or taken down; ``str()`` is the operator-facing reason."""


def cpu_list(cpus: tuple[int, ...]) -> str:
    """CPUs in the kernel's list format (cpuset.cpus, taskset -c): "0-51" or "0-3,8"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class Limits:
    """What one slice may use of the node's host."""

    memory_mib: int
    pids: int
    cpu_weight: int  # 1..10000, cgroup v2's cpu.weight scale (100 = one default share)
    file_size_mib: int = 1024  # RLIMIT_FSIZE: no single file (its log included) grows past this
    tmpfs_mib: int = 512  # each of /tmp, /dev/shm and home (counted in memory_mib too)
    cpus: tuple[int, ...] = ()  # cgroup v2 cpuset.cpus: the CPUs the server may run on (empty: any)

    def __post_init__(self) -> None:
        if self.memory_mib < 64 or self.pids < 16 or not 1 <= self.cpu_weight <= 10000:
            raise ValueError(f"sandbox limits out of range: {self}")


@dataclass(frozen=True)
class Network:
    host_ip: str  # the host's end of the veth pair
    inner_ip: str  # where the server listens
    client_address: str  # where the gateway and the worker connect: the node address (DNAT) or inner_ip


@dataclass
class Census:
    """What runs in one sandbox and which limits it hit (counters since the sandbox was made)."""

    oom_kills: int = 0
    pid_limit_hits: int = 0
    memory_bytes: int = 0
    tasks: int = 0
    # per model: the task count of each python-backend stub's process tree (instance name -> tasks)
    stubs: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Names:
    netns: str
    host_if: str
    peer_if: str
    table: str
    cgroup: str
    user: str


def names(installation: str, server: str) -> Names:
    """Every kernel name of one server's sandbox: unique per installation and server, within kernel limits."""
    alloc = server.removeprefix("allocation-")
    digest = hashlib.sha256(f"{installation}/{server}".encode()).hexdigest()[:8]
    base = f"tessera-{installation}-{alloc}"
    return Names(netns=base, host_if=f"ts{digest}h", peer_if=f"ts{digest}p",
                 table=f"{TABLE_PREFIX}{installation}_{digest}", cgroup=f"{installation}-{server}",
                 user=base[:32])


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _run(args: list[str], *, stdin: str | None = None, check: bool = True, timeout: float = 30) -> str:
    try:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxFault(f"{args[0]} failed: {exc}") from None
    if check and done.returncode != 0:
        raise SandboxFault(f"{' '.join(args[:4])} exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[:400]}")
    return done.stdout


# --------------------------------------------------------------------------------------------------
# cgroups: v2 (unified, production hosts) and v1 (memory, pids and cpu hierarchies: these machines)
# --------------------------------------------------------------------------------------------------

class Cgroups:
    """One server's cgroup(s) under ``root`` (``/sys/fs/cgroup``), in a ``parent`` group of Tessera's own."""

    def __init__(self, root: Path, parent: str, name: str) -> None:
        self.root, self.parent, self.name = root, parent, name
        self.v2 = (root / "cgroup.controllers").is_file()

    @classmethod
    def supported(cls, root: Path) -> str | None:
        """None when usable, else why not."""
        if (root / "cgroup.controllers").is_file():
            have = set((root / "cgroup.controllers").read_text().split())
            absent = sorted({"memory", "pids", "cpu"} - have)
            return f"cgroup v2 lacks the controller(s) {', '.join(absent)}" if absent else None
        lacking = [c for c in ("memory", "pids", "cpu") if not (root / c / "cgroup.procs").is_file()]
        return f"no cgroup v1 hierarchy for {', '.join(lacking)} under {root}" if lacking else None

    def dirs(self) -> list[Path]:
        if self.v2:
            return [self.root / self.parent / self.name]
        return [self.root / c / self.parent / self.name for c in ("memory", "pids", "cpu")]

    def _dir(self, controller: str) -> Path:
        return self.root / self.parent / self.name if self.v2 else self.root / controller / self.parent / self.name

    def create(self, limits: Limits) -> None:
        memory = limits.memory_mib * 1024 * 1024
        if self.v2:
            parent = self.root / self.parent
            parent.mkdir(exist_ok=True)
            control = parent / "cgroup.subtree_control"
            enabled = set(control.read_text().split()) if control.is_file() else set()
            for c in ("memory", "pids", "cpu", *(("cpuset",) if limits.cpus else ())):
                if c not in enabled:
                    control.write_text(f"+{c}")
        for d in self.dirs():
            d.mkdir(parents=True, exist_ok=True)
        if self.v2:
            d = self._dir("memory")
            self._write(d / "memory.max", memory)
            self._write(d / "memory.swap.max", 0, optional=True)
            self._write(d / "pids.max", limits.pids)
            self._write(d / "cpu.weight", limits.cpu_weight)
            if limits.cpus:  # a GPU group's NUMA node (cgroup v2 only; v1 keeps the CPU weight alone)
                self._write_text(d / "cpuset.cpus", cpu_list(limits.cpus))
        else:
            mem = self._dir("memory")
            self._write(mem / "memory.limit_in_bytes", memory)
            self._write(mem / "memory.memsw.limit_in_bytes", memory, optional=True)  # no swap (when accounted)
            self._write(self._dir("pids") / "pids.max", limits.pids)
            self._write(self._dir("cpu") / "cpu.shares", max(2, limits.cpu_weight * 1024 // 100))

    @staticmethod
    def _write_text(path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as exc:
            raise SandboxFault(f"could not set {path}: {exc}") from None

    @staticmethod
    def _write(path: Path, value: int, *, optional: bool = False) -> None:
        try:
            path.write_text(str(value))
        except OSError as exc:
            if not (optional and not path.exists()):
                raise SandboxFault(f"could not set {path}: {exc}") from None

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs()]

    def pids(self) -> list[int]:
        out: list[int] = []
        with contextlib.suppress(OSError, ValueError):
            out = [int(x) for x in (self._dir("pids") / "cgroup.procs").read_text().split()]
        return out

    @staticmethod
    def _keyed(path: Path) -> dict[str, int]:
        values: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                    values[parts[0]] = int(parts[1])
        return values

    def counters(self) -> tuple[int, int, int, int]:
        """(OOM kills, failed forks at the process limit, memory in use in bytes, tasks)."""
        mem, pids = self._dir("memory"), self._dir("pids")
        if self.v2:
            oom = self._keyed(mem / "memory.events").get("oom_kill", 0)
            usage_file = mem / "memory.current"
        else:
            oom = self._keyed(mem / "memory.oom_control").get("oom_kill", 0)
            usage_file = mem / "memory.usage_in_bytes"
        hits = self._keyed(pids / "pids.events").get("max", 0)
        usage = tasks = 0
        with contextlib.suppress(OSError, ValueError):
            usage = int(usage_file.read_text())
        with contextlib.suppress(OSError, ValueError):
            tasks = int((pids / "pids.current").read_text())
        return oom, hits, usage, tasks

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL everything in it (v2: cgroup.kill; v1: until no process is left, since a fork may race)."""
        kill_file = self._dir("pids") / "cgroup.kill"
        if self.v2 and kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        raise SandboxFault(f"processes {self.pids()[:10]} of cgroup {self.name} survived SIGKILL for {timeout:.0f} s")

    def remove(self) -> None:
        for d in self.dirs():
            for _ in range(50):  # rmdir fails while the last killed task is still being reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                raise SandboxFault(f"could not remove cgroup {d}")


# --------------------------------------------------------------------------------------------------
# the sandbox
# --------------------------------------------------------------------------------------------------

def host_rules(table: str, host_if: str, node_address: str | None = None, inner: str = "",
               ports: Iterable[int] = ()) -> str:
    """The node's nftables rules for one slice's interface (a sandbox's veth, a container's bridge): nothing the
    slice opens gets anywhere (not the node's own services on any address, not through the node to other slices
    or outside), only what answers a connection made to it; with ``node_address``, its ports there are DNATed to
    ``inner`` (a gateway on another host) and nothing else is forwarded in."""
    h = host_if
    rules = f"""
table inet {table} {{
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname "{h}" ct state established,related accept
    iifname "{h}" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{h}" ct state established,related accept
    iifname "{h}" drop
    oifname "{h}" ct status dnat accept
    oifname "{h}" ct state established,related accept
    oifname "{h}" drop
  }}
}}
"""
    if node_address:
        dports = ", ".join(str(p) for p in ports)
        rules += f"""
table ip {table} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    ip daddr {node_address} tcp dport {{ {dports} }} dnat to {inner}
  }}
  chain output {{
    type nat hook output priority -100; policy accept;
    ip daddr {node_address} tcp dport {{ {dports} }} dnat to {inner}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{h}" ct status dnat masquerade
  }}
}}
"""
    return rules


def _drop_tables(table: str) -> str:
    """nft commands that remove the slice's tables whether they exist or not ("add" of an existing table is a
    no-op, so the "delete" never fails)."""
    return "".join(f"add table {family} {table}\ndelete table {family} {table}\n" for family in ("inet", "ip"))


NFT_INNER = """
table inet sandbox {
  chain output {
    type filter hook output priority 0; policy drop;
    oifname "lo" accept
    ct state established,related accept
  }
}
"""


# Refused inside every sandbox (seccomp, EPERM): new namespaces (a user namespace would give the model
# capabilities over new mount and network namespaces of its own: no way out, but kernel attack surface Triton
# never needs), mounts, keyrings, BPF, userfaultfd, perf events, io_uring, ptrace, module and kexec loading;
# clone3 answers ENOSYS so that the C library falls back to clone, whose namespace flags are checked.
DENIED_SYSCALLS = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fspick",
                   "move_mount", "open_tree", "keyctl", "add_key", "request_key", "bpf", "userfaultfd",
                   "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace",
                   "process_vm_readv", "process_vm_writev", "kexec_load", "kexec_file_load", "init_module",
                   "finit_module", "delete_module", "acct", "swapon", "swapoff", "reboot", "open_by_handle_at",
                   "name_to_handle_at", "iopl", "ioperm", "quotactl", "syslog", "lookup_dcookie")
CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def seccomp_filter(path: Path) -> Path:
    """Write the sandbox's seccomp program (BPF, for bubblewrap's ``--seccomp``) to ``path`` once."""
    if path.is_file():
        return path
    import errno

    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        with contextlib.suppress(RuntimeError, ValueError):  # a name this kernel's headers do not know
            f.add_rule(sc.ERRNO(errno.EPERM), name)
    for flag in (1 << b for b in range(32) if CLONE_NAMESPACES >> b & 1):  # any namespace flag: one rule each
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    with open(tmp, "wb") as out:
        f.export_bpf(out)
    tmp.chmod(0o644)
    os.replace(tmp, path)
    return path


class Sandbox:
    """Makes, runs and takes down the sandboxes of one installation's servers on this host."""

    def __init__(self, *, installation: str, subnet: str = "10.213.0.0/16", cgroup_root: Path = Path("/sys/fs/cgroup"),
                 cgroup_parent: str = "tessera", state_dir: Path | None = None) -> None:
        self.installation = installation
        self.subnet = ipaddress.IPv4Network(subnet)
        if self.subnet.prefixlen > 30:
            raise ValueError(f"the sandbox subnet {subnet} is too small for one /30")
        self.cgroup_root = cgroup_root
        self.cgroup_parent = cgroup_parent
        self.state_dir = state_dir  # where its seccomp program is kept (default /run)

    def names(self, server: str) -> Names:
        return names(self.installation, server)

    def cgroups(self, server: str) -> Cgroups:
        return Cgroups(self.cgroup_root, self.cgroup_parent, self.names(server).cgroup)

    def unavailable(self) -> str | None:
        """Why this host cannot run sandboxes (None when it can)."""
        if os.geteuid() != 0:
            return "the worker is not root"
        lacking = missing_tools()
        if lacking:
            return (f"missing {', '.join(lacking)} (Debian: apt-get install bubblewrap iproute2 nftables "
                    f"util-linux)")
        return Cgroups.supported(self.cgroup_root)

    # -- network ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        """One lock for the whole host: the /30s are the host's, whatever installation or worker takes one."""
        with open(HOST_LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _taken(self) -> set[ipaddress.IPv4Network]:
        """The /30s of the subnet some interface on the host already holds (the kernel is the record)."""
        out = _run(["ip", "-j", "-4", "addr", "show"])
        taken = set()
        for link in json.loads(out or "[]"):
            for a in link.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    net = ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}").network
                    if net.overlaps(self.subnet):
                        taken.add(ipaddress.IPv4Network(f"{a['local']}/30", strict=False))
        return taken

    def _netns_exists(self, n: Names) -> bool:
        return Path("/run/netns", n.netns).exists()

    def make_network(self, server: str, ports: tuple[int, ...], node_address: str) -> Network:
        """The server's network namespace, veth pair, addresses and firewall rules (anything left of an
        earlier one of the same server is taken down first)."""
        n = self.names(server)
        remote = None if ipaddress.ip_address(node_address).is_loopback else node_address
        if remote is not None and ipaddress.ip_address(remote).version != 4:
            raise SandboxFault(f"a sandboxed server is reached through an IPv4 serving address, not {remote}")
        with self._locked():
            if self._netns_exists(n) or Path("/sys/class/net", n.host_if).exists():
                self.remove_network(server)  # left by a crash
            taken = self._taken()
            block = next((b for b in self.subnet.subnets(new_prefix=30) if b not in taken), None)
            if block is None:
                raise SandboxFault(f"no free /30 left in the sandbox subnet {self.subnet}")
            host_ip, inner_ip = (str(h) for h in list(block.hosts())[:2])
            try:  # five commands in all (each one costs a process start, nft's the most)
                _run(["ip", "-batch", "-"], stdin=f"netns add {n.netns}\n"
                     f"link add {n.host_if} type veth peer name {n.peer_if} netns {n.netns}\n"
                     f"addr add {host_ip}/30 dev {n.host_if}\nlink set {n.host_if} up\n")
                _run(["ip", "-n", n.netns, "-batch", "-"], stdin=f"addr add {inner_ip}/30 dev {n.peer_if}\n"
                     f"link set {n.peer_if} up\nlink set lo up\n")
                self.apply_firewall(server, n.host_if, node_address=remote, inner=inner_ip, ports=ports)
                _run(["ip", "netns", "exec", n.netns, "nft", "-f", "-"], stdin=NFT_INNER)
            except SandboxFault:
                self.remove_network(server)
                raise
        if remote is not None and Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "1":
            # this host's own clients reach it through the output DNAT; other hosts need forwarding on
            log.warning("sandboxed server reachable from this host only", extra={
                "server": server, "address": remote, "why": "net.ipv4.ip_forward is 0: gateways on other hosts "
                                                               "cannot reach the slice through the DNAT rule"})
        return Network(host_ip=host_ip, inner_ip=inner_ip, client_address=remote or inner_ip)

    def inner_ip(self, server: str) -> str | None:
        n = self.names(server)
        if not self._netns_exists(n):
            return None
        out = _run(["ip", "-n", n.netns, "-j", "-4", "addr", "show", "dev", n.peer_if], check=False)
        with contextlib.suppress(ValueError, IndexError, KeyError):
            return json.loads(out)[0]["addr_info"][0]["local"]
        return None

    def apply_firewall(self, server: str, host_if: str, *, node_address: str | None = None, inner: str = "",
                       ports: Iterable[int] = ()) -> None:
        """The node's rules for the slice's interface (``host_rules``), replacing any earlier ones in the same
        transaction (nft applies a file atomically)."""
        table = self.names(server).table
        _run(["nft", "-f", "-"], stdin=_drop_tables(table) + host_rules(table, host_if, node_address, inner, ports))

    def remove_firewall(self, server: str) -> None:
        _run(["nft", "-f", "-"], stdin=_drop_tables(self.names(server).table))

    def remove_network(self, server: str) -> None:
        n = self.names(server)
        self.remove_firewall(server)
        if Path("/sys/class/net", n.host_if).exists():
            _run(["ip", "link", "delete", n.host_if], check=False)  # takes its peer with it
        if self._netns_exists(n):
            _run(["ip", "netns", "delete", n.netns])

    # -- processes -------------------------------------------------------------------------------
    def make_cgroups(self, server: str, limits: Limits) -> Cgroups:
        cg = self.cgroups(server)
        if cg.pids():
            cg.kill()
        cg.create(limits)
        return cg

    def seccomp(self) -> Path:
        return seccomp_filter((self.state_dir or Path("/run")) / "tessera-sandbox.bpf")

    def command(self, server: str, *, uid: int, gid: int, argv: list[str], env: dict[str, str],
                repo: Path, runtime: Path, binds: Iterable[Path] = (), etc: Path | None = None,
                devices: Iterable[str] = (), limits: Limits, seccomp_fd: int | None = None) -> list[str]:
        """The command line that joins the cgroups, enters the network namespace, builds the mount namespace
        and drops to the slice's user: ``sh`` (as root) -> ``ip netns exec`` -> ``bwrap`` -> ``prlimit`` ->
        ``setpriv`` -> ``argv`` (paths in ``argv`` are the inner ones)."""
        n = self.names(server)
        cg = self.cgroups(server)
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 111; shift; done; shift; exec "$@"'
        args = ["/bin/sh", "-c", join, "sh", *map(str, cg.procs_files()), "--",
                "ip", "netns", "exec", n.netns, "bwrap",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--new-session",
                "--hostname", "slice"]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        made: set[str] = {"/"}

        def parents(path: str) -> list[str]:
            out = []
            for p in reversed(Path(path).parents):
                s = str(p)
                if s not in made:
                    made.add(s)
                    out += ["--perms", "0755", "--dir", s]
            return out

        for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            p = Path(top)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), top]
            elif p.is_dir():
                args += ["--ro-bind", top, top]
        args += ["--ro-bind", "/usr", "/usr"]
        made.add("/usr")
        args += parents("/etc/x")
        for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/alternatives", "/etc/localtime"):
            if os.path.exists(f):
                args += ["--ro-bind", f, f]
        if etc is not None:  # passwd and group naming only root and the slice's user
            for f in ("passwd", "group"):
                args += ["--ro-bind", str(etc / f), f"/etc/{f}"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        size = str(limits.tmpfs_mib * 1024 * 1024)
        for t in ("/tmp", "/dev/shm"):
            args += ["--perms", "1777", "--size", size, "--tmpfs", t]
        made.update(("/proc", "/dev", "/tmp", "/dev/shm"))
        devices = [d for d in devices if os.path.exists(d)]
        for d in devices:
            args += [*parents(d), "--dev-bind", d, d]
        if devices:  # CUDA reads the GPU's PCI and NUMA details there
            args += ["--ro-bind", "/sys", "/sys"]
        for path, inner in ((runtime, INNER_TRITON), (repo, INNER_REPO)):
            args += [*parents(inner), "--ro-bind", str(path), inner]
            made.add(inner)
        for b in binds:
            s = str(b)
            if s in made or s.startswith("/usr/") or not b.exists():
                continue
            args += [*parents(s), "--ro-bind", s, s]
            made.add(s)
        args += [*parents(INNER_HOME), "--perms", "1777", "--size", size, "--tmpfs", INNER_HOME,
                 "--chdir", INNER_HOME, "--clearenv"]
        for k, v in env.items():
            args += ["--setenv", k, v]
        fsize = str(limits.file_size_mib * 1024 * 1024)
        args += ["--", "prlimit", "--core=0", f"--fsize={fsize}", "--",
                 "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs", "--", *argv]
        return args

    def census(self, server: str) -> Census:
        cg = self.cgroups(server)
        oom, hits, usage, tasks = cg.counters()
        found = Census(oom_kills=oom, pid_limit_hits=hits, memory_bytes=usage, tasks=tasks)
        pids = cg.pids()
        children: dict[int, list[int]] = {}
        stubs: list[tuple[int, str, str]] = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(pid)
            if argv and argv[0].endswith(b"/triton_python_backend_stub") and len(argv) > 8:
                model = _model_of(argv[1].decode(errors="replace"))
                stubs.append((pid, model, argv[8].decode(errors="replace")))
        for pid, model, instance in stubs:
            found.stubs.setdefault(model, {})[instance] = _tree_tasks(pid, children)
        return found

    def kill_tree(self, server: str, root_pid: int) -> int:
        """SIGKILL one process of the sandbox and every descendant (a model's stub and what it forked)."""
        cg_pids = set(self.cgroups(server).pids())
        if root_pid not in cg_pids:
            return 0
        children: dict[int, list[int]] = {}
        for pid in cg_pids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(pid)
        doomed, todo = [], [root_pid]
        while todo:
            pid = todo.pop()
            doomed.append(pid)
            todo += children.get(pid, [])
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(doomed)

    def stub_pids(self, server: str, model: str) -> list[int]:
        out = []
        for pid in self.cgroups(server).pids():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"/triton_python_backend_stub") and len(argv) > 1 \
                        and _model_of(argv[1].decode(errors="replace")) == model:
                    out.append(pid)
        return out

    def server_pid(self, server: str) -> int | None:
        """The host pid of the tritonserver process in the sandbox."""
        for pid in self.cgroups(server).pids():
            with contextlib.suppress(OSError):
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                if argv0.endswith(b"/tritonserver"):
                    return pid
        return None

    def kill(self, server: str) -> None:
        self.cgroups(server).kill()

    def remove(self, server: str) -> None:
        """Kill what is left, remove the cgroups, the firewall rules, the veth pair and the namespace."""
        cg = self.cgroups(server)
        cg.kill()
        cg.remove()
        with self._locked():
            self.remove_network(server)


def _model_of(model_py: str) -> str:
    """``/models/<name>/<version>/model.py`` -> name; a model loaded from elsewhere (an override in a temp
    folder) -> its path, so that it never passes for a deployed one."""
    parts = Path(model_py).parts
    if len(parts) >= 4 and parts[:2] == ("/", INNER_REPO.strip("/")):
        return parts[2]
    return model_py


def _tree_tasks(pid: int, children: dict[int, list[int]]) -> int:
    """Threads of ``pid`` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(next(line.split()[1] for line in Path(f"/proc/{p}/status").read_text().splitlines()
                              if line.startswith("Threads:")))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
        todo += children.get(p, [])
    return total


def passwd_files(folder: Path, user: str, uid: int, gid: int) -> Path:
    """``passwd`` and ``group`` for inside the sandbox: only root and the slice's user (mode 0644, root's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "passwd").write_text(f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
                                   f"{user}:x:{uid}:{gid}:slice:{INNER_HOME}:/usr/sbin/nologin\n")
    (folder / "group").write_text(f"root:x:0:\n{user}:x:{gid}:\n")
    for f in ("passwd", "group"):
        (folder / f).chmod(0o644)
    return folder
