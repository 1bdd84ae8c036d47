"""A tenant's model deployed through Tessera's services onto a REAL tritonserver serving the
slice's model repository: write repo -> load -> ready -> infer -> statistics -> unload."""

from __future__ import annotations

import pytest

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory
from tests.triton_server import tritonserver_available
from tests.worker_process import wait_for

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db,
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]
D = ModelDeployment.State


def test_deploy_on_a_real_triton_server(real_serving, h100_node, tiers):
    tenant = TenantFactory()
    p = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(p, tenant=tenant, tier=tiers["3g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated"  # the slice's server started and answered ready
    a = Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk)
    d1 = deployments.deploy(p, a, "tiny-gen", template="tiny-gen")
    d2 = deployments.deploy(p, a, "tiny-gen-b", template="tiny-gen", spec={"memory_mb": 128})
    assert deployments.load(d1.pk) == "ready" and deployments.load(d2.pk) == "ready"
    server = deployments.backend_for(a)
    assert server.is_model_ready("tiny-gen") and server.is_model_ready("tiny-gen-b")
    outs = [server.infer_text("tiny-gen", "tokens are metered per tenant", max_tokens=5) for _ in range(3)]
    assert all(o["input_tokens"] == 5 and o["output_tokens"] == 5 and o["text"] for o in outs)
    # statistics are recorded when Triton releases a request, a moment after the response
    wait_for(lambda: server.statistics("tiny-gen")["inference_count"] >= 3, 10, "statistics to count 3")
    assert server.statistics("tiny-gen")["inference_count"] == 3
    assert server.statistics("tiny-gen-b")["inference_count"] == 0
    line = 'nv_inference_count{model="tiny-gen",version="1"} 3'
    wait_for(lambda: line in server.metrics_text(), 10, "Triton's metrics to show the 3 inferences")
    deployments.remove(p, d1)
    assert deployments.unload(d1.pk) == "removed"
    assert not server.is_model_ready("tiny-gen") and server.is_model_ready("tiny-gen-b")
    # a model whose files vanished from the repository fails to load, with Triton's reason
    d3 = deployments.deploy(p, a, "broken", template="tiny-gen")
    ModelDeployment.objects.filter(pk=d3.pk).update(spec={**d3.spec, "files": {}})
    assert deployments.load(d3.pk) == "failed"
    d3.refresh_from_db()
    assert d3.state == D.FAILED and "Triton refused" in d3.failure_reason
