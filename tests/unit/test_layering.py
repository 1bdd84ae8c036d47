"""Layering (issue 16): tasks import services, never the reverse; services queue work by task name
through marketplace.enqueue, and every name there is a registered task."""

from __future__ import annotations

import ast
from pathlib import Path

import marketplace
from marketplace import enqueue

SERVICES = Path(marketplace.__file__).parent / "services"


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_service_imports_the_tasks_module():
    offenders = {p.name: sorted(m for m in imported_modules(p) if m == "marketplace.tasks" or m.endswith(".tasks"))
                 for p in SERVICES.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert "getattr(tasks" not in "".join(p.read_text() for p in SERVICES.rglob("*.py"))


def registered_task_names(path: Path) -> set[str]:
    """The name= of every @shared_task in a tasks module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "shared_task":
                    out |= {k.value.value for k in d.keywords if k.arg == "name"}
    return out


def test_every_enqueued_name_is_a_registered_task():
    names = {v for k, v in vars(enqueue).items() if k.isupper() and isinstance(v, str)}
    assert len(names) >= 7
    assert names - registered_task_names(Path(marketplace.__file__).parent / "tasks.py") == set()


def test_the_repository_cites_no_file_outside_it():
    """Sources are public (NVIDIA's guides, vendor pages), never a file of a developer's machine."""
    import subprocess

    root = Path(marketplace.__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    bad = ("/" + "work/", "shared/" + "reference", "/" + "home/", "/" + "Users/")
    hits = [f for f in files if (root / f).is_file() and f.endswith((".py", ".md", ".html", ".toml", ".json", ".txt"))
            and any(b in (root / f).read_text(errors="replace") for b in bad)]
    assert hits == []


def test_demo_code_stays_in_the_demo_package():
    """Production modules never import the demo package; settings install it only for the demo."""
    from django.conf import settings

    root = Path(marketplace.__file__).parent.parent
    allowed = {root / "marketplace" / "management" / "commands" / "demo.py"}
    offenders = []
    for pkg in ("marketplace", "tenants", "telemetry"):
        for p in (root / pkg).rglob("*.py"):
            if "demo" in p.relative_to(root).parts[:2] or p in allowed or "migrations" in p.parts:
                continue
            if any(m == "marketplace.demo" or m.startswith("marketplace.demo.") for m in imported_modules(p)):
                offenders.append(str(p.relative_to(root)))
    assert offenders == []
    assert ("marketplace.demo" in settings.INSTALLED_APPS) == bool(getattr(settings, "TESSERA_DEMO_TRAFFIC", False)
                                                                  or "tessera.demo_gateway_fleet" in str(
                                                                      settings.CELERY_BEAT_SCHEDULE))


def test_a_simulated_node_s_gpus_follow_its_registered_name(catalog):
    from marketplace.models import ServerPlatform
    from marketplace.services.nodes import sim_discovery

    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    upper, lower = sim_discovery("GPU-X ", platform), sim_discovery("gpu-x", platform)
    assert [g.uuid for g in upper] == [g.uuid for g in lower] and len(upper) == 8
