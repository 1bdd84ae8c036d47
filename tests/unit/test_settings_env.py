"""Documented environment variables are read and change behaviour (each in a fresh interpreter, since
settings are read once at start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, django
django.setup()
from marketplace.models import GpuModel, MigProfile
from marketplace.selectors.catalog import modelled_tokens_per_s
from marketplace.services import netguard
from telemetry.services.energy import price_per_kwh
import ipaddress
gpu = GpuModel(key="x", name="x", bandwidth_tbps="3.35", compute_slices=7)
print(json.dumps({
    "kwh": str(price_per_kwh()),
    "tps": modelled_tokens_per_s(gpu, MigProfile(compute_slices=7)),
    "loopback_refused": netguard.refusal(ipaddress.ip_address("127.0.0.1")) is not None,
}))
"""


def probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    base.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default():
    return probe()


def test_energy_price_per_kwh_is_read(default):
    assert default["kwh"] == "0.12"
    assert probe(TESSERA_ENERGY_PRICE_PER_KWH="0.50")["kwh"] == "0.50"


def test_tokens_per_s_per_tbps_is_read(default):
    assert default["tps"] == pytest.approx(3000 * 3.35)
    assert probe(TESSERA_TOKENS_PER_S_PER_TBPS="1000")["tps"] == pytest.approx(1000 * 3.35)


def test_webhook_allow_networks_is_read(default):
    assert default["loopback_refused"] is True
    assert probe(TESSERA_WEBHOOK_ALLOW_NETWORKS="127.0.0.0/8")["loopback_refused"] is False
