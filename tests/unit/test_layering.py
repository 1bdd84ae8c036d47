"""Layering (issue 16): tasks import services, never the reverse; services queue work by task name
through marketplace.enqueue, and every name there is a registered task."""

from __future__ import annotations

import ast
from pathlib import Path

import marketplace
from marketplace import enqueue
from marketplace.celery import app

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
                 for p in SERVICES.glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert "getattr(tasks" not in "".join(p.read_text() for p in SERVICES.glob("*.py"))


def test_every_enqueued_name_is_a_registered_task():

    names = {v for k, v in vars(enqueue).items() if k.isupper() and isinstance(v, str)}
    assert len(names) >= 7
    assert names - set(app.tasks) == set()


def test_the_repository_cites_no_file_outside_it():
    """Sources are public (NVIDIA's guides, vendor pages), never a file of a developer's machine."""
    import subprocess

    root = Path(marketplace.__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    bad = ("/" + "work/", "shared/" + "reference", "/" + "home/", "/" + "Users/")
    hits = [f for f in files if (root / f).is_file() and f.endswith((".py", ".md", ".html", ".toml", ".json", ".txt"))
            and any(b in (root / f).read_text(errors="replace") for b in bad)]
    assert hits == []
