"""The serving runtime and the slice lifecycle around it, on the simulated runtime and on real processes that
are not Triton (a binary that exits at start, a missing binary), plus the docker container spec."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import textwrap
from pathlib import Path
from unittest import mock

import pytest
from celery.exceptions import Retry
from tritonclient.utils import InferenceServerException

from marketplace.hardware import runtime as rt
from marketplace.hardware import sandbox as sb
from marketplace.models import Allocation, DriftEvent, GpuInstance, ModelDeployment, Node, TritonServer
from marketplace.services import deployments, nodes, orders, provisioning, reconcile, serving
from marketplace.tasks import DEPLOY_WAIT_POLL_S, deploy_model
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory

pytestmark = pytest.mark.django_db
T = TritonServer.State
D = ModelDeployment.State


@pytest.fixture
def owner(db):
    tenant = TenantFactory(max_slices=16, max_slices_per_tier=16)
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def _order(owner, tier) -> Allocation:
    tenant, p = owner
    return orders.create_order(p, tenant=tenant, tier=tier).allocations.get()


def _fresh(a: Allocation) -> Allocation:
    return Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model", "instance").get(pk=a.pk)


def spec(tmp_path, **kw) -> rt.ServerSpec:
    base = {"name": "allocation-7", "repo_dir": tmp_path / "repo", "work_dir": tmp_path / "work",
            "device_uuid": "MIG-11111111-2222-3333-4444-555555555555", "address": "10.0.0.5", "http_port": 20000,
            "grpc_port": 20001, "metrics_port": 20002, "secret": "s3cret"}
    return rt.ServerSpec(**{**base, **kw})


# --- the lifecycle on the simulated runtime -------------------------------------------------------

def test_slice_is_ready_only_once_its_server_answers(h100_node, tiers, owner):
    a = _order(owner, tiers["1g"])
    assert provisioning.provision(a.pk) == "activated"
    server = TritonServer.objects.get(allocation=a)
    assert server.state == T.RUNNING and server.isolation == TritonServer.Isolation.SIM and server.last_health_ok
    assert (server.http_port, server.grpc_port, server.metrics_port) == (20000, 20001, 20002)
    a = _fresh(a)
    assert a.triton_url == "http://127.0.0.1:20000" and a.triton_metrics_url == "http://127.0.0.1:20002/metrics"
    ready = a.events.get(to_state="ready")
    assert ready.reason == "slice created; its Triton server answers ready" and "allocation-" in ready.detail
    # the simulated server locks its repository API like a real one started by the runtime
    sim = deployments.backend_for(a)
    with pytest.raises(InferenceServerException, match="restricted"):
        sim.load_model("anything", headers={})
    assert provisioning.provision(a.pk) == "nothing to do (active)"  # replayed: one server, same ports
    assert TritonServer.objects.filter(allocation=a).count() == 1


def test_a_server_that_does_not_come_up_fails_the_slice_and_leaves_nothing(h100_node, tiers, owner, monkeypatch):
    a = _order(owner, tiers["1g"])
    run = serving.runtime()

    def refuse(spec):
        raise rt.RuntimeFault("could not start /opt/triton/bin/tritonserver: [Errno 2] No such file or directory")

    monkeypatch.setattr(run, "start", refuse)
    assert provisioning.provision(a.pk) == "failed"
    a = _fresh(a)
    assert a.state == Allocation.State.FAILED
    assert a.failure_reason == "the slice's inference server could not be started"
    assert "No such file" in a.events.get(to_state="failed").detail  # operators read the cause
    assert a.instance_id is None and not GpuInstance.objects.exists()  # slots returned
    with nodes.nvml_client(a.node) as client:
        assert all(not client.slices(g.index) for g in a.node.gpus.all())  # the GPU instance destroyed
    server = TritonServer.objects.get(allocation=a)
    assert server.state == T.STOPPED and server.http_port is None and "No such file" in server.reason
    assert not serving.repo_dir(a.pk).exists()
    monkeypatch.undo()
    orders.retry(principal_for_user(_operator()), a)  # an operator's retry re-places and starts it
    assert provisioning.provision(a.pk) == "activated"
    assert TritonServer.objects.get(allocation=a).state == T.RUNNING


def _operator():
    return OperatorFactory()


def test_port_pool_exhausted_is_a_clear_failure(h100_node, tiers, owner):
    Node.objects.filter(pk=h100_node.pk).update(serving_port_min=21000, serving_port_max=21005)  # two servers
    a, b, c = (_order(owner, tiers["1g"]) for _ in range(3))
    assert provisioning.provision(a.pk) == "activated" and provisioning.provision(b.pk) == "activated"
    assert provisioning.provision(c.pk) == "failed"
    event = _fresh(c).events.get(to_state="failed")
    assert event.reason == "the node has no free port for the slice's inference server"
    assert "21000-21005" in event.detail and "2 servers fit" in event.detail
    ports = set(TritonServer.objects.exclude(http_port=None).values_list("http_port", flat=True))
    assert ports == {21000, 21003}
    orders.request_release(owner[1], a)  # a released slice gives its ports back
    assert provisioning.release_allocation(a.pk) == "released"
    orders.retry(principal_for_user(_operator()), c)
    assert provisioning.provision(c.pk) == "activated"
    assert TritonServer.objects.get(allocation=c).http_port == 21000


def test_release_of_a_slice_whose_server_never_started_completes(h100_node, tiers, owner, settings):
    settings.TESSERA_TRITON_BACKEND = "http"  # as on a node where no server was ever started
    a = _order(owner, tiers["1g"])
    a = _fresh(a)
    from marketplace.services import allocations

    allocations.begin_provisioning(a, "test")
    provisioning._create_on_gpu(a, a.instance)
    Allocation.objects.filter(pk=a.pk).update(state=Allocation.State.RELEASING)
    assert not TritonServer.objects.filter(allocation=a).exists()
    assert provisioning.release_allocation(a.pk) == "released"
    a = _fresh(a)
    assert a.state == Allocation.State.RELEASED and not GpuInstance.objects.exists()


def test_release_with_models_stops_the_server_and_removes_the_repository(h100_node, tiers, owner):
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    a = _fresh(a)
    dep = deployments.deploy(owner[1], a, "tiny-gen", template="tiny-gen")
    assert deployments.load(dep.pk) == "ready"
    assert (serving.repo_dir(a.pk) / "tiny-gen" / "config.pbtxt").is_file()
    orders.request_release(owner[1], a)
    assert provisioning.release_allocation(a.pk) == "released"
    assert not serving.repo_dir(a.pk).exists()
    assert TritonServer.objects.get(allocation=a).state == T.STOPPED
    assert not deployments.backend_for(a).is_server_ready()
    assert ModelDeployment.objects.get(pk=dep.pk).state == D.REMOVED
    assert provisioning.release_allocation(a.pk) == "already released"  # idempotent


def test_model_deployed_while_the_server_is_down_waits_then_loads(h100_node, tiers, owner):
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    a = _fresh(a)
    server = TritonServer.objects.get(allocation=a)
    serving.runtime().kill(serving.spec_for(server, a))
    dep = deployments.deploy(owner[1], a, "tiny-gen", template="tiny-gen")
    with mock.patch.object(deploy_model, "retry", side_effect=Retry()) as retry:  # waiting: a retry, not a failure
        with pytest.raises(Retry):
            deploy_model(dep.pk)
    assert retry.call_args.kwargs["countdown"] == DEPLOY_WAIT_POLL_S and retry.call_args.kwargs["max_retries"] is None
    dep.refresh_from_db()
    assert dep.state == D.PENDING and dep.waiting_reason == "waiting for the slice's inference server to start"
    assert dep.waiting_since is not None
    found = reconcile.reconcile_node(a.node_id)  # the dead server is restarted
    assert found["servers_restarted"] == 1
    assert deployments.load(dep.pk) == "ready"
    dep.refresh_from_db()
    assert dep.state == D.READY and dep.waiting_reason == "" and dep.waiting_since is None


def test_model_waiting_past_the_limit_fails_with_the_reason_and_can_be_retried(h100_node, tiers, owner, settings):
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    a = _fresh(a)
    server = TritonServer.objects.get(allocation=a)
    serving.runtime().kill(serving.spec_for(server, a))
    settings.TESSERA_DEPLOY_WAIT_S = 0
    dep = deployments.deploy(owner[1], a, "tiny-gen", template="tiny-gen")
    assert deployments.load(dep.pk) == "failed"
    dep.refresh_from_db()
    assert dep.state == D.FAILED
    assert dep.failure_reason == ("the slice's inference server was not up within 0 s; retry the model when the "
                                  "slice is serving")
    reconcile.reconcile_node(a.node_id)
    deployments.retry(owner[1], dep)
    assert ModelDeployment.objects.get(pk=dep.pk).state == D.PENDING
    assert deployments.load(dep.pk) == "ready"


def test_retry_is_only_for_failed_models_of_the_tenant(h100_node, tiers, owner, tenant_b):
    from tenants.errors import Conflict, Forbidden

    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    dep = deployments.deploy(owner[1], _fresh(a), "tiny-gen", template="tiny-gen")
    deployments.load(dep.pk)
    with pytest.raises(Conflict, match="only failed models"):
        deployments.retry(owner[1], dep)
    other = principal_for_user(MembershipFactory(tenant=tenant_b, role=Role.OWNER).user)
    with pytest.raises(Forbidden):
        deployments.retry(other, dep)


def test_reconcile_stops_a_stray_server_and_unloads_a_model_tessera_did_not_deploy(h100_node, tiers, owner):
    a = _order(owner, tiers["1g"])
    b = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    provisioning.provision(b.pk)
    a, b = _fresh(a), _fresh(b)
    dep = deployments.deploy(owner[1], a, "mine", template="tiny-gen")
    deployments.load(dep.pk)
    # someone holding the secret loaded a model Tessera never deployed
    from marketplace.hardware import triton

    triton.write_repository(serving.repo_dir(a.pk), triton.demo_text_model("intruder"))
    deployments.backend_for(a).load_model("intruder")
    # b's row says released, but its server still runs on the node
    Allocation.objects.filter(pk=b.pk).update(state=Allocation.State.RELEASED)
    found = reconcile.reconcile_node(a.node_id)
    assert found["models_unloaded"] == 1 and found["servers_stopped"] == 1 and found["errors"] == 0
    assert not deployments.backend_for(a).is_model_ready("intruder")
    assert deployments.backend_for(a).is_model_ready("mine")
    assert not deployments.backend_for(b).is_server_ready()
    kinds = set(DriftEvent.objects.values_list("kind", flat=True))
    assert {DriftEvent.Kind.MODEL_UNLOADED, DriftEvent.Kind.SERVER_STOPPED} <= kinds
    assert reconcile.reconcile_node(a.node_id)["servers_stopped"] == 0  # repaired: nothing left


def test_stuck_allocation_is_requeued_a_few_times_then_left_unresolved(h100_node, tiers, owner, settings):
    settings.TESSERA_PROVISION_STUCK_AFTER_S = 0
    a = _order(owner, tiers["1g"])
    Allocation.objects.filter(pk=a.pk).update(state=Allocation.State.RELEASING)
    counts = [reconcile.reconcile_node(h100_node.pk)["requeued"] for _ in range(reconcile.MAX_REQUEUES + 2)]
    assert counts == [1] * reconcile.MAX_REQUEUES + [0, 0]
    unresolved = DriftEvent.objects.filter(kind=DriftEvent.Kind.STUCK_REQUEUED, resolved=False)
    assert unresolved.count() == 1 and "not re-queued again" in unresolved.get().detail


# --- the process runtime with binaries that are not Triton -----------------------------------------

def _fake_binary(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bin" / "tritonserver"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    (tmp_path / "backends" / "python").mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def process_runtime(settings, h100_node, tmp_path):
    settings.TESSERA_TRITON_BACKEND = "http"
    settings.TESSERA_SERVING_RUNTIME = "process"
    settings.TESSERA_SERVING_ISOLATE = False
    settings.TESSERA_SERVING_START_TIMEOUT_S = 5
    serving.reset_runtimes()
    yield settings
    serving.reset_runtimes()


def test_server_exiting_at_start_fails_the_slice_with_its_log_tail(process_runtime, tiers, owner, tmp_path):
    process_runtime.TESSERA_TRITONSERVER = str(_fake_binary(tmp_path, """
        echo "error: creating server: Internal - failed to load all models" >&2
        exit 1
    """))
    a = _order(owner, tiers["1g"])
    assert provisioning.provision(a.pk) == "failed"
    a = _fresh(a)
    assert a.failure_reason == "the slice's inference server exited at start"
    detail = a.events.get(to_state="failed").detail
    assert "exited with code 1 before it was ready" in detail and "failed to load all models" in detail
    server = TritonServer.objects.get(allocation=a)
    assert "failed to load all models" in server.log_tail and server.http_port is None
    assert not GpuInstance.objects.exists()


def test_missing_binary_fails_the_slice_with_the_setting_named(process_runtime, tiers, owner, tmp_path):
    process_runtime.TESSERA_TRITONSERVER = str(tmp_path / "nowhere" / "tritonserver")
    a = _order(owner, tiers["1g"])
    assert provisioning.provision(a.pk) == "failed"
    detail = _fresh(a).events.get(to_state="failed").detail
    assert "missing or not executable (TESSERA_TRITONSERVER)" in detail


def test_server_that_never_becomes_ready_is_stopped(process_runtime, tiers, owner, tmp_path):
    process_runtime.TESSERA_TRITONSERVER = str(_fake_binary(tmp_path, "sleep 60\n"))
    process_runtime.TESSERA_SERVING_START_TIMEOUT_S = 1
    a = _order(owner, tiers["1g"])
    assert provisioning.provision(a.pk) == "failed"
    assert "not ready within 1 s; stopped" in _fresh(a).events.get(to_state="failed").detail
    server = TritonServer.objects.get(allocation=a)
    pid_file = serving.work_dir(a.pk) / rt.PID_FILE
    assert not pid_file.exists() and server.state == T.STOPPED


def test_the_server_environment_is_built_from_nothing(process_runtime, tiers, owner, tmp_path, monkeypatch):
    out = tmp_path / "env.txt"
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/tessera")
    monkeypatch.setenv("TESSERA_TEST_CANARY", "worker-only")
    process_runtime.TESSERA_TRITONSERVER = str(_fake_binary(tmp_path, f"env > {out}\nexit 3\n"))
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    names = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    assert names <= {"PATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "HOME", "TMPDIR", "LANG", "PWD", "SHLVL", "_"}
    assert f"CUDA_VISIBLE_DEVICES={_fresh(a).mig_uuid}" in out.read_text()


LIMITS = sb.Limits(memory_mib=512, pids=256, cpu_weight=100)


@pytest.mark.skipif(os.geteuid() != 0 or sb.missing_tools() != [], reason="needs root and the sandbox's tools")
def test_a_user_that_cannot_be_created_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(rt, "USER_MARKER", "a comment useradd refuses:")  # ':' separates passwd's fields
    root = Path(tempfile.mkdtemp(prefix="tessera-user-test-", dir="/tmp"))
    box = sb.Sandbox(installation="zz9", state_dir=root)
    try:
        root.chmod(0o755)
        run = rt.ProcessRuntime(binary=str(_fake_binary(root, "exit 0\n")), python="/usr/bin/python3"
                                if os.path.exists("/usr/bin/python3") else "", runtime_dir=root / "rt", sandbox=box)
        with pytest.raises(rt.RuntimeFault, match="could not create the server's Unix user tessera-zz9-7: useradd"):
            run.start(spec(root, repo_dir=root / "repo", work_dir=root / "work", address="127.0.0.1",
                           installation="zz9", limits=LIMITS))
        names = sb.names("zz9", "allocation-7")  # and nothing of the sandbox is left
        assert not Path("/run/netns", names.netns).exists() and not any(d.exists() for d in box.cgroups(
            "allocation-7").dirs())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_root_worker_never_runs_a_server_unconfined(tmp_path, monkeypatch):
    """Where the sandbox cannot be made (a tool missing), the server is refused, never started without it."""
    monkeypatch.setattr(sb, "missing_tools", lambda: ["bwrap", "nft"])
    monkeypatch.setattr(sb.os, "geteuid", lambda: 0)
    started = tmp_path / "started"
    run = rt.ProcessRuntime(binary=str(_fake_binary(tmp_path, f"touch {started}\nsleep 5\n")),
                            runtime_dir=tmp_path / "rt", run_as_root=True)
    s = spec(tmp_path, address="127.0.0.1", limits=LIMITS)
    assert run.isolation(s) == "sandbox"
    with pytest.raises(rt.RuntimeFault, match="sandbox cannot be made on this node: missing bwrap, nft"):
        run.start(s)
    assert not started.exists() and not (tmp_path / "work" / rt.PID_FILE).exists()


def test_server_arguments_lock_the_repository_api_and_bind_the_private_address(tmp_path):
    args = spec(tmp_path).server_args("/srv/repo", "/srv/backends")
    assert "--model-control-mode=explicit" in args and "--http-address=10.0.0.5" in args
    assert "--grpc-address=10.0.0.5" in args and "--metrics-address=10.0.0.5" in args
    assert "--allow-sagemaker=false" in args and "--allow-vertex-ai=false" in args  # no unrestricted frontends
    apis = "health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"
    assert f"--http-restricted-api={apis}:{rt.SECRET_HEADER}=s3cret" in args
    assert f"--grpc-restricted-protocol={apis}:{rt.SECRET_HEADER}=s3cret" in args
    assert "--allow-gpu-metrics=false" in args
    assert "--allow-gpu-metrics=true" in spec(tmp_path, gpu_metrics=True).server_args("/r", None)
    with pytest.raises(ValueError, match="distinct ports"):
        spec(tmp_path, grpc_port=20000)


def test_the_secret_changes_with_every_start_and_is_never_stored(h100_node, tiers, owner):
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    a = _fresh(a)
    server = TritonServer.objects.get(allocation=a)
    first = serving.secret_for(server)
    assert first not in str(TritonServer.objects.filter(pk=server.pk).values().get())
    serving.runtime().kill(serving.spec_for(server, a))
    reconcile.reconcile_node(a.node_id)
    server.refresh_from_db()
    assert serving.secret_for(server) != first
    with pytest.raises(InferenceServerException, match="restricted"):
        deployments.backend_for(a).load_model("tiny-gen", headers={rt.SECRET_HEADER: first})


# --- docker -------------------------------------------------------------------------------------

def test_docker_container_spec_gives_the_process_sandboxs_guarantees(tmp_path):
    """One device, one read-only repository, its own network with only its published ports in, the slice's memory
    (no swap), process and CPU limits, private IPC and bounded tmpfs, read-only root, no capabilities, no new
    privileges, an unprivileged user, no core files, a cap on any file's size."""
    limits = sb.Limits(memory_mib=6144, pids=512, cpu_weight=300, file_size_mib=256, tmpfs_mib=128)
    s = spec(tmp_path, installation="ab12", limits=limits)
    c = rt.container_spec(s, "nvcr.io/nvidia/tritonserver:24.10-py3")
    assert c["device_requests"] == [{"Driver": "nvidia", "DeviceIDs": [s.device_uuid], "Capabilities": [["gpu"]]}]
    assert c["volumes"] == {str(s.repo_dir.resolve()): {"bind": "/models", "mode": "ro"}}  # nothing else mounted
    net = rt.network_spec(s)
    assert c["network"] == net["name"] == "tessera-ab12-7" and "network_mode" not in c  # never the host's
    assert net["driver"] == "bridge" and net["options"]["com.docker.network.bridge.enable_icc"] == "false"
    bridge = net["options"]["com.docker.network.bridge.name"]
    assert bridge == rt.bridge_name(s) and len(bridge) <= 15  # the kernel's limit, named by the firewall rules
    assert c["ports"] == {"8000/tcp": ("10.0.0.5", 20000), "8001/tcp": ("10.0.0.5", 20001),
                          "8002/tcp": ("10.0.0.5", 20002)}
    assert c["mem_limit"] == c["memswap_limit"] == "6144m" and c["pids_limit"] == 512
    assert c["cpu_shares"] == 3072 and c["ipc_mode"] == "private" and c["shm_size"] == "128m"
    assert c["tmpfs"] == {"/tmp": "rw,nosuid,nodev,size=128m"}
    assert {u["Name"]: (u["Soft"], u["Hard"]) for u in c["ulimits"]} == {"core": (0, 0),
                                                                          "fsize": (256 << 20, 256 << 20)}
    assert c["cap_drop"] == ["ALL"] and c["security_opt"] == ["no-new-privileges"] and c["read_only"]
    assert c["user"] == "65534:65534" and "privileged" not in c and "cap_add" not in c
    assert set(c["environment"]) == {"CUDA_VISIBLE_DEVICES"}  # none of the worker's secrets
    cmd = c["command"]
    assert cmd[0] == "tritonserver" and "--model-repository=/models" in cmd
    assert "--model-control-mode=explicit" in cmd and "--http-port=8000" in cmd and "--strict-readiness=false" in cmd
    assert any(a.startswith("--http-restricted-api=health,") and a.endswith("=s3cret") for a in cmd)
    assert c["labels"]["tessera.server"] == "allocation-7"
    # the node's rules for its bridge: nothing it opens gets anywhere, answers to connections made to it do
    rules = sb.host_rules(sb.names("ab12", s.name).table, bridge)
    assert f'iifname "{bridge}" ct state established,related accept\n    iifname "{bridge}" drop' in rules
    assert "dnat" not in rules.split("table ip")[0].replace("ct status dnat", "")


