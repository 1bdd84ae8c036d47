"""The serving runtime on REAL tritonserver processes (the nvidia-pytriton binary, CPU, python backend).

Each slice gets its own server, started by the provisioning service: its own ports from the node's pool,
explicit model control, the repository API locked by a per-server secret, and (when the tests run as root,
as CI does) its own Unix user owning its repository with mode 0700. The python backend then needs a Python
that other users can run: Debian's python3 with python3-numpy (`make serving-deps`); without it the
isolation tests skip and say why.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import signal
import stat
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from tritonclient.utils import InferenceServerException

from marketplace.hardware import runtime as rt
from marketplace.hardware.triton import HttpTritonBackend
from marketplace.models import Allocation, DriftEvent, ModelDeployment, TritonServer
from marketplace.services import deployments, orders, provisioning, reconcile, serving
from tests.serving_fixtures import ISOLATED, NOT_ISOLATED_WHY, deploy_ready, order_active, tenant_owner
from tests.triton_server import tritonserver_available
from tests.worker_process import wait_for

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db,
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]
D = ModelDeployment.State
T = TritonServer.State


@pytest.fixture
def owner(db):
    return tenant_owner()


def test_order_server_ready_deploy_infer(real_serving, owner, tiers):
    a = order_active(owner, tiers["3g"])
    server = TritonServer.objects.get(allocation=a)
    assert a.state == Allocation.State.ACTIVE and server.state == T.RUNNING and server.last_health_ok
    pool = range(a.node.serving_port_min, a.node.serving_port_max + 1)
    assert {server.http_port, server.grpc_port, server.metrics_port} <= set(pool)
    if ISOLATED:  # the server listens in its sandbox's network namespace, on its inner veth address
        assert ipaddress.ip_address(server.address) in ipaddress.ip_network(django_settings.TESSERA_SANDBOX_SUBNET)
    else:
        assert server.address == "127.0.0.1"
    assert a.triton_url == f"http://{server.address}:{server.http_port}"
    events = list(a.events.values_list("to_state", "reason"))
    assert ("ready", "slice created; its Triton server answers ready") in events
    pid = serving.runtime().sandbox.server_pid(server.name) if ISOLATED else server.pid
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--model-control-mode=explicit" in cmdline and b"--strict-readiness=false" in cmdline
    assert any(arg.startswith(b"--http-restricted-api=health,metadata,inference,") for arg in cmdline)
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={a.mig_uuid}".encode() in env and a.mig_uuid.startswith("MIG-")
    assert not [e for e in env if e.split(b"=")[0] in (b"DATABASE_URL", b"SECRET_KEY", b"REDIS_URL",
                                                        b"TESSERA_TEST_CANARY")]
    dep = deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    out = deployments.backend_for(a).infer_text(dep.name, "tokens are metered per tenant", max_tokens=4)
    assert out["input_tokens"] == 5 and out["output_tokens"] == 4 and out["text"]


@pytest.mark.skipif(not ISOLATED, reason=NOT_ISOLATED_WHY)
def test_server_runs_as_its_own_user_owning_its_repository(real_serving, owner, tiers):
    a = order_active(owner, tiers["1g"])
    server = TritonServer.objects.get(allocation=a)
    deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    user = pwd.getpwnam(server.unix_user)
    assert server.isolation == TritonServer.Isolation.SANDBOX and user.pw_uid != 0
    assert server.unix_user == f"tessera-{django_settings.TESSERA_INSTALLATION_ID}-{a.pk}"
    assert user.pw_gecos == f"tessera slice server {django_settings.TESSERA_INSTALLATION_ID}/allocation-{a.pk}"
    assert os.stat(f"/proc/{serving.runtime().sandbox.server_pid(server.name)}").st_uid == user.pw_uid
    repo = deployments.repo_dir(a)
    st = repo.stat()
    assert st.st_uid == user.pw_uid and stat.S_IMODE(st.st_mode) == 0o700
    assert (repo / "tiny-gen" / "config.pbtxt").stat().st_uid == user.pw_uid


def test_killed_server_is_restarted_by_reconcile_and_models_answer_again(real_serving, owner, tiers):
    a = order_active(owner, tiers["1g"])
    dep = deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    server = TritonServer.objects.get(allocation=a)
    os.kill(server.pid, signal.SIGKILL)
    wait_for(lambda: not serving.runtime().status(serving.spec_for(server, a)).running, 10, "the server to die")
    found = reconcile.reconcile_node(a.node_id)
    assert found["servers_restarted"] == 1 and found["models_reloaded"] == 1, found
    server.refresh_from_db()
    assert server.state == T.RUNNING and server.restarts == 1 and server.last_health_ok
    out = deployments.backend_for(a).infer_text(dep.name, "back again", max_tokens=2)
    assert out["output_tokens"] == 2
    assert DriftEvent.objects.get(kind=DriftEvent.Kind.SERVER_RESTARTED, allocation=a).resolved


def test_release_stops_the_server_and_removes_the_repository(real_serving, owner, tiers):
    a = order_active(owner, tiers["1g"])
    deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    server = TritonServer.objects.get(allocation=a)
    pid, user, repo = server.pid, server.unix_user, deployments.repo_dir(a)
    orders.request_release(owner[1], a)
    assert provisioning.release_allocation(a.pk) == "released"
    assert not Path(f"/proc/{pid}").exists() or b"tritonserver" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert not repo.exists() and not serving.work_dir(a.pk).exists()
    server.refresh_from_db()
    assert server.state == T.STOPPED and server.http_port is None
    if user:
        with pytest.raises(KeyError):
            pwd.getpwnam(user)
    assert Allocation.objects.get(pk=a.pk).state == Allocation.State.RELEASED
    assert ModelDeployment.objects.get(allocation=a).state == D.REMOVED


def test_repository_api_without_the_secret_is_refused_by_triton(real_serving, owner, tiers):
    a = order_active(owner, tiers["1g"])
    deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    server = TritonServer.objects.get(allocation=a)
    spec = serving.spec_for(server, a)
    for headers in (None, {rt.SECRET_HEADER: "guessed"}):
        with HttpTritonBackend(spec.http_url, spec.metrics_url, headers=headers) as anyone:
            with pytest.raises(InferenceServerException, match="restricted"):
                anyone.load_model("tiny-gen")
            with pytest.raises(InferenceServerException, match="restricted"):
                anyone.unload_model("tiny-gen")
            with pytest.raises(InferenceServerException, match="restricted"):
                anyone.repository_index()
            with pytest.raises(InferenceServerException, match="restricted"):
                anyone.infer_text("tiny-gen", "someone else's tokens", max_tokens=2)
            with pytest.raises(InferenceServerException, match="restricted"):
                anyone.statistics("tiny-gen")
            assert not anyone.is_server_ready()  # even health needs the secret
    with serving.client_for(a) as tessera:
        assert [m["name"] for m in tessera.repository_index() if m.get("state") == "READY"] == ["tiny-gen"]
        assert tessera.is_model_ready("tiny-gen")  # still loaded: nothing went through


def test_two_slices_get_distinct_ports_and_cannot_see_each_others_models(real_serving, owner, tiers):
    a = order_active(owner, tiers["1g"])
    b = order_active(owner, tiers["1g"])
    sa, sb = TritonServer.objects.get(allocation=a), TritonServer.objects.get(allocation=b)
    assert not {sa.http_port, sa.grpc_port, sa.metrics_port} & {sb.http_port, sb.grpc_port, sb.metrics_port}
    deploy_ready(owner, a, "only-on-a", template="tiny-gen")
    with serving.client_for(b) as on_b:
        assert "only-on-a" not in {m["name"] for m in on_b.repository_index()}
        with pytest.raises(InferenceServerException):
            on_b.load_model("only-on-a")  # not in b's repository
        assert not on_b.is_model_ready("only-on-a")


def test_model_deployed_before_the_server_is_up_waits_then_ends_ready(real_serving, owner, tiers, settings):
    a = order_active(owner, tiers["1g"])
    serving.stop_server(a, "simulated outage")
    TritonServer.objects.filter(allocation=a).update(state=T.FAILED)
    dep = deployments.deploy(owner[1], a, "tiny-gen", template="tiny-gen")
    with pytest.raises(deployments.WaitingForServer):
        deployments.load(dep.pk)
    dep.refresh_from_db()
    assert dep.state == D.PENDING and dep.waiting_reason == "waiting for the slice's inference server to start"
    serving.ensure_server(Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk))
    assert deployments.load(dep.pk) == "ready"
    dep.refresh_from_db()
    assert dep.state == D.READY and dep.waiting_reason == ""
    # and one that waits too long fails with the reason, and can be retried
    serving.stop_server(a, "simulated outage")
    settings.TESSERA_DEPLOY_WAIT_S = 0
    late = deployments.deploy(owner[1], a, "late", template="tiny-gen")
    assert deployments.load(late.pk) == "failed"
    late.refresh_from_db()
    assert late.state == D.FAILED and "was not up within 0 s" in late.failure_reason
    serving.ensure_server(Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk))
    deployments.retry(owner[1], late)
    assert deployments.load(late.pk) == "ready"
