import contextlib
import os

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


class MarketplaceConfig(AppConfig):
    name = "marketplace"
    verbose_name = "Marketplace"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_private_sqlite_file, dispatch_uid="tessera.private_sqlite_file")
