"""A hostile tenant on a shared node, on REAL tritonserver processes in their sandboxes (root, as CI runs).

Tenant B deploys a python model that acts as any Unix process would: it reads what it can, lists processes and
shared memory, connects wherever it can, ptraces, makes user namespaces, writes outside its repository, loads a
model of its own into its server with the secret it finds there, forks and allocates without end. Tenant A's
honest model shares the node. Every probe must come back empty-handed and A must keep answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from marketplace.hardware import runtime as rt
from marketplace.hardware import sandbox as sb
from marketplace.models import Allocation, DriftEvent, ModelDeployment, TritonServer
from marketplace.services import deployments, orders, provisioning, reconcile, serving
from telemetry.models import TritonServedHourly
from tests.serving_fixtures import ISOLATED, NOT_ISOLATED_WHY, deploy_ready, order_active, tenant_owner
from tests.triton_server import tritonserver_available

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db,
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}"),
              pytest.mark.skipif(not ISOLATED, reason=NOT_ISOLATED_WHY)]
D = ModelDeployment.State

HOSTILE_PY = r'''
import ctypes
import json
import os
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import triton_python_backend_utils as pb_utils

libc = ctypes.CDLL(None, use_errno=True)


def denied(exc):
    return "DENIED " + type(exc).__name__ + " " + str(exc)[:120]


def own_server():
    """This sandbox's tritonserver: its address, port and the secret in its command line."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("/tritonserver"):
            opts = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
            header, secret = opts["http-restricted-api"].split(":", 1)[1].split("=", 1)
            return opts["http-address"], opts["http-port"], header, secret
    raise RuntimeError("no tritonserver in /proc")


def run(cmd):
    op, _, arg = cmd.partition(":")
    if op == "read":
        try:
            with open(arg, "rb") as f:
                return "READ " + f.read(300).decode("utf-8", "replace")
        except Exception as exc:
            return denied(exc)
    if op == "ls":
        try:
            return "LIST " + json.dumps(sorted(os.listdir(arg)))
        except Exception as exc:
            return denied(exc)
    if op == "write":
        try:
            with open(arg, "w") as f:
                f.write("planted")
            return "WROTE"
        except Exception as exc:
            return denied(exc)
    if op == "procs":
        out = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    out[pid] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
                except OSError:
                    pass
        return "PROCS " + json.dumps(out)
    if op == "tcp":
        host, port = arg.rsplit(":", 1)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
            return "CONNECTED"
        except Exception as exc:
            return denied(exc)
    if op in ("abstract", "unix"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect(("\0" + arg) if op == "abstract" else arg)
            return "CONNECTED"
        except Exception as exc:
            return denied(exc)
        finally:
            s.close()
    if op == "ptrace":
        rc = libc.ptrace(16, int(arg), None, None)  # PTRACE_ATTACH
        return "ATTACHED" if rc == 0 else "DENIED errno " + str(ctypes.get_errno())
    if op == "userns":  # unshare(2) and clone(2) with CLONE_NEWUSER | CLONE_NEWNET
        rc = libc.unshare(0x10000000)
        if rc == 0:
            return "UNSHARED"
        first = ctypes.get_errno()
        stack = ctypes.create_string_buffer(65536)
        child = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda _: 0)
        top = ctypes.c_void_p(ctypes.addressof(stack) + 65536)
        pid = libc.clone(child, top, 0x10000000 | 0x40000000 | 17, None)  # | SIGCHLD
        if pid > 0:
            os.waitpid(pid, 0)
            return "CLONED"
        return "DENIED errno " + str(first) + " " + str(ctypes.get_errno())
    if op == "syscall":  # io_uring_setup (425), bpf (321), keyctl (250), perf_event_open (298), mount (165)
        rc = libc.syscall(int(arg), 0, 0, 0, 0, 0)
        return "ALLOWED" if rc >= 0 else "DENIED errno " + str(ctypes.get_errno())
    if op == "env":
        return "ENV " + " ".join(sorted(os.environ))
    if op == "status":  # its credentials as the kernel sees them
        keep = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
        return "\n".join(line for line in open("/proc/self/status").read().splitlines() if line.split(":")[0] in keep)
    if op == "inject":  # a model of its own, loaded into its own server with the secret found in /proc
        host, port, header, secret = own_server()
        config = {"name": arg, "backend": "python", "max_batch_size": 0,
                  "input": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]}],
                  "output": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
                  "instance_group": [{"kind": "KIND_CPU", "count": 1}]}
        import base64
        code = open(__file__, "rb").read()
        body = json.dumps({"parameters": {"config": json.dumps(config),
                                          "file:1/model.py": base64.b64encode(code).decode()}}).encode()
        req = urllib.request.Request(f"http://{host}:{port}/v2/repository/models/{arg}/load", data=body,
                                     headers={header: secret, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return "LOADED " + str(r.status)
        except urllib.error.HTTPError as exc:
            return "DENIED " + str(exc.code) + " " + exc.read(200).decode(errors="replace")
        except Exception as exc:
            return denied(exc)
    if op == "fork":
        n = 0
        try:
            while True:
                pid = os.fork()
                if pid == 0:
                    time.sleep(600)
                    os._exit(0)
                n += 1
        except OSError as exc:
            return f"FORKED {n} then {exc}"
    if op == "hog":
        b = bytearray(int(arg) * 1024 * 1024)
        for i in range(0, len(b), 4096):
            b[i] = 1
        return "SURVIVED"
    return "UNKNOWN " + cmd


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            cmd = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0].decode()
            text = run(cmd)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text", np.array([text.encode()], dtype=np.object_)),
                pb_utils.Tensor("input_tokens", np.array([1], dtype=np.int32)),
                pb_utils.Tensor("output_tokens", np.array([1], dtype=np.int32))]))
        return out
