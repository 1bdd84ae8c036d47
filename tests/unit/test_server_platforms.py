"""The server platforms in the catalog: sourced specs, a node registered on one, its GPUs agreeing."""

from __future__ import annotations

import json

import pytest

from marketplace.hardware.geometry import raw_catalog
from marketplace.models import ServerPlatform
from marketplace.selectors.catalog import platforms_by_gpu_model
from marketplace.services import fleet
from marketplace.services.nodes import sim_discovery
from tenants.errors import ServiceError
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db


def test_every_platform_in_the_data_names_its_source():
    data = raw_catalog()
    keys = {p["key"] for p in data["platforms"]}
    assert {"hgx-h100-8", "hgx-h200-8", "dell-xe9680-h100", "hpe-xd685-h200", "smc-821ge-tnhr-h100",
            "smc-821ge-tnhr-h200"} <= keys
    for p in data["platforms"]:
        assert p["source_url"].startswith(("https://", "http://")), p["key"]
        for tag in p["source"].split(", "):
            assert tag in data["sources"], (p["key"], tag)
        assert p["vendor"] and p["model"] and p["interconnect"], p["key"]


def test_sync_stores_the_specs(catalog):
    xe = ServerPlatform.objects.select_related("gpu_model").get(key="dell-xe9680-h100")
    assert (xe.vendor, xe.model, xe.gpu_model.key, xe.gpu_count) == ("Dell", "PowerEdge XE9680", "h100-sxm-80gb", 8)
    assert "Xeon" in xe.cpu and "19,200 W" in xe.power and xe.source_url.startswith("https://")
    hpe = ServerPlatform.objects.get(key="hpe-xd685-h200")
    assert hpe.gpu_model.key == "h200-sxm-141gb" and hpe.vendor == "HPE"


def test_a_node_registers_on_an_oem_platform(catalog):
    node = make_node("xe-01", "dell-xe9680-h100")
    assert node.platform.key == "dell-xe9680-h100" and node.gpus.count() == 8
    by_model = platforms_by_gpu_model(in_fleet_only=True)
    assert [p.key for p in by_model[node.platform.gpu_model_id]] == ["dell-xe9680-h100"]
    assert by_model[node.platform.gpu_model_id][0].node_count == 1


def test_gpus_that_disagree_with_the_platform_are_refused(catalog):
    xd685 = ServerPlatform.objects.get(key="hpe-xd685-h200")
    h100s = sim_discovery("wrong-01", ServerPlatform.objects.get(key="dell-xe9680-h100"))
    with pytest.raises(ServiceError, match="H200"):
        fleet.register_node("wrong-01", xd685, h100s)
    with pytest.raises(ServiceError, match="8 GPUs; the node reports 7"):
        fleet.register_node("wrong-01", xd685, sim_discovery("wrong-01", xd685)[:7])


def test_platforms_by_gpu_model_is_one_query(catalog, django_assert_num_queries):
    make_node("a-01", "hgx-h100-8")
    make_node("a-02", "smc-821ge-tnhr-h200")
    with django_assert_num_queries(1):
        out = platforms_by_gpu_model()
    assert sum(len(v) for v in out.values()) == ServerPlatform.objects.count()
    json.dumps({k: [p.key for p in v] for k, v in out.items()})


def test_register_node_command_takes_an_oem_platform(catalog, settings):
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    settings.TESSERA_NVML_BACKEND = "sim"
    out = StringIO()
    call_command("register_node", "--platform", "smc-821ge-tnhr-h100", "--hostname", "smc-01", stdout=out)
    assert "8 x H100 SXM 80GB" in out.getvalue()
    with pytest.raises(CommandError, match="hpe-xd685-h200"):
        call_command("register_node", "--platform", "nope", "--hostname", "smc-02")
