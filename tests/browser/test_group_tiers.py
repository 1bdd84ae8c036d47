"""A multi-GPU tier in a real browser: the operator creates "2x H100" in the console's tier form (whole GPUs,
2 per allocation); a MIG profile with several GPUs is refused next to the field."""

from __future__ import annotations

import pytest

from marketplace.models import MigProfile, Tier
from tests.factories import OperatorFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_operator_creates_a_two_gpu_tier(browser, page, live_server, login, shot, catalog):
    base = live_server.url
    op = OperatorFactory(email="ops@msp.example")
    login(page, op.email)
    for width in (1440, 390):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"{base}/console/tiers/new/")
        assert page.locator("label[for=id_gpu_count]").inner_text().startswith("GPUs per allocation")
        shot(page, f"console-tier-create-gpus-{width}")
    page.set_viewport_size({"width": 1440, "height": 900})
    page.fill("#id_key", "h100-x2")
    page.fill("#id_name", "2x H100 (TP=2)")
    page.select_option("#id_gpu_model", label="H100 SXM 80GB")
    page.select_option("#id_gpu_count", "2")
    page.select_option("#id_profile", label="h100-sxm-80gb 1g.10gb")
    page.click("#create")
    field = page.locator(".field.has-error", has=page.locator("#id_gpu_count"))
    assert "whole GPUs" in field.inner_text()
    shot(page, "console-tier-create-gpus-error")
    page.select_option("#id_profile", "")
    page.click("#create")
    page.wait_for_url(f"{base}/console/tiers/*/")
    tier = Tier.objects.get(key="h100-x2")
    assert tier.gpu_count == 2 and tier.profile is None
    assert MigProfile.objects.exists()
