"""Reconcile reloads a model the slice's Triton server lost (a restarted server in explicit model
control mode loads nothing by itself), and reports a server that does not answer."""

from __future__ import annotations

import pytest

from marketplace.hardware.runtime import RuntimeFault
from marketplace.hardware.triton import reset_sim_backends
from marketplace.models import DriftEvent, ModelDeployment, TritonServer
from marketplace.services import deployments, reconcile, serving
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


def test_dead_server_is_restarted_and_its_models_loaded_again(ready):
    dep, node = ready
    server = TritonServer.objects.get(allocation=dep.allocation)
    serving.runtime().kill(serving.spec_for(server, dep.allocation))  # kill -9: the models are gone with it
    assert not deployments.backend_for(dep.allocation).is_server_ready()
    found = reconcile.reconcile_node(node.pk)
    assert found["servers_restarted"] == 1 and found["models_reloaded"] == 1 and found["errors"] == 0
    server.refresh_from_db()
    assert server.state == TritonServer.State.RUNNING and server.restarts == 1 and server.last_health_ok
    restarted = DriftEvent.objects.get(kind=DriftEvent.Kind.SERVER_RESTARTED)
    assert restarted.resolved and "exit code -9" in restarted.detail
    out = deployments.backend_for(dep.allocation).infer_text(dep.name, "back again", max_tokens=2)
    assert out["output_tokens"] == 2
    assert ModelDeployment.objects.get(pk=dep.pk).state == ModelDeployment.State.READY


def test_server_that_cannot_be_restarted_stays_an_unresolved_drift(ready, monkeypatch):
    dep, node = ready
    server = TritonServer.objects.get(allocation=dep.allocation)
    run = serving.runtime()
    run.kill(serving.spec_for(server, dep.allocation))

    def refuse(spec):
        raise RuntimeFault("could not start /opt/tritonserver/bin/tritonserver: [Errno 2] No such file")

    monkeypatch.setattr(run, "start", refuse)
    found = reconcile.reconcile_node(node.pk)
    assert found["servers_restarted"] == 0 and found["errors"] == 1
    event = DriftEvent.objects.get(kind=DriftEvent.Kind.SERVER_RESTARTED)
    assert not event.resolved and "No such file" in event.detail
    server.refresh_from_db()
    assert server.state == TritonServer.State.FAILED and "No such file" in server.reason
    assert ModelDeployment.objects.get(pk=dep.pk).state == ModelDeployment.State.READY  # not reloaded nowhere
