"""Demo seed for catalog, fleet and offers: the catalog file, four 8-GPU nodes discovered through
the simulated NVML, tiers with price plans, and a few orders for the demo tenants (provisioned by the
embedded worker). Idempotent."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from marketplace.models import Allocation, GpuModel, MigProfile, Node, Order, PricePlan, ServerPlatform, Tier
from marketplace.services import fleet, nodes, orders
from marketplace.services.catalog import sync_catalog
from tenants.models import Tenant, User
from tenants.scoping import principal_for_user

DEMO_NODES = [
    ("gpu-h100-01", "hgx-h100-8"),
    ("gpu-h100-02", "hgx-h100-8"),
    ("gpu-h200-01", "hgx-h200-8"),
    ("gpu-h200-02", "hgx-h200-8"),
]

# H100 on-demand $2.49/GPU-h, H200 $3.59/GPU-h (specialty-cloud on-demand prices, 2025: Lambda's and RunPod's
# public price lists, https://lambda.ai/pricing , https://www.runpod.io/pricing ); a slice is priced pro rata by
# its compute slices (g/7), tokens per 1M.
GPU_HOUR = {"h100-sxm-80gb": Decimal("2.49"), "h200-sxm-141gb": Decimal("3.59")}
TOKENS = {"h100-sxm-80gb": (Decimal("0.10"), Decimal("0.40")), "h200-sxm-141gb": (Decimal("0.08"), Decimal("0.32"))}
# key, name, gpu model, profile (None = whole GPU), dedicated
TIERS = [
    ("h100-1g-10gb", "H100 starter 1g.10gb", "h100-sxm-80gb", "1g.10gb", False),
    ("h100-2g-20gb", "H100 standard 2g.20gb", "h100-sxm-80gb", "2g.20gb", False),
    ("h100-3g-40gb", "H100 standard 3g.40gb", "h100-sxm-80gb", "3g.40gb", False),
    ("h100-7g-80gb", "H100 full-slice 7g.80gb", "h100-sxm-80gb", "7g.80gb", False),
    ("h100-whole", "H100 whole GPU (MIG off)", "h100-sxm-80gb", None, True),
    ("h200-1g-18gb", "H200 starter 1g.18gb", "h200-sxm-141gb", "1g.18gb", False),
    ("h200-2g-35gb", "H200 standard 2g.35gb", "h200-sxm-141gb", "2g.35gb", False),
    ("h200-3g-71gb", "H200 premium 3g.71gb", "h200-sxm-141gb", "3g.71gb", False),
    ("h200-7g-141gb", "H200 dedicated 7g.141gb", "h200-sxm-141gb", "7g.141gb", True),
]
FX = {"USD": Decimal("1"), "EUR": Decimal("0.92"), "GBP": Decimal("0.79")}
# tenant slug -> [(tier key, quantity)]
DEMO_ORDERS = {
    "acme-ai": [("h200-3g-71gb", 2), ("h100-1g-10gb", 1)],
    "borealis": [("h100-2g-20gb", 1), ("h100-3g-40gb", 1), ("h100-1g-10gb", 1)],
    "cobalt-health": [("h200-7g-141gb", 1)],
    "dynamo-search": [("h100-whole", 1), ("h200-2g-35gb", 1)],
}
MIG_OFF = {"gpu-h100-02": {6, 7}}  # sold as whole GPUs


def seed_tiers() -> None:
    epoch = timezone.now() - timedelta(days=60)  # seeded prices have been in force for a while
    for key, name, model_key, profile_name, dedicated in TIERS:
        model = GpuModel.objects.get(key=model_key)
        profile = MigProfile.objects.get(gpu_model=model, name=profile_name) if profile_name else None
        tier, _ = Tier.objects.get_or_create(key=key, defaults={
            "name": name, "gpu_model": model, "profile": profile, "dedicated": dedicated})
        share = Decimal(profile.compute_slices if profile else 7) / 7
        for currency, fx in FX.items():
            hour = (GPU_HOUR[model_key] * share * fx).quantize(Decimal("0.0001"))
            tin, tout = (p * fx for p in TOKENS[model_key])
            PricePlan.objects.get_or_create(tier=tier, kind=PricePlan.Kind.ON_DEMAND, currency=currency,
                                            effective_from=epoch, defaults={
                                                "price_per_slice_hour": hour, "price_per_1m_input_tokens": tin,
                                                "price_per_1m_output_tokens": tout})
            PricePlan.objects.get_or_create(tier=tier, kind=PricePlan.Kind.RESERVED, currency=currency,
                                            effective_from=epoch, defaults={
                                                "price_per_slice_hour": (hour * Decimal("0.7")).quantize(
                                                    Decimal("0.0001")),
                                                "price_per_1m_input_tokens": tin, "price_per_1m_output_tokens": tout,
                                                "monthly_commit": (hour * Decimal("0.7") * 730).quantize(
                                                    Decimal("0.01"))})


def seed_fleet() -> dict[str, int]:
    with transaction.atomic():
        sync_catalog()
        from marketplace.services.models import sync_library

        sync_library()
        for hostname, platform_key in DEMO_NODES:
            platform = ServerPlatform.objects.select_related("gpu_model").get(key=platform_key)
            if not Node.objects.filter(hostname=hostname).exists():
                gpus = nodes.sim_discovery(hostname, platform, MIG_OFF.get(hostname, set()))
                fleet.register_node(hostname, platform, gpus)
        seed_tiers()
    if not Order.objects.exists():
        operator = principal_for_user(User.objects.filter(is_staff=True).order_by("pk").first())
        for slug, wants in DEMO_ORDERS.items():
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                continue
            for tier_key, quantity in wants:
                orders.create_order(operator, tenant=tenant, tier=Tier.objects.get(key=tier_key), quantity=quantity,
                                    idempotency_key=f"demo-{tier_key}")
    return {"nodes": Node.objects.count(), "allocations": Allocation.objects.count()}
