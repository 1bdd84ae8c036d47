"""The one navigation: what the signed-in person may open, by role."""

from __future__ import annotations

from tenants.scoping import principal_for

CONSOLE = [
    ("console:overview", "Overview"), ("console:nodes", "Nodes & GPUs"), ("console:allocations", "Allocations"),
    ("console:tenants", "Tenants"), ("console:tiers", "Tiers & prices"), ("console:invoices", "Invoices"),
    ("console:deployments", "Deployments"), ("console:charts", "Charts"), ("console:planner", "Planner"),
    ("console:audit", "Audit log"),
]
PORTAL = [
    ("portal:home", "Overview"), ("portal:catalog", "Catalog"), ("portal:slices", "Slices"),
    ("portal:deployments", "Models"), ("portal:find_tier", "Find a tier"), ("portal:usage", "Usage"),
    ("portal:invoices", "Invoices"),
    ("portal:keys", "API keys"), ("portal:members", "Members"),
]


def navigation(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_items": [], "nav_area": None}
    principal = principal_for(request)
    area = "console" if principal.is_operator else "portal"
    match = getattr(request, "resolver_match", None)
    current = f"{match.namespace}:{match.url_name}" if match and match.namespace else ""
    items = CONSOLE if area == "console" else PORTAL
    return {"nav_items": [{"url": name, "label": label, "active": current == name or
                           (current.startswith(name.split(":")[0]) and current.split(":")[1].startswith(
                               name.split(":")[1].rstrip("s")))} for name, label in items],
            "nav_area": area, "principal": principal}
