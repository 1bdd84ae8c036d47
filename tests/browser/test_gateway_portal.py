"""A tenant finds how to call its model and tries it, in Chromium: the model page shows the gateway endpoint, the
model name and copy-paste calls, and "Try it" sends a prompt through the gateway (in front of simulated slices
that answer Triton's HTTP protocol). Screenshots at desktop and phone width."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from marketplace.gateway import metering
from telemetry.models import UsageEvent
from tenants.models import User

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("width,height", [(1440, 900), (390, 844)])
def test_model_page_shows_how_to_call_it_and_try_it_is_metered(page, shot, login, live_server, gateway_fleet,
                                                               gateway_factory, settings, width, height):
    gw = gateway_factory()
    settings.TESSERA_GATEWAY_INTERNAL_URL = gw.url
    settings.TESSERA_GATEWAY_URL = "https://inference.msp.example"
    owner = gateway_fleet["a_owner"][1].user
    User.objects.filter(pk=owner.pk).update(password=_hash())
    page.set_viewport_size({"width": width, "height": height})
    login(page, owner.email)
    page.goto(f"{live_server.url}/portal/models/{gateway_fleet['gen'].pk}/")
    expect(page.locator("#gateway-url")).to_have_text("https://inference.msp.example/v1")
    assert page.locator("#model-name").inner_text() == "tiny-gen"
    assert '"model": "tiny-gen"' in page.locator("#example-curl").inner_text()
    page.fill("#try-prompt", "which slice serves this")
    page.fill("#try-max-tokens", "6")
    page.click("#try-send")
    expect(page.locator("#try-answer")).to_contain_text("6 output tokens")
    shot(page, f"portal-model-try-it-{width}")
    assert page.evaluate("document.documentElement.scrollWidth") <= width  # nothing wider than the viewport
    shot(page, f"portal-model-try-it-{width}")
    metering.consume(budget_s=10)
    ev = UsageEvent.objects.get(deployment=gateway_fleet["gen"])
    assert ev.output_tokens == 6 and ev.input_tokens == 6  # "user: which slice serves this\nassistant:"


def _hash():
    from django.contrib.auth.hashers import make_password

    return make_password("pw-Secret-123")