class _FakeDocker:
    """Records what the docker runtime asks of the engine, in order."""

    def __init__(self):
        self.calls: list[str] = []
        outer = self

        class Networks:
            def list(self, names):
                return []

            def create(self, **kw):
                outer.calls.append(f"network {kw['name']}")

        class Containers:
            def list(self, **kw):
                return []

            def run(self, **kw):
                outer.calls.append(f"run {kw['name']}")
                return type("C", (), {"id": "c1"})()

        self.networks, self.containers = Networks(), Containers()


def test_docker_runtime_sets_the_firewall_before_the_container_runs(tmp_path, monkeypatch):
    fake = _FakeDocker()
    box = sb.Sandbox(installation="ab12", state_dir=tmp_path)
    monkeypatch.setattr(box, "apply_firewall", lambda name, bridge, **kw: fake.calls.append(f"firewall {bridge}"))
    run = rt.DockerRuntime("img", client=fake, sandbox=box)
    s = spec(tmp_path, installation="ab12", limits=LIMITS)
    assert run.start(s).running
    assert fake.calls == ["network tessera-ab12-7", f"firewall {rt.bridge_name(s)}", "run tessera-allocation-7"]


def test_docker_container_spec_mounts_the_model_store_read_only_at_its_own_path(tmp_path, settings):
    """A vLLM library model's model.json names its weights under TESSERA_MODEL_STORE_ROOT: the container sees that
    folder at the same path, read-only, next to its repository; nothing else of the node is mounted."""
    store = tmp_path / "model-store"
    store.mkdir()
    s = spec(tmp_path)
    c = rt.container_spec(s, "nvcr.io/nvidia/tritonserver:24.10-py3", store)
    assert c["volumes"] == {str(s.repo_dir.resolve()): {"bind": "/models", "mode": "ro"},
                            str(store.resolve()): {"bind": str(store.resolve()), "mode": "ro"}}
    with pytest.raises(ValueError, match="hide the repository"):
        rt.container_spec(s, "img", Path("/models/weights"))
    settings.TESSERA_SERVING_RUNTIME, settings.TESSERA_MODEL_STORE_ROOT = "docker", store
    settings.TESSERA_TRITON_BACKEND = "http"
    serving.reset_runtimes()
    try:
        docker_rt = serving.runtime()
        assert isinstance(docker_rt, rt.DockerRuntime) and docker_rt.model_store == store
    finally:
        serving.reset_runtimes()


