"""The models journey in a real browser (live server + a real node worker): upload a Triton repository (a bad
one is refused naming the file; one the worker refuses shows why; a good one turns ready), find a tier for a
library model, order it from there, deploy the uploaded model and a library model and see them ready.
Screenshots: portal-repositories, portal-find-tier, portal-models-library."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from marketplace.hardware import model_repo
from marketplace.models import ModelDeployment
from tenants.roles import Role
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier
from tests.unit.test_model_repo import CONFIG, GOOD, WARMUP

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world(node_worker, tmp_path):
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example"))
    tiers = [make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb", hour="0.9000"),
             make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.7000"),
             make_tier("h100-7g", "h100-sxm-80gb", "7g.80gb", hour="6.5000")]
    good = tmp_path / "echo-repo.zip"
    good.write_bytes(model_repo.archive_bytes(GOOD, "zip"))
    bad = tmp_path / "evil.tar.gz"
    bad.write_bytes(model_repo.archive_bytes({**GOOD, "echo/../../../etc/cron.d/x": "x"}))
    warmup_escape = tmp_path / "warm.tar.gz"
    warmup_escape.write_bytes(model_repo.archive_bytes({**GOOD, "echo/config.pbtxt": CONFIG + WARMUP.format(
        "../../../../etc/passwd")}))
    return {"tiers": tiers, "good": good, "bad": bad, "warmup_escape": warmup_escape}


def test_upload_find_a_tier_order_and_deploy(page, shot, login, live_server, world):
    base = live_server.url
    login(page, "owner@alpha.example")

    page.goto(f"{base}/portal/models/repositories/")
    page.fill("#upload-form input[name=name]", "evil")
    page.set_input_files("#upload-form input[name=archive]", str(world["bad"]))
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#upload-error")).to_contain_text("path traversal")
    page.fill("#upload-form input[name=name]", "echo-repo")
    page.set_input_files("#upload-form input[name=archive]", str(world["good"]))
    page.click("#upload-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/models/repositories/$"))
    # stored at once; the worker (control queue) validates it and the table refreshes itself until it is ready
    row = page.locator("#repositories tr", has_text="echo-repo")
    expect(row.locator(".badge").first).to_have_text("ready", timeout=60_000)
    assert "echo · python" in row.inner_text()
    page.fill("#upload-form input[name=name]", "warm-repo")
    page.set_input_files("#upload-form input[name=archive]", str(world["warmup_escape"]))
    page.click("#upload-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/models/repositories/$"))
    row = page.locator("#repositories tr", has_text="warm-repo")
    expect(row.locator(".badge").first).to_have_text("failed", timeout=60_000)
    expect(row.locator(".failure-reason")).to_contain_text("must name a file in the model's warmup/ folder")
    shot(page, "portal-repositories")

    page.goto(f"{base}/portal/find-tier/")
    page.select_option("#find-form select[name=library_model]", "llama-3.1-8b-instruct")
    page.fill("#find-form input[name=context]", "32768")
    page.fill("#find-form input[name=concurrency]", "4")
    page.click("#find-form button[type=submit]")
    rows = page.locator("#tier-options tbody tr")
    expect(rows.first).to_be_visible()
    text = page.locator("#tier-options").inner_text()
    assert "h100-7g" in text and "h100-1g" not in text and "modelled" in text
    shot(page, "portal-find-tier")
    page.locator("#tier-options tbody tr", has_text="h100-7g").locator("button[type=submit]").click()
    page.wait_for_url(re.compile(r"/portal/slices/\d+/$"))
    expect(page.locator("#slice-state")).to_have_text("active", timeout=60_000)
    slice_id = page.url.rstrip("/").split("/")[-1]

    page.goto(f"{base}/portal/models/")
    page.select_option("#deploy-form select[name=allocation]", slice_id)
    repo = page.locator("#deploy-form select[name=repository] option", has_text="echo-repo")
    assert "(called “" in repo.inner_text()  # the name its model is served (and called) by
    page.select_option("#deploy-form select[name=repository]", repo.get_attribute("value"))
    assert page.input_value("#deploy-form input[name=name]") == repo.get_attribute("data-served-as")
    page.click("#deploy-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/models/\d+/$"))
    dep_id = int(page.url.rstrip("/").split("/")[-1])
    expect(page.locator(f"#dep-state-{dep_id}")).to_have_text("ready", timeout=60_000)

    page.goto(f"{base}/portal/models/")
    page.select_option("#deploy-form select[name=allocation]", slice_id)
    page.fill("#deploy-form input[name=name]", "llama8b")
    page.select_option("#deploy-form select[name=library_model]", "llama-3.1-8b-instruct")
    page.fill("#deploy-form input[name=context]", "32768")
    page.fill("#deploy-form input[name=concurrency]", "4")
    page.click("#deploy-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/models/\d+/$"))
    dep_id = int(page.url.rstrip("/").split("/")[-1])
    expect(page.locator(f"#dep-state-{dep_id}")).to_have_text("ready", timeout=60_000)
    page.goto(f"{base}/portal/models/")
    shot(page, "portal-models-library")
    assert ModelDeployment.objects.get(pk=dep_id).spec["fit"]["fits"]
