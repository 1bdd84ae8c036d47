"""Fixtures for tests that need the catalog, a simulated node and tiers with prices."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.models import GpuModel, MigProfile, PricePlan, ServerPlatform, Tier
from marketplace.services import fleet, nodes, serving
from marketplace.services.catalog import sync_catalog
from marketplace.services.nodes import sim_discovery


@pytest.fixture
def sim_dir(settings, tmp_path):
    """Simulated NVML state for this test only."""
    from marketplace.hardware.triton import reset_sim_backends

    settings.TESSERA_SIM_DIR = tmp_path / "sim"
    settings.TESSERA_TRITON_REPO_ROOT = tmp_path / "triton"
    settings.TESSERA_UPLOAD_ROOT = tmp_path / "uploads"
    settings.TESSERA_MODEL_STORE_ROOT = tmp_path / "model-store"
    nodes._sims.clear()
    reset_sim_backends()
    serving.reset_runtimes()
    yield tmp_path
    nodes._sims.clear()
    reset_sim_backends()
    serving.reset_runtimes()


@pytest.fixture
def catalog(db):
    from marketplace.services.models import sync_library

    sync_catalog()
    sync_library()  # the migration seeds it too, but a transactional test's flush empties the table


def make_node(hostname="node-a", platform_key="hgx-h100-8"):
    platform = ServerPlatform.objects.get(key=platform_key)
    return fleet.register_node(hostname, platform, sim_discovery(hostname, platform))


def make_tier(key, model_key, profile_name, *, dedicated=False, hour="1.0000", currency="USD",
              since=None) -> Tier:
    model = GpuModel.objects.get(key=model_key)
    profile = MigProfile.objects.get(gpu_model=model, name=profile_name) if profile_name else None
    tier = Tier.objects.create(key=key, name=key, gpu_model=model, profile=profile, dedicated=dedicated)
    PricePlan.objects.create(tier=tier, currency=currency, price_per_slice_hour=Decimal(hour),
                             price_per_1m_input_tokens=Decimal("0.10"), price_per_1m_output_tokens=Decimal("0.40"),
                             effective_from=since or timezone.now() - timedelta(days=1))
    return tier


@pytest.fixture
def h100_node(catalog, sim_dir):
    return make_node()


@pytest.fixture
def tiers(catalog):
    return {
        "1g": make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb"),
        "3g": make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb"),
        "7g": make_tier("h100-7g", "h100-sxm-80gb", "7g.80gb"),
    }
