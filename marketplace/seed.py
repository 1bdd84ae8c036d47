"""Demo seed for catalog and fleet: the catalog file, four 8-GPU nodes discovered through the
simulated NVML, and a few slices for the demo tenants. Idempotent."""

from __future__ import annotations

from django.db import transaction

from marketplace.hardware.nvml_sim import SimNvml
from marketplace.models import GpuInstance, GpuModel, MigProfile, Node, ServerPlatform
from marketplace.services import fleet
from marketplace.services.catalog import sync_catalog
from tenants.models import Tenant

DEMO_NODES = [
    ("gpu-h100-01", "hgx-h100-8"),
    ("gpu-h100-02", "hgx-h100-8"),
    ("gpu-h200-01", "hgx-h200-8"),
    ("gpu-h200-02", "hgx-h200-8"),
]

# tenant slug -> [(gpu model key, profile name or None for whole GPU, dedicated)]
DEMO_SLICES = {
    "acme-ai": [("h200-sxm-141gb", "3g.71gb", False), ("h200-sxm-141gb", "3g.71gb", False),
                ("h100-sxm-80gb", "1g.10gb", False)],
    "borealis": [("h100-sxm-80gb", "2g.20gb", False), ("h100-sxm-80gb", "4g.40gb", False),
                 ("h100-sxm-80gb", "1g.10gb", False)],
    "cobalt-health": [("h200-sxm-141gb", "7g.141gb", True)],
    "dynamo-search": [("h100-sxm-80gb", "1g.20gb", False), ("h200-sxm-141gb", "2g.35gb", False)],
}


def sim_discovery(hostname: str, platform: ServerPlatform) -> list[fleet.DiscoveredGpu]:
    """What a node worker with the simulated backend reports for this node (same UUIDs)."""
    from marketplace.hardware.nvml import NvmlClient

    backend = SimNvml(fleet=[platform.gpu_model.key] * platform.gpu_count, node=hostname)
    with NvmlClient(backend) as client:
        return fleet.discover(client)


@transaction.atomic
def seed_fleet() -> dict[str, int]:
    sync_catalog()
    for hostname, platform_key in DEMO_NODES:
        platform = ServerPlatform.objects.select_related("gpu_model").get(key=platform_key)
        if not Node.objects.filter(hostname=hostname).exists():
            fleet.register_node(hostname, platform, sim_discovery(hostname, platform))
    if not GpuInstance.objects.exists():
        for slug, wants in DEMO_SLICES.items():
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                continue
            for model_key, profile_name, dedicated in wants:
                model = GpuModel.objects.get(key=model_key)
                profile = MigProfile.objects.get(gpu_model=model, name=profile_name) if profile_name else None
                fleet.place_instance(tenant, model, profile, dedicated=dedicated)
    return {"nodes": Node.objects.count(), "instances": GpuInstance.objects.count()}
