"""Shared set-up for the benchmarks: a scratch database (PostgreSQL next to DATABASE_URL's, else a
SQLite file), scratch folders for the simulated GPUs and Triton repositories, Django configured and
migrated."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def setup_django(db_name: str, prefix: str = "tessera-bench-") -> Path:
    """Returns the scratch folder; the caller removes it when done."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("postgres"):
        import psycopg

        base, _, _name = url.rpartition("/")
        with psycopg.connect(f"{base}/postgres", autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {db_name}")
            c.execute(f"CREATE DATABASE {db_name}")
        os.environ["DATABASE_URL"] = f"{base}/{db_name}"
    else:
        os.environ["DATABASE_URL"] = f"sqlite:///{scratch / 'bench.sqlite3'}"
    os.environ["TESSERA_VAR_DIR"] = str(scratch / "var")
    os.environ["TESSERA_SIM_DIR"] = str(scratch / "sim")
    os.environ["TESSERA_TRITON_REPO_ROOT"] = str(scratch / "triton")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return scratch