'''
HOSTILE_SPEC = {
    "backend": "python", "max_batch_size": 0, "memory_mb": 64,
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]}],
    "outputs": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]},
                {"name": "input_tokens", "data_type": "TYPE_INT32", "dims": [1]},
                {"name": "output_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": {"count": 1, "kind": "KIND_CPU"},
    "files": {"model.py": HOSTILE_PY},
}
FAILING_SPEC = {**HOSTILE_SPEC, "files": {"model.py": "class TritonPythonModel:\n"
                                                      "    def initialize(self, args):\n"
                                                      "        raise RuntimeError('this model never loads')\n"}}


@pytest.fixture
def node_pair(real_serving, tiers):
    """Tenant A's honest model and tenant B's hostile one, on two slices of the same node."""
    a_owner, b_owner = tenant_owner(), tenant_owner()
    victim = order_active(a_owner, tiers["1g"])
    deploy_ready(a_owner, victim, "honest", template="tiny-gen")
    attacker = order_active(b_owner, tiers["1g"])
    deploy_ready(b_owner, attacker, "probe", spec=HOSTILE_SPEC)
    return {"victim": victim, "attacker": attacker, "a": a_owner, "b": b_owner}


def probe(allocation: Allocation, cmd: str, model: str = "probe") -> str:
    return deployments.backend_for(allocation).infer_text(model, cmd)["text"]


def honest_answers(victim: Allocation) -> bool:
    out = deployments.backend_for(victim).infer_text("honest", "still here", max_tokens=2)
    return out["output_tokens"] == 2


def _server(a: Allocation) -> TritonServer:
    return TritonServer.objects.get(allocation=a)


def test_hostile_model_reads_nothing_of_other_slices_the_node_or_tessera(node_pair):
    victim, attacker = node_pair["victim"], node_pair["attacker"]
    vs, mine = _server(victim), _server(attacker)
    assert vs.isolation == TritonServer.Isolation.SANDBOX and mine.isolation == TritonServer.Isolation.SANDBOX
    # its own files, where its sandbox puts them: yes
    assert probe(attacker, f"read:{sb.INNER_REPO}/probe/config.pbtxt").startswith("READ ")
    # the node's files: the other slice's repository and log, the worker's environment, Tessera's var/ (database,
    # keys, uploads), the node's users
    for path in [deployments.repo_dir(victim) / "honest" / "config.pbtxt", serving.work_dir(victim.pk) / rt.LOG_FILE,
                 serving.work_dir(attacker.pk) / rt.LOG_FILE, f"/proc/{os.getpid()}/environ",
                 f"/proc/{os.getpid()}/cmdline", "/etc/shadow", Path(django_settings.VAR_DIR) / "secret_key",
                 str(django_settings.DATABASES["default"]["NAME"])]:
        assert probe(attacker, f"read:{path}").startswith("DENIED"), path
    for folder in (django_settings.VAR_DIR, django_settings.TESSERA_UPLOAD_ROOT,
                   django_settings.TESSERA_TRITON_REPO_ROOT,
                   serving.work_root(), "/sys", "/run", "/var/run/postgresql", "/root"):
        answer = probe(attacker, f"ls:{folder}")
        assert answer.startswith("DENIED"), (folder, answer)
    assert probe(attacker, f"ls:{sb.INNER_HOME}") == "LIST []"  # its own home: an empty tmpfs
    passwd = probe(attacker, "read:/etc/passwd")
    assert passwd.startswith("READ ") and vs.unix_user not in passwd and "postgres" not in passwd
    # processes: its own server and stubs only; no other slice's secret, no worker command line
    procs = json.loads(probe(attacker, "procs").removeprefix("PROCS "))
    assert len(procs) <= 6, procs
    everything = " ".join(procs.values())
    assert serving.secret_for(vs) not in everything and "celery" not in everything and "pytest" not in everything
    assert serving.secret_for(mine) in everything  # its own server's: harmless, it reaches nothing else
    # shared memory: its own python backend regions only, on its own tmpfs
    mine_shm = json.loads(probe(attacker, "ls:/dev/shm").removeprefix("LIST "))
    assert mine_shm and all(n.startswith("triton_python_backend_shm_region_") for n in mine_shm)
    victim_stub = serving.runtime().sandbox.stub_pids(vs.name, "honest")
    assert victim_stub, "the honest model's stub runs"
    victim_regions = [a for a in Path(f"/proc/{victim_stub[0]}/cmdline").read_bytes().decode().split("\0")
                      if a.startswith("triton_python_backend_shm_region_")]
    assert victim_regions and not set(victim_regions) & set(mine_shm)
    assert probe(attacker, f"read:/dev/shm/{victim_regions[0]}").startswith("DENIED")
    env = probe(attacker, "env").split()[1:]
    assert not {"DATABASE_URL", "SECRET_KEY", "REDIS_URL", "CELERY_BROKER_URL", "TESSERA_TEST_CANARY"} & set(env)
    assert honest_answers(victim)


def test_hostile_model_reaches_nothing_on_the_network(node_pair, tmp_path):
    victim, attacker = node_pair["victim"], node_pair["attacker"]
    vs = _server(victim)
    host_side = str(next(iter(sb.ipaddress.IPv4Network(f"{_server(attacker).address}/30", strict=False).hosts())))
    # a service of the node's listening on every address, and an abstract Unix socket in the node's namespace
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    abstract = f"tessera-test-{uuid.uuid4().hex}"
    unix_abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_abstract.bind("\0" + abstract)
    unix_abstract.listen(1)
    unix_path = tmp_path / "node.sock"
    unix_fs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_fs.bind(str(unix_path))
    unix_fs.listen(1)
    unix_path.chmod(0o777)
    tmp_path.chmod(0o755)
    try:
        targets = ["127.0.0.1:5432", "127.0.0.1:6379", "127.0.0.1:5672", "127.0.0.1:8000", "127.0.0.1:8001",
                   f"{host_side}:5432", f"{host_side}:6379", f"{host_side}:{port}", f"127.0.0.1:{port}",
                   f"{vs.address}:{vs.http_port}", f"{vs.address}:{vs.metrics_port}", "8.8.8.8:53",
                   "[::1]:6379", f"[::1]:{port}"]
        for addr in _node_addresses():
            targets += [f"{addr}:{port}", f"{addr}:6379", f"{addr}:5432"]
        for target in targets:
            assert probe(attacker, f"tcp:{target}").startswith("DENIED"), target
        assert probe(attacker, f"abstract:{abstract}").startswith("DENIED")
        assert probe(attacker, f"unix:{unix_path}").startswith("DENIED")
        for sock in ("/var/run/postgresql/.s.PGSQL.5432", "/var/run/redis/redis-server.sock"):
            assert probe(attacker, f"unix:{sock}").startswith("DENIED")
        # and the node (the gateway's path) still reaches both servers
        assert honest_answers(victim)
        assert probe(attacker, "env").startswith("ENV")
    finally:
        for s in (listener, unix_abstract, unix_fs):
            s.close()


def _node_addresses() -> list[str]:
    out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])
            if not a["local"].startswith("127.") and not link["ifname"].startswith("ts")]


def test_hostile_model_writes_nowhere_but_its_private_tmp_and_cannot_gain_privileges(node_pair):
    victim, attacker = node_pair["victim"], node_pair["attacker"]
    for path in [f"{sb.INNER_REPO}/probe/planted", f"{sb.INNER_REPO}/planted", f"{sb.INNER_TRITON}/planted",
                 "/usr/planted", "/etc/planted", "/planted", str(deployments.repo_dir(victim) / "planted"),
                 str(serving.work_dir(attacker.pk) / "planted")]:
        assert probe(attacker, f"write:{path}").startswith("DENIED"), path
    assert probe(attacker, "write:/tmp/mine") == "WROTE"
    assert not (deployments.repo_dir(attacker) / "probe" / "planted").exists()
    assert probe(attacker, "ptrace:1").startswith("DENIED")  # its sandbox's init (root)
    procs = json.loads(probe(attacker, "procs").removeprefix("PROCS "))
    assert all(int(pid) < 100 for pid in procs)  # its own PID namespace: no host pid to aim at
    # no new namespaces (user, network) and none of the syscalls a sandbox has no use for (seccomp: EPERM = 1)
    assert probe(attacker, "userns") == "DENIED errno 1 1"
    for number in (425, 321, 250, 298, 165):
        assert probe(attacker, f"syscall:{number}") == "DENIED errno 1", number
    # its own user, no capabilities (not even in its bounding set), no new privileges
    status = dict(line.split(":\t", 1) for line in probe(attacker, "status").splitlines())
    uid = pwd.getpwnam(_server(attacker).unix_user).pw_uid
    assert status["Uid"].split()[0] == str(uid) and status["Groups"].strip() == ""
    assert {status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0000000000000000"}
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_model_loaded_behind_tesseras_back_is_found_and_unloaded(node_pair):
    attacker = node_pair["attacker"]
    answer = probe(attacker, "inject:smuggled")
    assert answer.startswith("LOADED"), answer  # its own server's API answers it (its own secret, in its sandbox)
    with serving.client_for(attacker) as c:
        assert "smuggled" not in {m["name"] for m in c.repository_index()}  # the index does not show it...
        assert "smuggled" in c.loaded_models()  # ...the statistics do
    found = reconcile.reconcile_node(attacker.node_id)
    assert found["models_unloaded"] == 1, found
    with serving.client_for(attacker) as c:
        assert "smuggled" not in c.loaded_models() and c.is_model_ready("probe")
    assert DriftEvent.objects.filter(kind=DriftEvent.Kind.MODEL_UNLOADED, allocation=attacker,
                                     detail__contains="smuggled").exists()


def test_fork_bomb_stops_only_its_own_slice(real_serving, tiers, settings):
    settings.TESSERA_SANDBOX_PIDS = 300
    a_owner, b_owner = tenant_owner(), tenant_owner()
    victim = order_active(a_owner, tiers["1g"])
    deploy_ready(a_owner, victim, "honest", template="tiny-gen")
    attacker = order_active(b_owner, tiers["1g"])
    dep = deploy_ready(b_owner, attacker, "probe", spec=HOSTILE_SPEC)
    answer = probe(attacker, "fork")
    assert answer.startswith("FORKED") and "Resource temporarily unavailable" in answer, answer
    forked = int(answer.split()[1])
    assert 100 < forked < 300, answer
    assert honest_answers(victim)
    assert subprocess.run(["true"], check=False).returncode == 0  # the node forks as before
    found = reconcile.reconcile_node(attacker.node_id)
    assert found["models_stopped"] == 1 and found["servers_restarted"] == 0, found
    dep.refresh_from_db()
    assert dep.state == D.FAILED and "more processes and threads than this slice allows (300)" in dep.failure_reason
    census = serving.runtime().census(serving.spec_for(_server(attacker), attacker))
    assert census is not None and census.tasks < 150 and not census.stubs.get("probe")  # the bomb is gone
    assert honest_answers(victim)
    assert DriftEvent.objects.filter(kind=DriftEvent.Kind.SANDBOX_LIMIT, allocation=attacker).exists()


def test_memory_hog_stops_only_its_own_model_with_a_reason_its_tenant_sees(real_serving, tiers):
    hog_tier = tiers["3g"]
    hog_tier.host_memory_mib = 768
    hog_tier.save(update_fields=["host_memory_mib"])
    a_owner, b_owner = tenant_owner(), tenant_owner()
    victim = order_active(a_owner, tiers["1g"])
    deploy_ready(a_owner, victim, "honest", template="tiny-gen")
    attacker = order_active(b_owner, hog_tier)
    dep = deploy_ready(b_owner, attacker, "probe", spec=HOSTILE_SPEC)  # declares 64 MiB...
    spare = deploy_ready(b_owner, attacker, "spare", template="tiny-gen")
    with pytest.raises(Exception, match="not healthy|Stub|failed|Connection"):
        probe(attacker, "hog:2048")  # ...and takes 2 GiB
    assert honest_answers(victim)
    census = serving.runtime().census(serving.spec_for(_server(attacker), attacker))
    assert census.oom_kills >= 1 and census.memory_bytes < 768 * 1024 * 1024
    found = reconcile.reconcile_node(attacker.node_id)
    assert found["models_stopped"] == 1 and found["servers_restarted"] == 0, found
    dep.refresh_from_db()
    assert dep.state == D.FAILED and "more memory than this slice allows (768 MiB" in dep.failure_reason
    spare.refresh_from_db()
    assert spare.state == D.READY
    out = deployments.backend_for(attacker).infer_text("spare", "the rest of the slice answers", max_tokens=2)
    assert out["output_tokens"] == 2
    assert honest_answers(victim)


def test_declared_memory_over_the_sandbox_allowance_is_refused(real_serving, tiers):
    tier = tiers["1g"]
    tier.host_memory_mib = 512
    tier.save(update_fields=["host_memory_mib"])
    owner = tenant_owner()
    a = order_active(owner, tier)
    with pytest.raises(deployments.ServiceError, match="declares 2,048 MiB of host memory.*allows 512 MiB"):
        deployments.deploy(owner[1], a, "big", spec={**HOSTILE_SPEC, "memory_mb": 2048})
    assert not ModelDeployment.objects.filter(allocation=a).exists()


def test_failing_model_load_leaves_the_other_models_of_its_server_answering(real_serving, tiers):
    owner = tenant_owner()
    a = order_active(owner, tiers["1g"])
    deploy_ready(owner, a, "honest", template="tiny-gen")
    broken = deployments.deploy(owner[1], a, "broken", spec=FAILING_SPEC)
    assert deployments.load(broken.pk) == "failed"
    broken.refresh_from_db()
    assert "never loads" in broken.failure_reason and str(serving.repo_root()) not in broken.failure_reason
    server = _server(a)
    assert serving.check(server, a)  # the server is ready: one model's failure is that model's
    found = reconcile.reconcile_node(a.node_id)
    assert found["servers_restarted"] == 0 and found["errors"] == 0, found
    assert _server(a).restarts == 0
    assert deployments.backend_for(a).infer_text("honest", "still answering", max_tokens=2)["output_tokens"] == 2


def test_a_restart_first_counts_what_the_server_served(real_serving, tiers):
    owner = tenant_owner()
    a = order_active(owner, tiers["1g"])
    dep = deploy_ready(owner, a, "honest", template="tiny-gen")
    for _ in range(7):
        deployments.backend_for(a).infer_text("honest", "served but not yet scraped", max_tokens=1)
    serving.restart(_server(a), a)
    assert sum(TritonServedHourly.objects.filter(deployment=dep).values_list("requests", flat=True)) == 7


def test_sandbox_users_are_tesseras_own_and_everything_goes_with_the_slice(real_serving, tiers):
    owner = tenant_owner()
    a = order_active(owner, tiers["1g"])
    server = _server(a)
    names = sb.names(django_settings.TESSERA_INSTALLATION_ID, server.name)
    assert server.unix_user == names.user == f"tessera-{django_settings.TESSERA_INSTALLATION_ID}-{a.pk}"
    assert Path("/run/netns", names.netns).exists() and Path("/sys/class/net", names.host_if).exists()
    assert names.table in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    cgroups = serving.runtime().sandbox.cgroups(server.name)
    assert all(d.is_dir() for d in cgroups.dirs())
    orders.request_release(owner[1], a)
    assert provisioning.release_allocation(a.pk) == "released"
    assert not Path("/run/netns", names.netns).exists() and not Path("/sys/class/net", names.host_if).exists()
    assert names.table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert not any(d.exists() for d in cgroups.dirs())
    with pytest.raises(KeyError):
        pwd.getpwnam(names.user)


def test_an_existing_account_of_the_same_name_is_never_used_or_removed(real_serving, tmp_path):
    spec = rt.ServerSpec(name="allocation-987654", repo_dir=tmp_path / "repo", work_dir=tmp_path / "work",
                         device_uuid="MIG-x", address="127.0.0.1", http_port=21000, grpc_port=21001,
                         metrics_port=21002, secret="s", installation=django_settings.TESSERA_INSTALLATION_ID)
    run = rt.ProcessRuntime(python="/usr/bin/python3")
    subprocess.run(["useradd", "--system", "--no-create-home", "--comment", "someone else's", spec.unix_user],
                   check=True)
    try:
        with pytest.raises(rt.RuntimeFault, match="exists and was not made by Tessera"):
            run._user_made(spec, run._begin_user(spec))
        run._remove_user(spec)  # not ours: left alone
        assert pwd.getpwnam(spec.unix_user).pw_gecos == "someone else's"
    finally:
        subprocess.run(["userdel", spec.unix_user], check=False)


def test_a_gateway_on_another_host_reaches_the_slice_through_the_node_address(real_serving, tiers, h100_node):
    """The node's serving address is not loopback: the slice's ports there are DNATed to its sandbox (from
    this host and, with forwarding on, from a 'gateway host' in a network namespace of its own); nothing else."""
    address = _node_addresses()[0]
    h100_node.serving_address = address
    h100_node.save(update_fields=["serving_address"])
    owner = tenant_owner()
    a = order_active(owner, tiers["1g"])
    server = _server(a)
    assert server.address == address and a.triton_url == f"http://{address}:{server.http_port}"
    assert honest_or_ready(a)
    sandbox_ip = serving.runtime().sandbox.inner_ip(server.name)
    assert sandbox_ip and sandbox_ip != address
    gw, gw_host, gw_peer = f"tsgw{uuid.uuid4().hex[:6]}", f"tg{uuid.uuid4().hex[:6]}h", f"tg{uuid.uuid4().hex[:6]}p"
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    cmds = [["ip", "netns", "add", gw], ["ip", "link", "add", gw_host, "type", "veth", "peer", "name", gw_peer],
            ["ip", "link", "set", gw_peer, "netns", gw], ["ip", "addr", "add", "10.214.250.1/30", "dev", gw_host],
            ["ip", "link", "set", gw_host, "up"], ["ip", "-n", gw, "addr", "add", "10.214.250.2/30", "dev", gw_peer],
            ["ip", "-n", gw, "link", "set", gw_peer, "up"],
            ["ip", "-n", gw, "route", "add", f"{address}/32", "via", "10.214.250.1"]]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        header = f"{rt.SECRET_HEADER}: {serving.secret_for(server)}"
        curl = ["ip", "netns", "exec", gw, "/usr/bin/python3", "-c",
                "import sys, urllib.request as u; r = u.Request(sys.argv[1], headers=dict([sys.argv[2].split(': ')]));"
                "print(u.urlopen(r, timeout=5).status)", f"http://{address}:{server.http_port}/v2/health/ready",
                header]
        assert subprocess.run(curl, capture_output=True, text=True, timeout=30).stdout.strip() == "200"
        # the sandbox's inner address is not forwarded to from outside: only the DNATed ports are
        direct = ["ip", "netns", "exec", gw, "ip", "route", "add", f"{sandbox_ip}/32", "via", "10.214.250.1"]
        subprocess.run(direct, check=True, capture_output=True)
        knock = ["ip", "netns", "exec", gw, "/usr/bin/python3", "-c",
                 "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)",
                 sandbox_ip, str(server.http_port)]
        assert subprocess.run(knock, capture_output=True, text=True, timeout=30).returncode != 0
    finally:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(forward)
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["ip", "link", "delete", gw_host], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "delete", gw], check=False, capture_output=True)


def honest_or_ready(a: Allocation) -> bool:
    with serving.client_for(a) as c:
        return c.is_server_ready()
