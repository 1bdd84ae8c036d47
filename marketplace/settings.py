"""Tessera settings, read from the environment.

DATABASE_URL           default: SQLite file var/tessera.sqlite3
REDIS_URL              Redis for the Celery broker/results and the cache (unset: embedded broker)
CELERY_BROKER_URL      overrides the broker (default: REDIS_URL, else kombu's filesystem transport)
SECRET_KEY             required when DEBUG is off outside the demo; else a key kept in var/secret_key
DEBUG                  0/1 (default 0)
ALLOWED_HOSTS          comma-separated (default localhost,127.0.0.1,[::1],testserver)
TESSERA_NVML_BACKEND   sim | pynvml (default sim)
TESSERA_TRITON_BACKEND sim | http (default sim)
TESSERA_SERVING_RUNTIME process | docker | sim (default: sim with the sim backend, else process)
LOG_FORMAT             json | text (default json)
TESSERA_SECURE         0/1: HTTPS-only cookies, HSTS, SSL redirect (see the Security section)
TESSERA_SITE_URL       public address for links in e-mails (default: the inviting request's own)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TESSERA_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


def _secret_key() -> str:
    key = os.environ.get("SECRET_KEY")
    if key:
        return key
    # Development/demo convenience: a random key kept outside the repository (var/ is ignored).
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = _secret_key()
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

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'tessera.sqlite3'}",
        conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", "60")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory, for the test database: the real-worker tests run Celery in another process.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}
    # Several processes (web + embedded worker) share the file in the demo.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0

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
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [d for d in [BASE_DIR / "static"] if d.exists()] + [
    ("vendor/plotly", Path(__import__("plotly").__file__).parent / "package_data")]  # the wheel's plotly.min.js
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # hashed names (cached for a year, immutable) with gzip and brotli copies, written by collectstatic
    # (`manage.py demo` runs it); a file not collected yet is served under its own name (tests, dev)
    "staticfiles": {"BACKEND": "marketplace.staticfiles.CompressedManifestStorage"},
}
WHITENOISE_USE_FINDERS = True

REDIS_URL = os.environ.get("REDIS_URL", "")

if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "tessera@localhost")

# --- Celery -----------------------------------------------------------------------------------
BROKER_DIR = VAR_DIR / "broker"
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL or "filesystem://"
if CELERY_BROKER_URL.startswith("filesystem://"):
    for sub in ("queue", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
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
        "visibility_timeout": int(os.environ.get("CELERY_VISIBILITY_TIMEOUT", "3600")),
        "unacked_restore_throttle": 1,
        "unacked_restore_interval": 10,
    }
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or REDIS_URL or "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_TIME_LIMIT = 300
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "collect-gpu-telemetry": {
        "task": "tessera.collect_gpu_fleet",
        "schedule": float(os.environ.get("TESSERA_TELEMETRY_INTERVAL_S", "60")),
        "options": {"queue": "control"},
    },
    "downsample-telemetry": {
        "task": "tessera.downsample_telemetry",
        "schedule": float(os.environ.get("TESSERA_DOWNSAMPLE_INTERVAL_S", "300")),
        "options": {"queue": "control"},
    },
    "rate-and-check-spend": {
        "task": "tessera.rate_and_check_spend",
        "schedule": float(os.environ.get("TESSERA_RATING_INTERVAL_S", "300")),
        "options": {"queue": "control"},
    },
    "reconcile-fleet": {
        "task": "tessera.reconcile_fleet",
        "schedule": float(os.environ.get("TESSERA_RECONCILE_INTERVAL_S", "60")),
        "options": {"queue": "control"},
    },
    "scrape-triton": {
        "task": "tessera.scrape_triton_fleet",
        "schedule": float(os.environ.get("TESSERA_SCRAPE_INTERVAL_S", "60")),
        "options": {"queue": "control"},
    },
    "consume-usage": {  # the gateway's usage stream into the database (or run `manage.py usage_consumer`)
        "task": "tessera.consume_usage",
        "schedule": float(os.environ.get("TESSERA_USAGE_CONSUME_INTERVAL_S", "5")),
        "options": {"queue": "control", "expires": 30},
    },
}
if env_bool("TESSERA_DEMO_TRAFFIC"):  # the demo's simulated inference gateway (its tasks live in the demo app)
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
    },
}

# --- Tessera ---------------------------------------------------------------------------------
TESSERA_NVML_BACKEND = os.environ.get("TESSERA_NVML_BACKEND", "sim")
TESSERA_TRITON_BACKEND = os.environ.get("TESSERA_TRITON_BACKEND", "sim")
TESSERA_SIM_DIR = Path(os.environ.get("TESSERA_SIM_DIR", VAR_DIR / "sim"))  # simulated GPUs' state
TESSERA_TRITON_REPO_ROOT = Path(os.environ.get("TESSERA_TRITON_REPO_ROOT", VAR_DIR / "triton"))  # on the node
TESSERA_NODE_HOSTNAME = os.environ.get("TESSERA_NODE_HOSTNAME", "")  # set on a real GPU node's worker
TESSERA_PROVISION_STUCK_AFTER_S = int(os.environ.get("TESSERA_PROVISION_STUCK_AFTER_S", "300"))
# Serving runtime (on the node): how each slice's Triton server is run. process | docker | sim; default sim
# with the simulated Triton backend, else process.
TESSERA_SERVING_RUNTIME = (os.environ.get("TESSERA_SERVING_RUNTIME")
                           or ("sim" if TESSERA_TRITON_BACKEND == "sim" else "process")).strip().lower()
TESSERA_TRITONSERVER = os.environ.get("TESSERA_TRITONSERVER", "")  # the binary; empty: nvidia-pytriton's
TESSERA_TRITON_PYTHON = os.environ.get("TESSERA_TRITON_PYTHON", "")  # the python backend's Python; empty: ours
# where the node stages tritonserver for the per-slice users; empty: <TESSERA_TRITON_REPO_ROOT>/.runtime
TESSERA_SERVING_RUNTIME_DIR = os.environ.get("TESSERA_SERVING_RUNTIME_DIR", "")
TESSERA_SERVING_ISOLATE = env_bool("TESSERA_SERVING_ISOLATE", True)  # a Unix user per server (worker is root)
TESSERA_TRITON_IMAGE = os.environ.get("TESSERA_TRITON_IMAGE", "nvcr.io/nvidia/tritonserver:24.10-py3")
TESSERA_SIM_TRITON_HTTP = env_bool("TESSERA_SIM_TRITON_HTTP", False)  # simulated servers answer HTTP too
TESSERA_SERVING_START_TIMEOUT_S = float(os.environ.get("TESSERA_SERVING_START_TIMEOUT_S", "120"))
TESSERA_DEPLOY_WAIT_S = float(os.environ.get("TESSERA_DEPLOY_WAIT_S", "300"))  # a model waits for its server
TESSERA_RECONCILE_INTERVAL_S = int(os.environ.get("TESSERA_RECONCILE_INTERVAL_S", "60"))
# Inference gateway (manage.py gateway): where tenants call their models, and its limits.
TESSERA_GATEWAY_URL = os.environ.get("TESSERA_GATEWAY_URL", "http://127.0.0.1:8001").rstrip("/")  # shown to tenants
TESSERA_GATEWAY_INTERNAL_URL = os.environ.get("TESSERA_GATEWAY_INTERNAL_URL", "").rstrip("/") or TESSERA_GATEWAY_URL
TESSERA_GATEWAY_REFRESH_S = float(os.environ.get("TESSERA_GATEWAY_REFRESH_S", "2"))  # keys, routes, limits reload
TESSERA_GATEWAY_RPM = int(os.environ.get("TESSERA_GATEWAY_RPM", "600"))  # per key, unless the key sets its own
TESSERA_GATEWAY_TPM = int(os.environ.get("TESSERA_GATEWAY_TPM", "1000000"))  # per key, unless the key sets its own
TESSERA_GATEWAY_MAX_BODY = int(os.environ.get("TESSERA_GATEWAY_MAX_BODY", str(16 * 1024 * 1024)))
TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S = float(os.environ.get("TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S", "300"))
TESSERA_GATEWAY_TRY_TTL_S = 600  # the portal's "Try it" tokens
TESSERA_USAGE_STREAM = os.environ.get("TESSERA_USAGE_STREAM", "tessera:usage")  # Redis stream of served usage
TESSERA_USAGE_SPOOL_DIR = Path(os.environ.get("TESSERA_USAGE_SPOOL_DIR", VAR_DIR / "usage-spool"))  # without Redis
TESSERA_METERING_TOLERANCE = float(os.environ.get("TESSERA_METERING_TOLERANCE", "0.02"))  # metered vs served
TESSERA_API_KEY_LAST_USED_RESOLUTION_S = 60  # write last_used_at at most once a minute per key
TESSERA_INVITATION_TTL_DAYS = 7
# The site's public address (https://portal.example.com) for links in e-mails; empty: the address the
# inviting request came in on (its Host header, which ALLOWED_HOSTS checks).
TESSERA_SITE_URL = os.environ.get("TESSERA_SITE_URL", "").rstrip("/")
# Requests per minute from one client address to the invitation pages (token guessing, password tries).
TESSERA_INVITATION_PAGE_RATE = int(os.environ.get("TESSERA_INVITATION_PAGE_RATE", "30"))
# Capacity planner: what one GPU-hour costs the MSP (hardware amortisation + hosting, power excluded),
# per GPU model key: "h100-sxm-80gb=1.89,h200-sxm-141gb=2.50" (defaults: public marketplace rental
# prices of 2025-26, an upper bound for an owner's cost; set your own).
TESSERA_PLANNER_GPU_HOUR_COST = {
    k.strip(): v.strip() for k, _, v in (item.partition("=") for item in
                                         os.environ.get("TESSERA_PLANNER_GPU_HOUR_COST", "").split(",")) if v.strip()}

# Energy price per kWh (the plans' currency): power cost per 1K tokens, the planner's power cost.
TESSERA_ENERGY_PRICE_PER_KWH = os.environ.get("TESSERA_ENERGY_PRICE_PER_KWH", "0.12")
# Modelled throughput of a whole GPU per TB/s of memory bandwidth (tokens/s); a slice gets its compute share.
TESSERA_TOKENS_PER_S_PER_TBPS = float(os.environ.get("TESSERA_TOKENS_PER_S_PER_TBPS", "3000"))

# Webhook targets in these networks (CIDRs) are allowed although internal (loopback, private, ...).
TESSERA_WEBHOOK_ALLOW_NETWORKS = env_list("TESSERA_WEBHOOK_ALLOW_NETWORKS", "")

# --- Security --------------------------------------------------------------------------------
# API throttling (DRF, counters in the Django cache: Redis in production). Per API key (prefix),
# else per signed-in user, else per client IP. "<n>/<sec|min|hour|day>"; empty disables.
TESSERA_API_RATE = os.environ.get("TESSERA_API_RATE", "600/min")
TESSERA_USAGE_INGEST_RATE = os.environ.get("TESSERA_USAGE_INGEST_RATE", "120/min")  # POST /api/v1/usage/events/
TESSERA_ANON_RATE = os.environ.get("TESSERA_ANON_RATE", "60/min")
REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] = {
    "api": TESSERA_API_RATE or None,
    "usage_ingest": TESSERA_USAGE_INGEST_RATE or None,
    "anon": TESSERA_ANON_RATE or None,
}
# Login lockout (web /login/ and /admin/login/): after MAX_FAILURES failed attempts for one
# (e-mail, client IP) within the window, that pair is locked for LOCKOUT_MINUTES.
TESSERA_LOGIN_MAX_FAILURES = int(os.environ.get("TESSERA_LOGIN_MAX_FAILURES", "5"))
TESSERA_LOGIN_LOCKOUT_MINUTES = int(os.environ.get("TESSERA_LOGIN_LOCKOUT_MINUTES", "15"))
AUTHENTICATION_BACKENDS = ["tenants.lockout.LockoutModelBackend"]
# Behind a TLS-terminating proxy the client IP is the first X-Forwarded-For hop when this is on.
TESSERA_TRUST_X_FORWARDED_FOR = env_bool("TESSERA_TRUST_X_FORWARDED_FOR", False)

# TESSERA_SECURE=1 in production (HTTPS): secure cookies, HSTS, HTTPS redirect.
TESSERA_SECURE = env_bool("TESSERA_SECURE", False)
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
if TESSERA_SECURE:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)  # check --deploy W021; 0 to opt out
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
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
LOG_FORMAT = os.environ.get("LOG_FORMAT", "json")
LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO")
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
TESSERA_UPLOAD_ROOT = Path(os.environ.get("TESSERA_UPLOAD_ROOT", VAR_DIR / "uploads"))
# The MSP's model store: library weights and repositories tenants may import (read-only, same path everywhere).
TESSERA_MODEL_STORE_ROOT = Path(os.environ.get("TESSERA_MODEL_STORE_ROOT", VAR_DIR / "model-store"))
TESSERA_UPLOAD_MAX_BYTES = int(os.environ.get("TESSERA_UPLOAD_MAX_BYTES", str(2 * 1024**3)))  # archive size
# An S3-compatible model store (README: "Models on slices"): when a bucket is set, a tenant's store_path is an
# object key under the prefix, fetched with boto3 (no URL from the tenant: the endpoint is the operator's).
TESSERA_MODEL_STORE_S3_ENDPOINT = os.environ.get("TESSERA_MODEL_STORE_S3_ENDPOINT", "")
TESSERA_MODEL_STORE_S3_BUCKET = os.environ.get("TESSERA_MODEL_STORE_S3_BUCKET", "")
TESSERA_MODEL_STORE_S3_PREFIX = os.environ.get("TESSERA_MODEL_STORE_S3_PREFIX", "")
TESSERA_MODEL_STORE_S3_REGION = os.environ.get("TESSERA_MODEL_STORE_S3_REGION", "us-east-1")
TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID = os.environ.get("TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID", "")
TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY = os.environ.get("TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY", "")
TESSERA_REPO_MAX_EXPANDED_BYTES = int(os.environ.get("TESSERA_REPO_MAX_EXPANDED_BYTES", str(8 * 1024**3)))
TESSERA_REPO_MAX_FILES = int(os.environ.get("TESSERA_REPO_MAX_FILES", "2000"))
DATA_UPLOAD_MAX_NUMBER_FILES = 1
