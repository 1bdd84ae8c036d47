"""One GPU naming on every page: "<node> · GPU <NVML index>" (models.Gpu.label, the gpu_label filter),
in the console's nodes, allocation and drift pages, the charts and the placement engine's reasons."""

from __future__ import annotations

import re

import pytest
from django.template import Context, Template
from django.urls import reverse

from marketplace.models import DriftEvent, Gpu
from marketplace.services import orders
from tenants.scoping import principal_for_user

pytestmark = pytest.mark.django_db

OTHER_NAMINGS = re.compile(r"/gpu\d|\bgpu\d|GPU \d+ \(node \d+\)")


@pytest.fixture
def placed(h100_node, tiers, world, operator, client):
    client.force_login(operator)
    order = orders.create_order(principal_for_user(operator), tenant=world["a"], tier=tiers["1g"], quantity=2)
    return list(order.allocations.select_related("instance__gpu__node").order_by("pk"))


def test_label_and_filter_agree(h100_node):
    gpu = Gpu.objects.select_related("node").get(node=h100_node, index=3)
    assert gpu.label == str(gpu) == "node-a · GPU 3"
    html = Template("{{ g|gpu_label }}|{{ host|gpu_label:3 }}").render(Context({"g": gpu, "host": "node-a"}))
    assert html == "node-a · GPU 3|node-a · GPU 3"


def test_placement_reason_names_the_gpu_the_same_way(placed):
    a = placed[0]
    a.refresh_from_db()
    assert a.instance.gpu.label in a.placement_detail  # the operator's explanation
    assert not OTHER_NAMINGS.search(a.placement_detail + a.placement_reason)


def test_console_pages_use_the_one_naming(client, placed, h100_node):
    DriftEvent.objects.create(node=h100_node, gpu_index=2, kind=DriftEvent.Kind.ORPHAN_DESTROYED, detail="x")
    a = placed[0]
    pages = {
        "nodes": reverse("console:nodes"),
        "allocation": reverse("console:allocation_detail", args=[a.pk]),
        "drift": reverse("console:allocation_drift") + "?resolved=all",
        "overview": reverse("console:overview"),
    }
    for name, url in pages.items():
        html = client.get(url).content.decode()
        assert not OTHER_NAMINGS.search(html), (name, OTHER_NAMINGS.search(html).group(0))
        if name == "drift":
            assert "node-a · GPU 2" in html, name
    assert a.instance.gpu.label in client.get(pages["allocation"]).content.decode()
    assert "node-a · GPU 7" in client.get(pages["nodes"]).content.decode()
