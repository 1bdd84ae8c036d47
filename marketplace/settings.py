"""Tessera settings: every environment variable the product reads is parsed here, once, at import.

Each variable goes through one of the strict parsers below (``env_str``, ``env_int``, ``env_float``, ``env_bool``,
``env_list``, ``env_path``, ...): a value that does not parse raises ``ImproperlyConfigured`` naming the variable
and the value. Nothing else in the product reads ``os.environ``; importing this module creates no folder and
writes no file (the var/ folders are made by the app at start, see ``marketplace.apps``). The README's
"Configuration (environment)" table lists every variable (a test checks it against ``ENVIRONMENT_VARIABLES``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import os
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

T = TypeVar("T")

# Every variable read below, in reading order (the README's table is checked against it).
ENVIRONMENT_VARIABLES: list[str] = []


def _raw(name: str) -> str | None:
    """The variable's value (None when unset); every reader goes through here."""
    ENVIRONMENT_VARIABLES.append(name)
    return os.environ.get(name)


def _typed(name: str, default: T, parse: Callable[[str], T], expected: str) -> T:
    """Unset or empty: the default; else ``parse(value)``, or ImproperlyConfigured naming the variable."""
    value = _raw(name)
    if value is None or not value.strip():
        return default
    try:
        return parse(value.strip())
    except (ValueError, ArithmeticError) as exc:
        raise ImproperlyConfigured(f"{name}={value!r}: expected {expected}") from exc


def env_str(name: str, default: str = "") -> str:
    """The value as given (set but empty stays empty: some variables disable a feature that way)."""
    value = _raw(name)
    return default if value is None else value


def env_site_url(name: str) -> str:
    """An http(s) address without a trailing slash (empty: unset)."""
    def parse(text: str) -> str:
        if not text.startswith(("http://", "https://")) or len(text.rstrip("/")) <= len("https://"):
            raise ValueError(text)
        return text.rstrip("/")

    return _typed(name, "", parse, "an http:// or https:// address")


