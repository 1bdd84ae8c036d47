"""The test provider's Django settings (its own SQLite database and RSA key, from the environment serve.py sets)."""

import os

SECRET_KEY = "oidc-provider-for-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "tests.oidc_provider.urls"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions",
                  "oauth2_provider"]
MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware", "django.middleware.csrf.CsrfViewMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware"]
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates",
              "DIRS": [os.path.join(os.path.dirname(__file__), "templates")],
              "OPTIONS": {"context_processors": ["django.template.context_processors.request"]}}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["OIDC_PROVIDER_DB"]}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
LOGIN_URL = "/login/"
SESSION_COOKIE_NAME = "provider_session"  # the browser also holds Tessera's cookies for 127.0.0.1
CSRF_COOKIE_NAME = "provider_csrf"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # test users only: fast
OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RP_INITIATED_LOGOUT_ENABLED": True,
    "OIDC_RP_INITIATED_LOGOUT_ALWAYS_PROMPT": False,
    "OIDC_RSA_PRIVATE_KEY": os.environ.get("OIDC_PROVIDER_RSA_KEY", ""),
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.validator.Validator",
    "SCOPES": {"openid": "OpenID Connect", "email": "e-mail", "profile": "profile and groups"},
    "PKCE_REQUIRED": False,
}
