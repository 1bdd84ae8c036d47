import contextlib
import os
from pathlib import Path

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _private_sqlite_file(sender, connection, **kwargs) -> None:
    """A SQLite database file (demo, tests) holds password and key hashes: readable by its owner only, so the
    Unix users that slices' Triton servers run as cannot read it."""
    if connection.vendor != "sqlite":
        return
    name = str(connection.settings_dict.get("NAME") or "")
    if name and name != ":memory:" and not name.startswith("file:") and os.path.isfile(name):
        with contextlib.suppress(OSError):
            os.chmod(name, 0o600)


def make_var_dirs() -> None:
    """The folders the settings point at and that must exist before their first use: the var folder (the
    SQLite database file's parent), STATIC_ROOT (WhiteNoise serves from it) and the filesystem broker's
    folders. Made here, at start, not when the settings are imported (which writes nothing)."""
    from django.conf import settings

    dirs = [Path(settings.VAR_DIR), Path(settings.STATIC_ROOT)]
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
        dirs += [Path(options[k]) for k in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")]
    for path in dirs:
        path.mkdir(parents=True, exist_ok=True)


class MarketplaceConfig(AppConfig):
    name = "marketplace"
    verbose_name = "Marketplace"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_private_sqlite_file, dispatch_uid="tessera.private_sqlite_file")
        make_var_dirs()
