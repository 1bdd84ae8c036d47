"""Static files as production serves them: hashed names (so they can be cached for a year and marked
immutable) with gzip and brotli copies, all written once by collectstatic; whitenoise then sends the
smallest copy the browser accepts (Content-Encoding). A file that was not collected (tests, a dev
checkout) is still served under its own name instead of failing the page."""

from django.contrib.staticfiles.apps import StaticFilesConfig as StaticFilesConfig_
from whitenoise.storage import CompressedManifestStaticFilesStorage


class CompressedManifestStorage(CompressedManifestStaticFilesStorage):
    manifest_strict = False

    def stored_name(self, name):
        try:
            return super().stored_name(name)
        except ValueError:  # not collected: the finders serve it under its own name
            return name


class StaticFilesConfig(StaticFilesConfig_):
    """django.contrib.staticfiles, leaving out what the plotly wheel ships besides plotly.min.js (its
    Jupyter widget bundle, sample datasets and templates): nobody loads them, and compressing them doubled
    collectstatic's time."""

    ignore_patterns = [*StaticFilesConfig_.ignore_patterns, "widgetbundle.js", "datasets", "templates"]


def collected_is_current() -> bool:
    """Whether STATIC_ROOT holds a manifest newer than every static file the finders see (so the demo
    collects and compresses once, not on every start)."""
    from pathlib import Path

    from django.conf import settings
    from django.contrib.staticfiles import finders

    manifest = Path(settings.STATIC_ROOT) / "staticfiles.json"
    if not manifest.exists():
        return False
    built = manifest.stat().st_mtime
    for finder in finders.get_finders():
        for path, storage in finder.list(StaticFilesConfig.ignore_patterns):
            if Path(storage.path(path)).stat().st_mtime > built:
                return False
    return True