def _docker_engine() -> str | None:
    try:
        import docker

        docker.from_env().ping()
        return None
    except Exception as exc:  # no SDK, no socket, no engine
        return f"no Docker engine here: {exc.__class__.__name__}"


@pytest.mark.skipif(_docker_engine() is not None, reason=str(_docker_engine()))
def test_docker_runtime_against_a_real_engine(tmp_path):  # pragma: no cover - needs an engine and the image
    run = rt.DockerRuntime(os.environ.get("TESSERA_TRITON_IMAGE", "nvcr.io/nvidia/tritonserver:24.10-py3"))
    s = spec(tmp_path, address="127.0.0.1")
    s.repo_dir.mkdir(parents=True)
    try:
        assert run.start(s).running
        assert run.status(s).running and s.name in run.running(tmp_path, "")
    finally:
        run.stop(s)
    assert not run.status(s).running


def test_stage_install_is_readable_by_others(tmp_path):
    binary = _fake_binary(tmp_path, "exit 0\n")
    backends = tmp_path / "backends" / "python"
    backends.mkdir(parents=True, exist_ok=True)
    (backends / "libtriton_python.so").write_bytes(b"\x7fELF")
    os.chmod(backends / "libtriton_python.so", 0o600)
    staged = rt.stage_install(rt.TritonInstall(binary=binary, libs=None, backends=tmp_path / "backends", stub=None),
                              tmp_path / "staged")
    lib = staged.backends / "python" / "libtriton_python.so"
    assert stat.S_IMODE(lib.stat().st_mode) == 0o644 and stat.S_IMODE(staged.binary.stat().st_mode) == 0o755
    assert rt.stage_install(rt.TritonInstall(binary=binary, libs=None, backends=tmp_path / "backends", stub=None),
                            tmp_path / "staged") == staged  # once


def test_reconcile_leaves_another_nodes_servers_alone_on_a_shared_host(h100_node, tiers, owner):
    """The demo runs several simulated nodes in one worker: node A's reconcile must not take node B's
    servers for strays (seen in the demo before: every server stopped within a minute)."""
    from tests.fleet_fixtures import make_node

    node_b = make_node("node-b")
    a = _order(owner, tiers["1g"])
    provisioning.provision(a.pk)
    Node.objects.filter(pk=h100_node.pk).update(state=Node.State.DRAINING)  # the next slice lands on node B
    b = _order(owner, tiers["1g"])
    assert b.node_id == node_b.pk
    provisioning.provision(b.pk)
    for node in (h100_node, node_b, h100_node):
        assert reconcile.reconcile_node(node.pk)["servers_stopped"] == 0
    assert TritonServer.objects.filter(state=T.RUNNING).count() == 2
    assert deployments.backend_for(_fresh(b)).is_server_ready()
