"""The management commands an operator runs by hand: register_node (simulated backend here) and demo's
seeding; and the factories the billing tests build on."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from marketplace.models import Gpu, Node
from marketplace.services import billing
from tests.factories import AllocationFactory, DeploymentFactory, InvoiceFactory, OrderFactory

pytestmark = pytest.mark.django_db


def test_register_node_registers_the_simulated_gpus_under_the_normalized_name(catalog, sim_dir, settings):
    settings.TESSERA_NVML_BACKEND = "sim"
    out = StringIO()
    call_command("register_node", "--platform", "hgx-h200-8", "--hostname", " GPU-Node-7 ", stdout=out)
    node = Node.objects.get()
    assert node.hostname == "gpu-node-7" and node.platform.key == "hgx-h200-8"
    gpus = list(Gpu.objects.filter(node=node).order_by("index"))
    assert len(gpus) == 8 and {g.gpu_model.key for g in gpus} == {"h200-sxm-141gb"}
    assert f"-Q {node.queue}" in out.getvalue() and "registered gpu-node-7: 8 x" in out.getvalue()
    # registering again (same name, any case) updates the node: the simulated UUIDs follow its name
    call_command("register_node", "--platform", "hgx-h200-8", "--hostname", "gpu-node-7", stdout=StringIO())
    assert Node.objects.count() == 1 and Gpu.objects.count() == 8


def test_register_node_refuses_an_unknown_platform(catalog, sim_dir, settings):
    settings.TESSERA_NVML_BACKEND = "sim"
    with pytest.raises(CommandError, match="unknown platform 'dgx-z9'; one of: .*hgx-h100-8"):
        call_command("register_node", "--platform", "dgx-z9", "--hostname", "n1", stdout=StringIO())
    assert not Node.objects.exists()


def test_demo_no_run_seeds_the_fleet_and_logins(tmp_path, settings, sim_dir):
    settings.TESSERA_VAR_DIR = tmp_path
    out = StringIO()
    call_command("demo", "--no-run", stdout=out)
    text = out.getvalue()
    assert "simulated fleet: 4 nodes" in text and "operator@tessera.local" in text
    assert Node.objects.count() == 4


def test_demo_runs_webhooks_on_a_worker_of_their_own(h100_node):
    """The embedded worker (control queue, beat, every node) never consumes the webhooks queue: a tenant's slow
    endpoint would hold the only process that consumes usage. A second worker, with threads, does."""
    from unittest import mock

    from marketplace.management.commands import demo

    command = demo.Command(stdout=StringIO())
    with mock.patch.object(demo.subprocess, "Popen") as popen:
        command._start_worker()
        command._start_webhooks_worker()
    embedded, hooks = (c.args[0] for c in popen.call_args_list)
    assert "-B" in embedded and embedded[embedded.index("-Q") + 1].split(",") == ["control", h100_node.queue]
    assert "-B" not in hooks and hooks[hooks.index("-Q") + 1] == "webhooks"
    assert hooks[hooks.index("-P") + 1] == "threads"


def test_factories_build_a_consistent_billable_month(tiers):
    dep = DeploymentFactory(allocation=AllocationFactory(order=OrderFactory(tier=tiers["1g"])))
    alloc = dep.allocation
    assert dep.tenant == alloc.tenant == alloc.order.tenant and alloc.tier == tiers["1g"]
    inv = InvoiceFactory(tenant=dep.tenant)
    assert inv.period_start.day == 1 and inv.period_end > inv.period_start
    assert (inv.period_end - inv.period_start) >= timedelta(days=28) and inv.currency == dep.tenant.currency
    assert billing.month_of(alloc.activated_at) == inv.period_start
