"""Navigation and code examples on a phone and a desktop (issue 34): at 390 px the top navigation collapses behind a
Menu button that opens it; at 1440 px it is in the bar, with no button. Code examples have copy buttons."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from marketplace.models import Allocation, ModelDeployment, Order
from tenants.roles import Role
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def owner(catalog):
    tenant = TenantFactory(slug="alpha", name="Alpha Labs")
    user = UserFactory(email="owner@alpha.example")
    MembershipFactory(tenant=tenant, user=user, role=Role.OWNER)
    tier = make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb")
    o = Order.objects.create(tenant=tenant, tier=tier)
    a = Allocation.objects.create(order=o, tenant=tenant, tier=tier, state=Allocation.State.ACTIVE)
    dep = ModelDeployment.objects.create(allocation=a, tenant=tenant, name="tiny-gen", backend="python", spec={},
                                         memory_mb=100, state=ModelDeployment.State.READY)
    return user, dep


def test_the_menu_collapses_on_a_phone_and_not_on_a_desktop(page, login, live_server, owner, shot):
    user, dep = owner
    page.set_viewport_size({"width": 390, "height": 844})
    login(page, user.email)
    page.goto(f"{live_server.url}/portal/models/{dep.pk}/")
    toggle = page.locator("[data-menu-toggle]")
    expect(toggle).to_be_visible()
    expect(page.locator("nav.mainnav")).to_be_hidden()
    expect(page.locator("form.who")).to_be_hidden()
    shot(page, "nav-phone-closed")
    hint = page.locator("#model-traffic .scroll-hint")  # the traffic table is wider than a phone: it says so
    expect(hint).to_contain_text("scroll the table sideways")
    first = page.locator("#model-traffic table tbody tr >> nth=0 >> td >> nth=0")
    x0 = first.bounding_box()["x"]
    page.locator("#model-traffic .table-wrap").evaluate("w => w.scrollLeft = w.scrollWidth")
    assert abs(first.bounding_box()["x"] - x0) < 1  # its first column stays in view
    shot(page, "table-scrolled-phone")
    top = page.locator(".topbar").bounding_box()
    assert top["height"] < 80, top  # one line, not four lines of links
    toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    expect(page.locator("nav.mainnav >> text=Invoices")).to_be_visible()
    expect(page.locator("form.who button[type=submit]")).to_be_visible()
    shot(page, "nav-phone-open")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.click("nav.mainnav >> text=Invoices")
    page.wait_for_url("**/portal/invoices/")
    expect(page.locator("nav.mainnav")).to_be_hidden()  # closed again on the next page

    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(f"{live_server.url}/portal/models/{dep.pk}/")
    expect(page.locator("[data-menu-toggle]")).to_be_hidden()
    expect(page.locator("#model-traffic .scroll-hint")).to_have_count(0)  # it fits: no hint
    expect(page.locator("nav.mainnav >> text=Invoices")).to_be_visible()
    expect(page.locator("form.who button[type=submit]")).to_be_visible()
    copy = page.locator('[data-copy="#example-curl"]')
    expect(copy).to_be_visible()
    shot(page, "model-page-copy-1440")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    copy.click()  # localhost is a secure context: the Clipboard API takes it
    expect(page.locator("#example-curl-status")).to_have_text("Copied to the clipboard.")
    expect(copy).to_have_text("Copied")
    assert '"model": "tiny-gen"' in page.evaluate("navigator.clipboard.readText()")


def test_choosing_a_repository_fills_the_name_it_is_served_by(page, login, live_server, owner, shot):
    """The deploy form asked for a name and then refused any but the repository model's own: choosing a repository
    now fills that name (read-only) and says why; choosing none frees the field again."""
    from marketplace.models import ModelRepository, UploadState

    user, dep = owner
    ModelRepository.objects.create(tenant=dep.tenant, name="my-echo-repo", source="upload", size_bytes=1,
                                   file_count=1, path="alpha/echo", state=UploadState.READY,
                                   manifest=[{"name": "echo", "backend": "python", "inputs": [], "outputs": []}])
    login(page, user.email)
    for width in (1440, 390):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"{live_server.url}/portal/models/")
        name = page.locator("#deploy-name")
        expect(page.locator("select[name=repository] option", has_text="called “echo”")).to_have_count(1)
        page.select_option("select[name=repository]", label="my-echo-repo (called “echo”)")
        expect(name).to_have_value("echo")
        assert name.evaluate("e => e.readOnly")
        expect(page.locator("#deploy-name-help")).to_contain_text("keeps its own name")
        shot(page, f"deploy-form-repository-{width}")
        page.select_option("select[name=repository]", value="")
        expect(name).to_have_value("")
        assert not name.evaluate("e => e.readOnly")
