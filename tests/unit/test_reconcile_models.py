"""Reconcile reloads a model the slice's Triton server lost (a restarted server in explicit model
control mode loads nothing by itself), and reports a server that does not answer."""

from __future__ import annotations

import pytest

from marketplace.hardware.triton import reset_sim_backends
from marketplace.models import DriftEvent, ModelDeployment
from marketplace.services import deployments, reconcile
from tenants.roles import Role
from tests.unit.test_scrape import _deploy

pytestmark = pytest.mark.django_db


@pytest.fixture
def ready(world, members_a, h100_node, tiers):
    return _deploy(members_a[Role.OWNER], world["a"], tiers["1g"]), h100_node


def test_lost_model_is_loaded_again(ready):
    dep, node = ready
    assert reconcile.reconcile_node(node.pk)["models_reloaded"] == 0  # loaded: nothing to do
    reset_sim_backends()  # the slice's server restarted: it has the repository but no model loaded
    assert not deployments.backend_for(dep.allocation).is_model_ready(dep.name)
    found = reconcile.reconcile_node(node.pk)
    assert found["models_reloaded"] == 1 and found["errors"] == 0
    assert deployments.backend_for(dep.allocation).is_model_ready(dep.name)
    assert ModelDeployment.objects.get(pk=dep.pk).state == ModelDeployment.State.READY
    event = DriftEvent.objects.get(kind=DriftEvent.Kind.MODEL_RELOADED)
    assert event.allocation_id == dep.allocation_id and event.resolved and "loaded again: ready" in event.detail
    out = deployments.backend_for(dep.allocation).infer_text(dep.name, "serving again", max_tokens=2)
    assert out["output_tokens"] == 2
    assert reconcile.reconcile_node(node.pk)["models_reloaded"] == 0


def test_unreachable_server_is_reported_not_reloaded(ready):
    dep, node = ready
    deployments.backend_for(dep.allocation).server_ready = False  # the simulated server is down
    found = reconcile.reconcile_node(node.pk)
    assert found["errors"] == 1 and found["models_reloaded"] == 0
    event = DriftEvent.objects.get(kind=DriftEvent.Kind.ERROR)
    assert not event.resolved and f"model {dep.name}" in event.detail
    assert ModelDeployment.objects.get(pk=dep.pk).state == ModelDeployment.State.READY