def env_emails(name: str) -> list[str]:
    """Comma-separated e-mail addresses (empty: none)."""
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if any(not re.fullmatch(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+", x) for x in out):
            raise ValueError(text)
        return out

    return _typed(name, list[str](), parse, "e-mail addresses, comma-separated")


def env_int(name: str, default: int, *, minimum: int | None = 0) -> int:
    def parse(text: str) -> int:
        number = int(text)
        if minimum is not None and number < minimum:
            raise ValueError(text)
        return number

    return _typed(name, default, parse, "an integer" if minimum is None else f"an integer >= {minimum}")


def env_float(name: str, default: float, *, minimum: float | None = 0.0) -> float:
    def parse(text: str) -> float:
        number = float(text)
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(text)
        if minimum is not None and number < minimum:
            raise ValueError(text)
        return number

    return _typed(name, default, parse, "a number" if minimum is None else f"a number >= {minimum:g}")


def env_decimal(name: str, default: str) -> str:
    """A decimal number, kept as its text (the consumers make a Decimal of it)."""
    def parse(text: str) -> str:
        _decimal(text)
        return text

    return _typed(name, default, parse, "a decimal number >= 0")


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_bool(name: str, default: bool = False) -> bool:
    """1/0, true/false, yes/no, on/off (any case); anything else raises."""
    def parse(text: str) -> bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(text)

    return _typed(name, default, parse, "one of 1/0, true/false, yes/no, on/off")


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive, stored lower-case)."""
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(text)
        return text.lower()

    return _typed(name, default, parse, "one of " + ", ".join(choices))


def env_list(name: str, default: str = "") -> list[str]:
    """Comma-separated; blanks dropped."""
    value = _raw(name)
    return [x.strip() for x in (default if value is None else value).split(",") if x.strip()]


def env_int_list(name: str) -> list[int]:
    """Comma-separated integers >= 0."""
    def parse(text: str) -> list[int]:
        numbers = [int(x) for x in text.split(",") if x.strip()]
        if any(n < 0 for n in numbers):
            raise ValueError(text)
        return numbers

    return _typed(name, [], parse, "comma-separated integers >= 0")


def env_mapping(name: str, check: Callable[[str], object]) -> dict[str, str]:
    """``"key=value,key=value"``; each value must pass ``check`` (which raises ValueError/ArithmeticError)."""
    def parse(text: str) -> dict[str, str]:
        table: dict[str, str] = {}
        for item in text.split(","):
            if not item.strip():
                continue
            key, sep, val = item.partition("=")
            if not sep or not key.strip() or not val.strip():
                raise ValueError(item)
            check(val.strip())
            table[key.strip()] = val.strip()
        return table

    return _typed(name, {}, parse, "comma-separated key=value pairs")


def env_secret(name: str, *, min_length: int) -> str:
    """A secret key of at least ``min_length`` characters (unset or empty: ""). The error names the variable and
    the length, never the value."""
    value = (_raw(name) or "").strip()
    if value and len(value) < min_length:
        raise ImproperlyConfigured(f"{name}: expected at least {min_length} characters, got {len(value)}")
    return value


def env_path(name: str, default: Path) -> Path:
    """A filesystem path (not created here)."""
    value = _raw(name)
    return Path(value) if value is not None and value.strip() else default


def _decimal(text: str) -> Decimal:
    try:
        number = Decimal(text)
    except InvalidOperation as exc:
        raise ValueError(text) from exc
    if not number.is_finite() or number < 0:
        raise ValueError(text)
    return number


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = env_path("TESSERA_VAR_DIR", BASE_DIR / "var")  # made by the app at start (marketplace.apps)
DEBUG = env_bool("DEBUG", False)
# TESSERA_SECURE=1 in production (HTTPS): secure cookies, HSTS, HTTPS redirect; and SECRET_KEY is required.
TESSERA_SECURE = env_bool("TESSERA_SECURE", False)


def _secret_key(configured: str) -> str:
    """SECRET_KEY if set; else the key an earlier version kept in var/secret_key, if that file exists (read,
    never written); else, in production (TESSERA_SECURE=1), refuse to start; else (demo, tests, development)
    a key derived from the var folder's path: stable across restarts (sessions and the slices' derived
    secrets survive) and shared by every process of one installation, but guessable, so the
    ``django-insecure-`` prefix makes ``manage.py check --deploy`` warn about it."""
    if configured:
        return configured
    legacy = VAR_DIR / "secret_key"
    if legacy.is_file():
        key = legacy.read_text().strip()
        if key:
            return key
    if TESSERA_SECURE:
        raise ImproperlyConfigured("SECRET_KEY is required when TESSERA_SECURE=1 (production)")
    digest = hashlib.sha256(f"tessera-development-key:{VAR_DIR.resolve()}".encode()).hexdigest()
    return f"django-insecure-{digest}"


SECRET_KEY = _secret_key(env_str("SECRET_KEY", ""))
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "marketplace.staticfiles.StaticFilesConfig",  # django.contrib.staticfiles
    "rest_framework",
    "django_filters",
    "django_htmx",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "django_celery_results",
    "tenants",
    "marketplace",
    "telemetry",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "marketplace.security.ContentSecurityPolicyMiddleware",
    "marketplace.middleware.RequestLogMiddleware",
    "marketplace.middleware.DatabaseErrorMiddleware",
]

ROOT_URLCONF = "marketplace.urls"
WSGI_APPLICATION = "marketplace.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "marketplace.web.context.navigation",
                "marketplace.security.csp_nonce",
            ],
            "builtins": ["marketplace.templatetags.tessera"],
        },
    },
]

DATABASE_URL = env_str("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'tessera.sqlite3'}"
DB_CONN_MAX_AGE = env_int("DB_CONN_MAX_AGE", 60)
try:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=DB_CONN_MAX_AGE, conn_health_checks=True)}
except ValueError as exc:  # an unknown scheme (the URL may hold a password: only its scheme is shown)
    raise ImproperlyConfigured(f"DATABASE_URL: unknown scheme {DATABASE_URL.partition(':')[0]!r}") from exc
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory, for the test database: the real-worker tests run Celery in another process.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}
    # Several processes (web + embedded worker) share the file in the demo.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0
# PostgreSQL compiles a statement whose estimated cost passes jit_above_cost (100,000 by default) before running
# it; the charts' and the planner's aggregates pass it and spent ~50 ms compiling for ~50 ms of work (EXPLAIN's
# "JIT: ... Emission 47.9 ms"). Tessera's statements run in milliseconds, so its connections turn JIT off;
# TESSERA_DB_JIT=1 leaves the server's setting (e.g. behind a pooler that refuses the startup option). A
# connection's own `options` replaces libpq's PGOPTIONS, so the operator's PGOPTIONS are kept in front of it.
TESSERA_DB_JIT = env_bool("TESSERA_DB_JIT", False)
PGOPTIONS = env_str("PGOPTIONS")
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and not TESSERA_DB_JIT:
    DATABASES["default"].setdefault("OPTIONS", {})["options"] = f"{PGOPTIONS} -c jit=off".strip()

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_USER_MODEL = "tenants.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
_PLOTLY = importlib.util.find_spec("plotly")  # its wheel's plotly.min.js is served (not imported here)
if _PLOTLY is None or _PLOTLY.origin is None:
    raise ImproperlyConfigured("the plotly package is not installed")
_PLOTLY_JS = Path(_PLOTLY.origin).parent / "package_data"
STATICFILES_DIRS: list[Path | tuple[str, Path]] = [d for d in [BASE_DIR / "static"] if d.exists()]
STATICFILES_DIRS.append(("vendor/plotly", _PLOTLY_JS))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # hashed names (cached for a year, immutable) with gzip and brotli copies, written by collectstatic
    # (`manage.py demo` runs it); a file not collected yet is served under its own name (tests, dev)
    "staticfiles": {"BACKEND": "marketplace.staticfiles.CompressedManifestStorage"},
}
WHITENOISE_USE_FINDERS = True

REDIS_URL = env_str("REDIS_URL")

if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "tessera@localhost")

# --- Celery -----------------------------------------------------------------------------------
BROKER_DIR = VAR_DIR / "broker"
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or REDIS_URL or "filesystem://"
CELERY_VISIBILITY_TIMEOUT = env_int("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=1)
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any]
if CELERY_BROKER_URL.startswith("filesystem://"):  # the folders are made by the app at start (marketplace.apps)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
    }
else:
    # acks_late: a task whose worker died is delivered again after this many seconds.
    # unacked_restore_*: running workers look for such tasks every ~10 s (kombu's default is ~100 s).
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": CELERY_VISIBILITY_TIMEOUT,
        "unacked_restore_throttle": 1,
        "unacked_restore_interval": 10,
    }
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND") or REDIS_URL or "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "control"
# Outbound webhooks run on their own queue and workers (docker/compose.yaml's `webhooks`), never on the control
# queue that consumes usage and runs beat's jobs: a tenant's slow endpoint holds only a webhooks worker.
CELERY_TASK_ROUTES = {"tessera.deliver_webhook": {"queue": "webhooks"},
                      "tessera.sweep_webhooks": {"queue": "webhooks"}}
CELERY_TASK_TIME_LIMIT = 300
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# The periodic tasks' intervals (seconds).
TESSERA_TELEMETRY_INTERVAL_S = env_float("TESSERA_TELEMETRY_INTERVAL_S", 60.0, minimum=0.1)
TESSERA_DOWNSAMPLE_INTERVAL_S = env_float("TESSERA_DOWNSAMPLE_INTERVAL_S", 300.0, minimum=0.1)
TESSERA_RATING_INTERVAL_S = env_float("TESSERA_RATING_INTERVAL_S", 300.0, minimum=0.1)
TESSERA_RECONCILE_INTERVAL_S = env_float("TESSERA_RECONCILE_INTERVAL_S", 60.0, minimum=0.1)
TESSERA_SCRAPE_INTERVAL_S = env_float("TESSERA_SCRAPE_INTERVAL_S", 60.0, minimum=0.1)
TESSERA_USAGE_CONSUME_INTERVAL_S = env_float("TESSERA_USAGE_CONSUME_INTERVAL_S", 5.0, minimum=0.1)
# Queues again the webhook deliveries whose retry is overdue (its message lost, its worker killed).
TESSERA_WEBHOOK_SWEEP_INTERVAL_S = env_float("TESSERA_WEBHOOK_SWEEP_INTERVAL_S", 60.0, minimum=0.1)
TESSERA_DEMO_TRAFFIC = env_bool("TESSERA_DEMO_TRAFFIC", False)  # set by `manage.py demo`
# Alarms (selectors.alarms) sent to Alertmanager's API, or without it mailed and/or POSTed once per firing/resolution.
TESSERA_ALERT_INTERVAL_S = env_float("TESSERA_ALERT_INTERVAL_S", 60.0, minimum=1.0)
TESSERA_ALERTMANAGER_URL = env_site_url("TESSERA_ALERTMANAGER_URL")
TESSERA_ALERT_WEBHOOK_URL = env_site_url("TESSERA_ALERT_WEBHOOK_URL")
TESSERA_ALERT_EMAILS = env_emails("TESSERA_ALERT_EMAILS")
TESSERA_NODE_HEARTBEAT_STALE_S = env_float("TESSERA_NODE_HEARTBEAT_STALE_S", 300.0, minimum=1.0)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "collect-gpu-telemetry": {
        "task": "tessera.collect_gpu_fleet",
        "schedule": TESSERA_TELEMETRY_INTERVAL_S,
        "options": {"queue": "control"},
    },
    "downsample-telemetry": {
        "task": "tessera.downsample_telemetry",
        "schedule": TESSERA_DOWNSAMPLE_INTERVAL_S,
        "options": {"queue": "control"},
    },
    "rate-and-check-spend": {
        "task": "tessera.rate_and_check_spend",
        "schedule": TESSERA_RATING_INTERVAL_S,
        "options": {"queue": "control"},
    },
    "reconcile-fleet": {
        "task": "tessera.reconcile_fleet",
        "schedule": TESSERA_RECONCILE_INTERVAL_S,
        "options": {"queue": "control"},
    },
    "scrape-triton": {
        "task": "tessera.scrape_triton_fleet",
        "schedule": TESSERA_SCRAPE_INTERVAL_S,
        "options": {"queue": "control"},
    },
    "consume-usage": {  # the gateway's usage stream into the database (or run `manage.py usage_consumer`)
        "task": "tessera.consume_usage",
        "schedule": TESSERA_USAGE_CONSUME_INTERVAL_S,
        "options": {"queue": "control", "expires": 30},
    },
    "send-alerts": {  # the alarm set to Alertmanager (or mail and webhook without it)
        "task": "tessera.send_alerts",
        "schedule": TESSERA_ALERT_INTERVAL_S,
        "options": {"queue": "control", "expires": TESSERA_ALERT_INTERVAL_S},
    },
    "sweep-webhooks": {  # beat only sends it: the webhooks workers run it
        "task": "tessera.sweep_webhooks",
        "schedule": TESSERA_WEBHOOK_SWEEP_INTERVAL_S,
        "options": {"queue": "webhooks", "expires": TESSERA_WEBHOOK_SWEEP_INTERVAL_S},
    },
}
if TESSERA_DEMO_TRAFFIC:  # the demo's simulated inference gateway (its tasks live in the demo app)
    INSTALLED_APPS.append("marketplace.demo")
    CELERY_BEAT_SCHEDULE["demo-gateway"] = {"task": "tessera.demo_gateway_fleet", "schedule": 60.0,
                                            "options": {"queue": "control"}}

# --- REST API --------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tenants.permissions.TenantAccess"],
    "DEFAULT_PAGINATION_CLASS": "marketplace.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
        "rest_framework.filters.SearchFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "marketplace.api.schema.AutoSchema",  # + every operation's error answers
    "EXCEPTION_HANDLER": "marketplace.api.errors.exception_handler",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_THROTTLE_CLASSES": ["tenants.throttling.ApiKeyRateThrottle"],
    # Rates come from the Security section below (TESSERA_API_RATE, TESSERA_USAGE_INGEST_RATE).
    "DEFAULT_THROTTLE_RATES": {},
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tessera API",
    "DESCRIPTION": "GPU and MIG-slice marketplace: tenants, keys, catalog, orders, usage, billing.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # The ApiKey scheme comes from its authentication extension (tenants/schema.py), once per operation.
    # Swagger UI from the drf-spectacular-sidecar wheel's static files: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # One name per model choice set (otherwise drf-spectacular warns about colliding "state"/"kind" enums).
    "ENUM_NAME_OVERRIDES": {
        "TenantStatusEnum": "tenants.models.Tenant.Status",
        "InvoiceStatusEnum": "marketplace.models.billing.Invoice.Status",
        "InvoiceLineKindEnum": "marketplace.models.billing.InvoiceLine.Kind",
        "SpendNoticeLevelEnum": "marketplace.models.billing.SpendNotice.Level",
        "WebhookDeliveryStatusEnum": "marketplace.models.billing.WebhookDelivery.Status",
        "NodeStateEnum": "marketplace.models.fleet.Node.State",
        "GpuStateEnum": "marketplace.models.fleet.Gpu.State",
        "GpuInstanceStateEnum": "marketplace.models.fleet.GpuInstance.State",
        "PricePlanKindEnum": "marketplace.models.offers.PricePlan.Kind",
        "AllocationStateEnum": "marketplace.models.orders.Allocation.State",
        "DriftEventKindEnum": "marketplace.models.orders.DriftEvent.Kind",
        "ModelDeploymentStateEnum": "marketplace.models.deployments.ModelDeployment.State",
        "SpecBackendEnum": "marketplace.hardware.triton.BACKENDS",
        "RepositoryBackendEnum": "marketplace.hardware.model_repo.KNOWN_BACKENDS",
        "LibraryBackendEnum": "marketplace.models.library.LIBRARY_BACKENDS",
        "UploadStateEnum": "marketplace.models.library.UploadState",
    },
}

# --- Tessera ---------------------------------------------------------------------------------
TESSERA_NVML_BACKEND = env_choice("TESSERA_NVML_BACKEND", "sim", ("sim", "pynvml"))
TESSERA_TRITON_BACKEND = env_choice("TESSERA_TRITON_BACKEND", "sim", ("sim", "http"))
TESSERA_SIM_DIR = env_path("TESSERA_SIM_DIR", VAR_DIR / "sim")  # simulated GPUs' state
# The NVML simulator (TESSERA_NVML_BACKEND=sim) without a registered node's own arguments: its GPUs
# ("h100-sxm-80gb*4,h200-sxm-141gb*4"; empty: eight H100), state file, node name, GPUs with MIG off (indices)
# and how long creating a GPU instance takes (fault tests).
TESSERA_NVML_SIM_FLEET = env_str("TESSERA_NVML_SIM_FLEET")
TESSERA_NVML_SIM_STATE = env_str("TESSERA_NVML_SIM_STATE")
TESSERA_NVML_SIM_NODE = env_str("TESSERA_NVML_SIM_NODE")
TESSERA_NVML_SIM_MIG_OFF = env_int_list("TESSERA_NVML_SIM_MIG_OFF")
TESSERA_NVML_SIM_CREATE_LATENCY_S = env_float("TESSERA_NVML_SIM_CREATE_LATENCY_S", 0.0)
TESSERA_TRITON_REPO_ROOT = env_path("TESSERA_TRITON_REPO_ROOT", VAR_DIR / "triton")  # on the node
TESSERA_NODE_HOSTNAME = env_str("TESSERA_NODE_HOSTNAME")  # set on a real GPU node's worker
TESSERA_PROVISION_STUCK_AFTER_S = env_int("TESSERA_PROVISION_STUCK_AFTER_S", 300)
# Serving runtime (on the node): how each slice's Triton server is run. process | docker | sim; default sim
# with the simulated Triton backend, else process.
TESSERA_SERVING_RUNTIME = env_choice("TESSERA_SERVING_RUNTIME", "sim" if TESSERA_TRITON_BACKEND == "sim" else "process",
                                     ("process", "docker", "sim"))
TESSERA_TRITONSERVER = env_str("TESSERA_TRITONSERVER")  # the binary; empty: nvidia-pytriton's
TESSERA_TRITON_PYTHON = env_str("TESSERA_TRITON_PYTHON")  # the python backend's Python; empty: ours
# where the node stages tritonserver for the per-slice users; empty: <TESSERA_TRITON_REPO_ROOT>/.runtime
TESSERA_SERVING_RUNTIME_DIR = env_str("TESSERA_SERVING_RUNTIME_DIR")
TESSERA_SERVING_ISOLATE = env_bool("TESSERA_SERVING_ISOLATE", True)  # a sandbox per server (worker is root)
def _matching(pattern: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not re.fullmatch(pattern, text):
            raise ValueError(text)
        return text
    return parse


def _sandbox_subnet(text: str) -> str:
    if ipaddress.IPv4Network(text).prefixlen > 30:
        raise ValueError(text)
    return text


# Names this installation's sandboxes on a node (Unix users tessera-<id>-<allocation>, network namespaces,
# cgroups, firewall tables): two installations sharing a host never touch each other's. Default: derived from
# SECRET_KEY (stable, the same on every process of one installation).
TESSERA_INSTALLATION_ID = _typed("TESSERA_INSTALLATION_ID", hashlib.sha256(
    f"tessera-installation:{SECRET_KEY}".encode()).hexdigest()[:6], _matching(r"[a-z0-9]{1,8}"),
    "1 to 8 lowercase letters or digits")
TESSERA_SANDBOX_SUBNET = _typed("TESSERA_SANDBOX_SUBNET", "10.213.0.0/16", _sandbox_subnet,
                                "an IPv4 network of at least a /30")  # a /30 per sandboxed server
TESSERA_SANDBOX_CGROUP = _typed("TESSERA_SANDBOX_CGROUP", "tessera", _matching(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*"),
                                "a relative cgroup path (letters, digits, _.-)")  # the sandboxes' parent cgroup
TESSERA_SANDBOX_PIDS = env_int("TESSERA_SANDBOX_PIDS", 4096, minimum=16)  # tasks (threads) per sandbox
TESSERA_SANDBOX_FILE_MIB = env_int("TESSERA_SANDBOX_FILE_MIB", 1024, minimum=1)  # largest file a slice writes
TESSERA_SANDBOX_TMPFS_MIB = env_int("TESSERA_SANDBOX_TMPFS_MIB", 1024, minimum=1)  # each of /tmp, /dev/shm, home
TESSERA_TRITON_IMAGE = env_str("TESSERA_TRITON_IMAGE", "nvcr.io/nvidia/tritonserver:24.10-py3")
TESSERA_SIM_TRITON_HTTP = env_bool("TESSERA_SIM_TRITON_HTTP", False)  # simulated servers answer HTTP too
TESSERA_SERVING_START_TIMEOUT_S = env_float("TESSERA_SERVING_START_TIMEOUT_S", 120.0)
TESSERA_DEPLOY_WAIT_S = env_float("TESSERA_DEPLOY_WAIT_S", 300.0)  # a model waits for its server
# Inference gateway (manage.py gateway): where tenants call their models, and its limits.
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8001"  # `manage.py demo --gateway-addr` replaces it when unset
TESSERA_GATEWAY_URL = env_str("TESSERA_GATEWAY_URL", DEFAULT_GATEWAY_URL).rstrip("/")  # shown to tenants
TESSERA_GATEWAY_INTERNAL_URL = env_str("TESSERA_GATEWAY_INTERNAL_URL").rstrip("/") or TESSERA_GATEWAY_URL
TESSERA_GATEWAY_REFRESH_S = env_float("TESSERA_GATEWAY_REFRESH_S", 2.0)  # keys, routes, limits reload
TESSERA_GATEWAY_RPM = env_int("TESSERA_GATEWAY_RPM", 600)  # per key, unless the key sets its own
TESSERA_GATEWAY_TPM = env_int("TESSERA_GATEWAY_TPM", 1000000)  # per key, unless the key sets its own
TESSERA_GATEWAY_MAX_BODY = env_int("TESSERA_GATEWAY_MAX_BODY", 16 * 1024 * 1024)
TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S = env_float("TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S", 300.0)
TESSERA_GATEWAY_TRY_TTL_S = 600  # the portal's "Try it" tokens
TESSERA_USAGE_STREAM = env_str("TESSERA_USAGE_STREAM", "tessera:usage")  # Redis stream of served usage
TESSERA_USAGE_SPOOL_DIR = env_path("TESSERA_USAGE_SPOOL_DIR", VAR_DIR / "usage-spool")  # without Redis
# The key gateways sign each usage event with and the consumer checks (HMAC-SHA256; an unsigned or forged event
# is never billed). Needed by gateways and the usage consumer (the control worker runs it from beat), not by node
# workers. Empty: derived from SECRET_KEY (marketplace.gateway.signing). PREVIOUS: also accepted (rotation).
# At least 32 characters: a signed event in the stream would let a short key be guessed offline.
TESSERA_USAGE_SIGNING_KEY = env_secret("TESSERA_USAGE_SIGNING_KEY", min_length=32)
TESSERA_USAGE_SIGNING_KEY_PREVIOUS = env_secret("TESSERA_USAGE_SIGNING_KEY_PREVIOUS", min_length=32)
TESSERA_METERING_TOLERANCE = env_float("TESSERA_METERING_TOLERANCE", 0.02)  # metered vs served
TESSERA_PLANNER_LATE_DAYS = env_float("TESSERA_PLANNER_LATE_DAYS", 35.0)  # planner rollup: late usage re-rolled
TESSERA_API_KEY_LAST_USED_RESOLUTION_S = 60  # write last_used_at at most once a minute per key
TESSERA_INVITATION_TTL_DAYS = 7
# The site's public address (https://portal.example.com) for links in e-mails; empty: the address the
# inviting request came in on (its Host header, which ALLOWED_HOSTS checks).
TESSERA_SITE_URL = env_site_url("TESSERA_SITE_URL")
# The MSP as its invoices and credit notes name it (the PDFs' issuer; frozen on each at finalization or issue):
# its name, its postal address (lines separated by ";") and its tax ids (separated by ",", e.g. "VAT DE123456789").
TESSERA_MSP_NAME = env_str("TESSERA_MSP_NAME", "Tessera GPU Cloud")
TESSERA_MSP_ADDRESS = env_str("TESSERA_MSP_ADDRESS")
TESSERA_MSP_TAX_IDS = env_str("TESSERA_MSP_TAX_IDS")
# Requests per minute from one client address to the invitation pages (token guessing, password tries).
TESSERA_INVITATION_PAGE_RATE = env_int("TESSERA_INVITATION_PAGE_RATE", 30)
# Capacity planner: what one GPU-hour costs the MSP (hardware amortisation + hosting, power excluded),
# per GPU model key: "h100-sxm-80gb=1.89,h200-sxm-141gb=2.50" (defaults: public marketplace rental
# prices of 2025-26, an upper bound for an owner's cost; set your own).
TESSERA_PLANNER_GPU_HOUR_COST = env_mapping("TESSERA_PLANNER_GPU_HOUR_COST", _decimal)

# Energy price per kWh, in TESSERA_ENERGY_CURRENCY: power cost per 1M tokens, the planner's power cost.
TESSERA_ENERGY_PRICE_PER_KWH = env_decimal("TESSERA_ENERGY_PRICE_PER_KWH", "0.12")
TESSERA_ENERGY_CURRENCY = env_choice("TESSERA_ENERGY_CURRENCY", "usd",
                                     ("usd", "eur", "gbp", "chf", "jpy", "cad", "aud")).upper()
# Modelled throughput of a whole GPU per TB/s of memory bandwidth (tokens/s); a slice gets its compute share.
TESSERA_TOKENS_PER_S_PER_TBPS = env_float("TESSERA_TOKENS_PER_S_PER_TBPS", 3000.0)

# Webhook targets in these networks (CIDRs) are allowed although internal (loopback, private, ...).
TESSERA_WEBHOOK_ALLOW_NETWORKS = env_list("TESSERA_WEBHOOK_ALLOW_NETWORKS", "")
# One delivery attempt, whole (name lookup, connect, TLS, request, the answer's headers and body), within this many
# seconds; at most MAX_ATTEMPTS attempts, the first retry after BACKOFF_S, doubling (at most 30 minutes); a tenant
# registers at most MAX_ENDPOINTS endpoints.
TESSERA_WEBHOOK_TIMEOUT_S = env_float("TESSERA_WEBHOOK_TIMEOUT_S", 10.0, minimum=0.1)
TESSERA_WEBHOOK_MAX_ATTEMPTS = env_int("TESSERA_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
TESSERA_WEBHOOK_BACKOFF_S = env_float("TESSERA_WEBHOOK_BACKOFF_S", 5.0)
TESSERA_WEBHOOK_MAX_ENDPOINTS = env_int("TESSERA_WEBHOOK_MAX_ENDPOINTS", 10, minimum=1)

# --- Security --------------------------------------------------------------------------------
# API throttling (DRF, counters in the Django cache: Redis in production). Per API key (prefix),
# else per signed-in user, else per client IP. "<n>/<sec|min|hour|day>"; empty disables.
TESSERA_API_RATE = env_str("TESSERA_API_RATE", "600/min")
TESSERA_USAGE_INGEST_RATE = env_str("TESSERA_USAGE_INGEST_RATE", "120/min")  # POST /api/v1/usage/events/
TESSERA_ANON_RATE = env_str("TESSERA_ANON_RATE", "60/min")
REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] = {
    "api": TESSERA_API_RATE or None,
    "usage_ingest": TESSERA_USAGE_INGEST_RATE or None,
    "anon": TESSERA_ANON_RATE or None,
}
# Login lockout (web /login/ and /admin/login/): after MAX_FAILURES failed attempts for one
# (e-mail, client IP) within the window, that pair is locked for LOCKOUT_MINUTES.
TESSERA_LOGIN_MAX_FAILURES = env_int("TESSERA_LOGIN_MAX_FAILURES", 5, minimum=1)
TESSERA_LOGIN_LOCKOUT_MINUTES = env_int("TESSERA_LOGIN_LOCKOUT_MINUTES", 15)
AUTHENTICATION_BACKENDS = ["tenants.lockout.LockoutModelBackend", "tenants.sso.Backend"]
# Single sign-on with OpenID Connect (tenants.sso; README "Single sign-on"): on when a client id is set. The
# provider's endpoints are given, not discovered (nothing is fetched at start-up).
OIDC_RP_CLIENT_ID = env_str("TESSERA_OIDC_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env_str("TESSERA_OIDC_CLIENT_SECRET")
OIDC_OP_AUTHORIZATION_ENDPOINT = env_str("TESSERA_OIDC_AUTHORIZATION_ENDPOINT")
OIDC_OP_TOKEN_ENDPOINT = env_str("TESSERA_OIDC_TOKEN_ENDPOINT")
OIDC_OP_USER_ENDPOINT = env_str("TESSERA_OIDC_USERINFO_ENDPOINT")
OIDC_OP_JWKS_ENDPOINT = env_str("TESSERA_OIDC_JWKS_ENDPOINT") or None
OIDC_RP_SIGN_ALGO = env_choice("TESSERA_OIDC_SIGN_ALGO", "RS256",
                               ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "HS256"))
OIDC_RP_SCOPES = env_str("TESSERA_OIDC_SCOPES", "openid email profile")
OIDC_STORE_ID_TOKEN = True  # the hint of the provider's logout
OIDC_TIMEOUT = 10
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
LOGIN_REDIRECT_URL_FAILURE = "/login/"
TESSERA_OIDC_END_SESSION_ENDPOINT = env_str("TESSERA_OIDC_END_SESSION_ENDPOINT")
TESSERA_OIDC_GROUPS_CLAIM = env_str("TESSERA_OIDC_GROUPS_CLAIM", "groups")
TESSERA_OIDC_OPERATOR_GROUP = env_str("TESSERA_OIDC_OPERATOR_GROUP", "tessera-operators")
TESSERA_OIDC_PROVIDER_NAME = env_str("TESSERA_OIDC_PROVIDER_NAME", "single sign-on")
# Behind a TLS-terminating proxy the client IP is the first X-Forwarded-For hop when this is on.
TESSERA_TRUST_X_FORWARDED_FOR = env_bool("TESSERA_TRUST_X_FORWARDED_FOR", False)
# /metrics for a scraper: "Authorization: Bearer <token>" (empty: staff sessions only).
TESSERA_METRICS_TOKEN = env_str("TESSERA_METRICS_TOKEN")

# TESSERA_SECURE (read at the top): secure cookies, HSTS, HTTPS redirect.
_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)  # check --deploy W021; 0 to opt out
_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
if TESSERA_SECURE:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = _HSTS_SECONDS
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = _HSTS_PRELOAD
    SECURE_SSL_REDIRECT = _SSL_REDIRECT
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # /healthz is probed over plain HTTP inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
# Content-Security-Policy (marketplace.security): scripts only from 'self' or with the per-request
# nonce; no inline event handlers. Report-only mode for trying a change: TESSERA_CSP_REPORT_ONLY=1.
TESSERA_CSP = {
    "default-src": "'self'",
    "script-src": "'self' 'nonce-{nonce}'",
    "style-src": "'self' 'unsafe-inline'",  # Plotly and htmx set inline styles
    "img-src": "'self' data:",
    "object-src": "'none'",
    "base-uri": "'self'",
    "frame-ancestors": "'none'",
    "form-action": "'self'",
}
TESSERA_CSP_REPORT_ONLY = env_bool("TESSERA_CSP_REPORT_ONLY", False)

# --- Logging (structured) ----------------------------------------------------------------------
LOG_FORMAT = env_choice("LOG_FORMAT", "json", ("json", "text"))
LOG_LEVEL = env_choice("LOG_LEVEL", "info", ("debug", "info", "warning", "error", "critical")).upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "marketplace.logging.JsonFormatter"},
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "django.server": {"level": "WARNING"},
    },
}

# --- Models: tenants' own Triton repositories and the MSP's model store (README: "Models on slices") ---
# Where uploaded repositories are unpacked: the web app writes, node workers read (a shared filesystem in
# production, e.g. NFS, mounted at the same path on web and nodes).
TESSERA_UPLOAD_ROOT = env_path("TESSERA_UPLOAD_ROOT", VAR_DIR / "uploads")
# The MSP's model store: library weights and repositories tenants may import (read-only, same path everywhere).
TESSERA_MODEL_STORE_ROOT = env_path("TESSERA_MODEL_STORE_ROOT", VAR_DIR / "model-store")
TESSERA_UPLOAD_MAX_BYTES = env_int("TESSERA_UPLOAD_MAX_BYTES", 2 * 1024**3, minimum=1)  # archive size
# An S3-compatible model store (README: "Models on slices"): when a bucket is set, a tenant's store_path is an
# object key under the prefix, fetched with boto3 (no URL from the tenant: the endpoint is the operator's).
TESSERA_MODEL_STORE_S3_ENDPOINT = env_str("TESSERA_MODEL_STORE_S3_ENDPOINT", "")
TESSERA_MODEL_STORE_S3_BUCKET = env_str("TESSERA_MODEL_STORE_S3_BUCKET", "")
TESSERA_MODEL_STORE_S3_PREFIX = env_str("TESSERA_MODEL_STORE_S3_PREFIX", "")
TESSERA_MODEL_STORE_S3_REGION = env_str("TESSERA_MODEL_STORE_S3_REGION", "us-east-1")
TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID = env_str("TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID", "")
TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY = env_str("TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY", "")
TESSERA_REPO_MAX_EXPANDED_BYTES = env_int("TESSERA_REPO_MAX_EXPANDED_BYTES", 8 * 1024**3, minimum=1)
TESSERA_REPO_MAX_FILES = env_int("TESSERA_REPO_MAX_FILES", 2000, minimum=1)
# Each config.pbtxt (and a LoRA adapter's adapter_config.json), checked before it is parsed.
TESSERA_REPO_MAX_CONFIG_BYTES = env_int("TESSERA_REPO_MAX_CONFIG_BYTES", 1024 * 1024, minimum=1)
# The control worker's wall-clock budget to unpack and check one archive (its Celery time limit is a minute more).
TESSERA_REPO_MAX_UNPACK_SECONDS = env_float("TESSERA_REPO_MAX_UNPACK_SECONDS", 300.0, minimum=1.0)
# The web request reads a tar.gz's member headers up to this far into the decompressed stream (a zip's central
# directory always) to refuse bad names, links and bombs at once with a 400; 0: leave all of it to the worker.
TESSERA_UPLOAD_PRESCAN_BYTES = env_int("TESSERA_UPLOAD_PRESCAN_BYTES", 64 * 1024**2, minimum=0)
DATA_UPLOAD_MAX_NUMBER_FILES = 1
# Uploaded archives stream to a temporary file (never into memory) and stop being stored past the limit above.
FILE_UPLOAD_HANDLERS = ["marketplace.uploads.CappedUploadHandler"]
