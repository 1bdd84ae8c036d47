"""Static weight (issue 15): collectstatic writes hashed files with gzip and brotli copies; whitenoise sends
plotly.js brotli- or gzip-encoded with a year-long immutable cache, and the page links the hashed name and a
favicon."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.template import engines
from django.test import RequestFactory, override_settings
from whitenoise.middleware import WhiteNoiseMiddleware


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    with override_settings(STATIC_ROOT=root, WHITENOISE_USE_FINDERS=False):
        call_command("collectstatic", interactive=False, verbosity=0)
        yield root


def _get(path: str, accept: str):
    mw = WhiteNoiseMiddleware(lambda request: None)
    return mw(RequestFactory().get(path, HTTP_ACCEPT_ENCODING=accept))


def test_plotly_is_sent_compressed_with_a_long_immutable_cache(collected):
    with override_settings(STATIC_ROOT=collected, WHITENOISE_USE_FINDERS=False):
        url = engines["django"].from_string("{% load static %}{% static 'vendor/plotly/plotly.min.js' %}").render({})
        assert url.startswith("/static/vendor/plotly/plotly.min.") and url != "/static/vendor/plotly/plotly.min.js"
        raw = (collected / "vendor/plotly/plotly.min.js").stat().st_size
        for accept, encoding in (("gzip, deflate, br", "br"), ("gzip", "gzip")):
            r = _get(url, accept)
            assert r.status_code == 200 and r["Content-Encoding"] == encoding
            assert "immutable" in r["Cache-Control"] and "max-age=315360000" in r["Cache-Control"]
            assert int(r["Content-Length"]) < raw / 3  # 4.8 MB of JavaScript compresses at least 3x
        plain = _get(url, "")
        assert not plain.has_header("Content-Encoding") and int(plain["Content-Length"]) == raw


def test_pages_link_a_favicon(client, operator):
    client.force_login(operator)
    html = client.get("/console/").content.decode()
    assert 'rel="icon"' in html and "favicon" in html
    assert client.get("/static/tessera/favicon.svg").status_code == 200
