"""`manage.py create_operator`: the first operator of an installation without the Django admin or a shell."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from tenants.models import AuditEvent, User

pytestmark = pytest.mark.django_db

GOOD = "long-enough passphrase 7"


def _run(monkeypatch, password: str, *args: str) -> str:
    monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
    out = io.StringIO()
    call_command("create_operator", *args, "--password-stdin", stdout=out)
    return out.getvalue()


def test_the_operator_signs_in_and_operates_without_being_a_superuser(monkeypatch, client):
    out = _run(monkeypatch, GOOD, "--email", " Ops@MSP.example ", "--name", "Pat Ops")
    assert "operator ops@msp.example created" in out
    user = User.objects.get(email="ops@msp.example")
    assert user.is_operator and user.is_staff and not user.is_superuser and user.full_name == "Pat Ops"
    assert AuditEvent.objects.filter(action="operator.create", target="user:ops@msp.example").exists()
    assert client.post("/login/", {"username": "ops@msp.example", "password": GOOD}).status_code == 302
    assert client.get("/console/").status_code == 200
    assert client.get("/api/v1/tenants/").status_code == 200  # the API's operator lists too


@pytest.mark.parametrize(("password", "args", "words"), [
    ("short", ["--email", "a@msp.example"], "password: "),
    (GOOD, ["--email", "not-an-address"], "email: is not an e-mail address"),
])
def test_bad_input_says_why_and_stores_nothing(monkeypatch, password, args, words):
    with pytest.raises(CommandError, match=words):
        _run(monkeypatch, password, *args)
    assert not User.objects.exists()


def test_an_existing_user_is_refused_and_left_as_it_was(monkeypatch):
    member = User.objects.create_user(email="pat@msp.example", password=GOOD)
    with pytest.raises(CommandError, match="exists already"):
        _run(monkeypatch, GOOD, "--email", "PAT@msp.example")
    member.refresh_from_db()
    assert not member.is_staff and not member.is_operator
