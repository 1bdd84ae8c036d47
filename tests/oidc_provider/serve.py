"""Run the test provider: ``python -m tests.oidc_provider.serve PORT CONFIG_JSON`` — migrate its own SQLite
database, make the users (username, e-mail, password, groups) and the one client (id, secret, redirect URI,
post-logout redirect URI) from CONFIG_JSON, print "ready" and serve on 127.0.0.1:PORT (threaded WSGI)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class _Threaded(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


def _rsa_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def main() -> None:
    port, config = int(sys.argv[1]), json.loads(open(sys.argv[2]).read())
    os.environ["OIDC_PROVIDER_DB"] = os.path.join(tempfile.mkdtemp(prefix="oidc-provider-"), "db.sqlite3")
    os.environ["OIDC_PROVIDER_RSA_KEY"] = _rsa_key()
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.oidc_provider.settings"
    import django

    django.setup()
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from django.core.wsgi import get_wsgi_application
    from oauth2_provider.models import Application

    call_command("migrate", verbosity=0)
    for u in config["users"]:
        user = User.objects.create_user(u["username"], u["email"], u["password"])
        for name in u.get("groups", []):
            user.groups.add(Group.objects.get_or_create(name=name)[0])
    c = config["client"]
    Application.objects.create(
        client_id=c["id"], client_secret=c["secret"], name="tessera", skip_authorization=True,
        client_type=Application.CLIENT_CONFIDENTIAL, authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=c["redirect_uri"], post_logout_redirect_uris=c["post_logout_redirect_uri"],
        algorithm=Application.RS256_ALGORITHM)
    server = make_server("127.0.0.1", port, get_wsgi_application(), server_class=_Threaded, handler_class=_Quiet)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
