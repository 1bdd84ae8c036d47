"""Error answers people and clients get: the site's own pages with a way back, JSON under /api/, the API root."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db


def test_unknown_page_is_the_sites_404_with_a_way_back(client, members_a):
    client.force_login(members_a["owner"])
    r = client.get("/portal/no-such-page/")
    body = r.content.decode()
    assert r.status_code == 404 and "Page not found" in body and 'class="topbar"' in body
    assert 'href="/portal/" id="error-home"' in body


def test_forbidden_is_the_sites_403(client, members_a):
    client.force_login(members_a["owner"])
    r = client.get("/console/")  # the console is for operators
    assert r.status_code == 403 and "You cannot open this page" in r.content.decode()
    assert 'href="/portal/" id="error-home"' in r.content.decode()


def test_api_404_and_500_are_json():
    r = Client().get("/api/v1/no-such-collection/")
    assert r.status_code == 404 and r.json() == {"detail": "Not found."}


@override_settings(DEBUG=False)
def test_server_error_page_renders_without_a_request_context(rf):
    from marketplace.web.errors import server_error

    r = server_error(rf.get("/portal/"))
    assert r.status_code == 500 and b"Something went wrong" in r.content
    r = server_error(rf.get("/api/v1/tiers/"))
    assert r.status_code == 500 and r["Content-Type"] == "application/json"


def test_api_root_lists_its_collections(client, members_a):
    assert client.get("/api/v1/").status_code in (401, 403)
    client.force_login(members_a["viewer"])
    r = client.get("/api/v1/")
    assert r.status_code == 200
    links = r.json()["collections"]
    assert {"tier", "allocation", "invoice", "deployment", "apikey"} <= set(links)
    assert links["tier"].endswith("/api/v1/tiers/") and r.json()["schema"].endswith("/api/schema/")
