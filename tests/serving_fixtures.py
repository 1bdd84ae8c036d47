"""Fixtures for tests on real tritonserver processes started by the serving runtime (``process``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning, serving
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory

IS_ROOT = os.geteuid() == 0
SYSTEM_PYTHON = "/usr/bin/python3"


def _system_python_with_numpy() -> bool:
    if not os.path.exists(SYSTEM_PYTHON):
        return False
    return subprocess.run([SYSTEM_PYTHON, "-c", "import numpy"], capture_output=True, check=False).returncode == 0


ISOLATED = IS_ROOT and _system_python_with_numpy()
NOT_ISOLATED_WHY = ("not root: servers run as the worker's user" if not IS_ROOT else
                    f"{SYSTEM_PYTHON} has no numpy (apt-get install python3-numpy, or `make serving-deps`)")


@pytest.fixture(scope="session")
def staged_runtime_dir():
    """One staged copy of tritonserver for the whole run, where per-slice users can read it."""
    path = Path(tempfile.mkdtemp(prefix="tessera-serving-runtime-", dir="/tmp"))
    path.chmod(0o755)
    yield path / "rt"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def real_serving(settings, h100_node, staged_runtime_dir, monkeypatch):
    """The http Triton backend with the process runtime over a serving root other users may traverse."""
    root = Path(tempfile.mkdtemp(prefix="tessera-serving-", dir="/tmp"))
    root.chmod(0o711)
    settings.TESSERA_TRITON_BACKEND = "http"
    settings.TESSERA_SERVING_RUNTIME = "process"
    settings.TESSERA_TRITON_REPO_ROOT = root
    settings.TESSERA_SERVING_RUNTIME_DIR = str(staged_runtime_dir)
    settings.TESSERA_SERVING_ISOLATE = ISOLATED
    settings.TESSERA_TRITON_PYTHON = SYSTEM_PYTHON if ISOLATED else ""
    settings.TESSERA_SERVING_START_TIMEOUT_S = 90
    monkeypatch.setenv("TESSERA_TEST_CANARY", "worker-secret-canary")  # must never reach a server
    serving.reset_runtimes()
    yield root
    for a in Allocation.objects.filter(triton_server__isnull=False).select_related(
            "node", "tier__profile", "tier__gpu_model"):
        serving.stop_server(a, "test teardown")
    serving.reset_runtimes()
    shutil.rmtree(root, ignore_errors=True)


def tenant_owner():
    """A new tenant and its owner's principal."""
    tenant = TenantFactory()
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def order_active(owner, tier) -> Allocation:
    """An order of one slice of ``tier``, provisioned here: the slice is active (its server answers ready)."""
    tenant, p = owner
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    return Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model", "instance__gpu").get(pk=a.pk)


def deploy_ready(owner, a, name, **kwargs) -> ModelDeployment:
    """A model deployed and loaded on the slice: ready."""
    dep = deployments.deploy(owner[1], a, name, **kwargs)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    return dep
