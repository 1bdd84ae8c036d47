"""Signed usage events (issue 28, item 3): a process that can write to the gateway's usage stream (a tenant's model
on a node that reaches Redis) but holds no signing key cannot make a bill.

Each test writes as the attacker did, straight into the stream (``XADD``, real Redis when REDIS_URL is set) or into
a spool file (without Redis), and runs the consumer (``metering.consume``): what is unsigned, forged, tampered with
or signed with a key the consumer does not hold is refused, acked (it does not block the group), copied to the
dead letter, counted per reason (/metrics) and raised as one billing alert per burst on the tenant it claimed;
what the gateway's own sinks signed is billed as before, also across a key rotation."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

from marketplace.gateway import metering, signing
from marketplace.gateway.metering import GROUP, RedisStreamSink, SpoolSink
from marketplace.models import BillingAlert
from telemetry import metrics
from telemetry.models import UsageEvent, UsageHourly, UsageRefusal
from tests.factories import DeploymentFactory, TenantFactory, UserFactory
from tests.gateway_fixtures import run_async

pytestmark = pytest.mark.django_db(transaction=True)

KEY_OLD = "old-usage-signing-key-0123456789abcdef"
KEY_NEW = "new-usage-signing-key-fedcba9876543210"
ATTACKER_KEY = b"a key the attacker made up, 32+ bytes long"


@pytest.fixture(params=["redis", "spool"])
def backend(request, settings, tmp_path):
    """Where the gateway's events are durable: the Redis stream (real Redis; skipped without REDIS_URL) or the
    local spool (no Redis)."""
    settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
    settings.TESSERA_USAGE_SPOOL_DIR = tmp_path / "spool"
    settings.TESSERA_USAGE_SIGNING_KEY = ""
    settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = ""
    if request.param == "redis":
        url = os.environ.get("REDIS_URL")
        if not url:
            pytest.skip("REDIS_URL is not set: the stream's tests need a real Redis")
        import redis

        settings.REDIS_URL = url
        r = redis.Redis.from_url(url)
        yield Backend("redis", r, settings)
        r.delete(settings.TESSERA_USAGE_STREAM, metering.dead_letter_stream(settings.TESSERA_USAGE_STREAM))
    else:
        settings.REDIS_URL = ""
        Path(settings.TESSERA_USAGE_SPOOL_DIR).mkdir(parents=True, mode=0o700)
        yield Backend("spool", None, settings)


class Backend:
    def __init__(self, kind, r, settings):
        self.kind, self.r, self.settings = kind, r, settings

    @property
    def stream(self) -> str:
        return self.settings.TESSERA_USAGE_STREAM

    @property
    def spool(self) -> Path:
        return Path(self.settings.TESSERA_USAGE_SPOOL_DIR)

    def hostile(self, fields: dict) -> None:
        """Write one entry as a process on the node would: XADD to the stream, or a line in a spool file."""
        if self.kind == "redis":
            self.r.xadd(self.stream, fields)
        else:
            line = json.dumps({k: v.decode() if isinstance(v, bytes) else v for k, v in fields.items()})
            with (self.spool / f"intruder-{uuid.uuid4().hex[:6]}.jsonl").open("a") as f:
                f.write(line + "\n")

    def gateway(self, events: list[dict]) -> None:
        """Append through the gateway's own sink (what every served request does), on its own event loop."""
        async def run():
            if self.kind == "redis":
                import redis.asyncio as aioredis

                r = aioredis.Redis.from_url(self.settings.REDIS_URL)
                sink = RedisStreamSink(r, self.stream)
            else:
                sink = SpoolSink()
            await sink.start()
            for e in events:
                await sink.append(e)
            await sink.close()
            if self.kind == "redis":
                await r.aclose()

        run_async(run)

    def dead_letter(self) -> list[dict]:
        if self.kind == "redis":
            return [{k.decode(): v.decode(errors="replace") for k, v in fields.items()}
                    for _, fields in self.r.xrange(metering.dead_letter_stream(self.stream))]
        dead = self.spool / metering.DEAD_SPOOL
        return [signing.spool_fields(line.encode()) or {"cut": line}  # a long line is kept cut (not JSON then)
                for line in dead.read_text().splitlines()] if dead.exists() else []

    def left_in_stream(self) -> tuple[int, int]:
        """(entries in the stream, entries pending in the group): (0, 0) once everything was acked and deleted."""
        if self.kind != "redis":
            return 0, 0
        return self.r.xlen(self.stream), int(self.r.xpending(self.stream, GROUP)["pending"])


@pytest.fixture
def victim(tiers):
    """Tenant A with a model (the attacker's target) and tenant B."""
    a, b = TenantFactory(slug="alpha"), TenantFactory(slug="bravo")
    dep = DeploymentFactory(allocation__order__tenant=a, allocation__order__tier=tiers["1g"], name="tiny-gen")
    return {"a": a, "b": b, "dep": dep}


def bill(victim, eid="forged-1", n_in=1_000_000, n_out=2_000_000) -> dict:
    """The attacker's event: 1M input and 2M output tokens on A's model."""
    return metering.event(eid, victim["a"].pk, victim["dep"].pk, n_in, n_out)


def billed(tenant) -> int:
    return UsageEvent.objects.filter(tenant=tenant).count() + UsageHourly.objects.filter(tenant=tenant).count()


def refusals() -> dict[str, int]:
    return dict(UsageRefusal.objects.values_list("reason", "count"))


def open_alerts(tenant) -> list[BillingAlert]:
    return list(BillingAlert.objects.filter(tenant=tenant, kind=BillingAlert.Kind.REFUSED_USAGE,
                                            resolved_at__isnull=True))


# --- refused ----------------------------------------------------------------------------------------------------

def test_an_unsigned_event_written_straight_to_the_stream_is_refused_counted_and_not_billed(backend, victim):
    """The attack as found: B's model appends {"e": json} to the gateway's stream, billing A 1M + 2M tokens."""
    backend.hostile({"e": signing.dumps(bill(victim))})
    assert metering.consume(budget_s=5) == {"processed": 1, "new": 0, "refused": 1}
    assert billed(victim["a"]) == 0
    assert refusals() == {"unsigned": 1}
    assert backend.left_in_stream() == (0, 0)  # acked and deleted: the group is not blocked
    (dead,) = backend.dead_letter()
    assert json.loads(dead["e"])["i"] == 1_000_000
    if backend.kind == "redis":
        assert dead["refused"] == "unsigned" and dead["entry"]
    (alert,) = open_alerts(victim["a"])
    assert "none billed [unsigned=1]" in alert.message
    assert open_alerts(victim["b"]) == []
    assert metering.consume(budget_s=2) == {"processed": 0, "new": 0, "refused": 0}


def test_a_forged_signature_is_refused(backend, victim):
    """The attacker knows the format and the key id (both are in the stream) but not the key."""
    data = signing.dumps(bill(victim))
    kid = signing.keyring().kid  # public: every entry carries it
    forged = signing.Keyring(ATTACKER_KEY).sign(data)
    backend.hostile({"e": data, "k": kid, "s": forged})
    backend.hostile({"e": signing.dumps(bill(victim, "forged-2")), "k": kid, "s": "0" * 64})
    # signed with a key of its own, under that key's id
    backend.hostile(signing.Keyring(ATTACKER_KEY).seal(bill(victim, "forged-3")))
    assert metering.consume(budget_s=5) == {"processed": 3, "new": 0, "refused": 3}
    assert billed(victim["a"]) == 0
    assert refusals() == {"forged": 2, "unknown_key": 1}
    assert len(backend.dead_letter()) == 3 and backend.left_in_stream() == (0, 0)
    (alert,) = open_alerts(victim["a"])  # one alert for the burst, not one per entry
    assert "3 usage event(s)" in alert.message and "[forged=2 unknown_key=1]" in alert.message


def test_an_event_tampered_with_after_signing_is_refused(backend, victim):
    """A signed event read from the stream (anyone who reaches Redis can) with its tokens raised."""
    sealed = signing.keyring().seal(bill(victim, "real-1", 5, 7))
    tampered = dict(sealed, e=sealed["e"].replace(b'"i":5', b'"i":1000000'))  # type: ignore[union-attr]
    assert tampered["e"] != sealed["e"]
    backend.hostile(tampered)
    assert metering.consume(budget_s=5) == {"processed": 1, "new": 0, "refused": 1}
    assert billed(victim["a"]) == 0 and refusals() == {"forged": 1}


def test_malformed_entries_are_refused_and_never_parsed_before_the_signature(backend, victim):
    kr = signing.keyring()
    backend.hostile({"k": kr.kid, "s": "ab" * 32})  # no event
    backend.hostile({"e": b"{not json", "k": kr.kid, "s": kr.sign(b"{not json")})  # signed garbage (a gateway bug)
    backend.hostile({"junk": b"x" * 100_000})  # no signature, a large field: kept cut in the dead letter
    assert metering.consume(budget_s=5) == {"processed": 3, "new": 0, "refused": 3}
    assert refusals() == {"malformed": 2, "unsigned": 1}
    assert billed(victim["a"]) == 0
    assert all(len(json.dumps(d)) < 2 * metering.DEAD_LETTER_FIELD_BYTES for d in backend.dead_letter())
    assert open_alerts(victim["a"]) == []  # they claim no tenant: counted and logged only


# --- billed ------------------------------------------------------------------------------------------------------

def test_events_signed_by_the_gateway_are_billed_and_a_forged_one_beside_them_is_not(backend, victim):
    backend.gateway([bill(victim, f"served-{i}", 5, 7) for i in range(3)])
    backend.hostile({"e": signing.dumps(bill(victim))})
    backend.gateway([bill(victim, "served-3", 5, 7)])
    assert metering.consume(budget_s=5) == {"processed": 5, "new": 4, "refused": 1}
    assert sorted(UsageEvent.objects.filter(tenant=victim["a"]).values_list("event_id", flat=True)) == [
        "served-0", "served-1", "served-2", "served-3"]
    assert set(UsageEvent.objects.values_list("input_tokens", "output_tokens")) == {(5, 7)}
    assert refusals() == {"unsigned": 1}


def test_the_stored_form_is_the_event_json_its_key_id_and_its_hmac(backend, victim, settings):
    settings.TESSERA_USAGE_SIGNING_KEY = KEY_NEW
    e = bill(victim, "served-1", 5, 7)
    backend.gateway([e])
    if backend.kind == "redis":
        ((_, fields),) = backend.r.xrange(backend.stream)
        fields = {k.decode(): v for k, v in fields.items()}
    else:
        (path,) = backend.spool.glob("*.jsonl")
        fields = {k: v.encode() for k, v in json.loads(path.read_text()).items()}
    import hashlib
    import hmac

    assert set(fields) == {"e", "k", "s"} and json.loads(fields["e"]) == e
    assert fields["k"].decode() == signing.key_id(KEY_NEW.encode())
    assert fields["s"].decode() == hmac.new(KEY_NEW.encode(), fields["e"], hashlib.sha256).hexdigest()


def test_key_rotation_accepts_the_previous_key_until_it_is_dropped(backend, victim, settings):
    settings.TESSERA_USAGE_SIGNING_KEY = KEY_OLD
    backend.gateway([bill(victim, "old-1", 1, 1)])  # in the stream when the consumer moves to the new key
    settings.TESSERA_USAGE_SIGNING_KEY, settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = KEY_NEW, KEY_OLD
    backend.gateway([bill(victim, "new-1", 1, 1)])
    assert metering.consume(budget_s=5) == {"processed": 2, "new": 2, "refused": 0}
    settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = ""  # rotation done: the old key is no longer accepted
    old = signing.Keyring(KEY_OLD.encode())
    backend.hostile(old.seal(bill(victim, "old-2", 1, 1)))
    backend.gateway([bill(victim, "new-2", 1, 1)])
    assert metering.consume(budget_s=5) == {"processed": 2, "new": 1, "refused": 1}
    assert refusals() == {"unknown_key": 1}
    assert sorted(UsageEvent.objects.values_list("event_id", flat=True)) == ["new-1", "new-2", "old-1"]


def test_the_default_key_is_derived_from_the_secret_key_and_its_fallbacks(settings):
    settings.TESSERA_USAGE_SIGNING_KEY = settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = ""
    settings.SECRET_KEY = "first-secret-key-" + "x" * 40
    before = signing.keyring()
    sealed = before.seal({"id": "x"})
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "second-secret-key-" + "y" * 40, [settings.SECRET_KEY]
    after = signing.keyring()
    assert after.kid != before.kid and after.open(sealed) == ({"id": "x"}, None)
    assert before.kid != signing.key_id(settings.SECRET_KEY.encode())  # a key of its own, not SECRET_KEY itself
    settings.SECRET_KEY_FALLBACKS = []
    assert signing.keyring().open(sealed) == (None, "unknown_key")


# --- seen by operators ---------------------------------------------------------------------------------------

def test_the_refusals_are_counted_in_metrics(backend, victim, settings):
    backend.hostile({"e": signing.dumps(bill(victim))})
    backend.hostile({"e": signing.dumps(bill(victim, "f2")), "k": signing.keyring().kid, "s": "0" * 64})
    backend.hostile({"e": signing.dumps(bill(victim, "f3")), "k": signing.keyring().kid, "s": "1" * 64})
    metering.consume(budget_s=5)
    settings.TESSERA_METRICS_TOKEN = "metrics-token"
    text = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer metrics-token").content.decode()
    assert "# TYPE tessera_usage_refused_total counter" in text
    for line in ('tessera_usage_refused_total{reason="unsigned"} 1',
                 'tessera_usage_refused_total{reason="forged"} 2',
                 'tessera_usage_refused_total{reason="malformed"} 0',
                 'tessera_usage_refused_total{reason="unknown_key"} 0'):
        assert line in text, line
    assert 'tenant="alpha"' not in "".join(ln for ln in text.splitlines() if "refused" in ln)  # no attacker labels


def test_no_refusal_is_a_zero_series(db):
    text = metrics.render()
    for reason in signing.REASONS:
        assert f'tessera_usage_refused_total{{reason="{reason}"}} 0' in text


def test_one_alert_per_burst_until_an_operator_resolves_it(backend, victim, operator):
    for i in range(3):  # three batches of one burst
        backend.hostile({"e": signing.dumps(bill(victim, f"f{i}"))})
        metering.consume(budget_s=5)
    (alert,) = open_alerts(victim["a"])
    assert UsageRefusal.objects.get(reason="unsigned").count == 3
    assert alert.message.startswith("3 usage event(s) claiming this tenant refused, none billed [unsigned=3]")
    console = Client()
    console.force_login(operator)
    page = console.get(reverse("console:overview_alerts")).content.decode()
    assert "Usage events refused (unsigned or forged)" in page and victim["a"].name in page
    admin = UserFactory(is_staff=True, is_superuser=True)
    c = Client()
    c.force_login(admin)
    r = c.post(reverse("admin:marketplace_billingalert_changelist"),
               {"action": "resolve_refused_usage", "_selected_action": [alert.pk]})
    assert r.status_code == 302 and open_alerts(victim["a"]) == []
    backend.hostile({"e": signing.dumps(bill(victim, "f-next"))})
    metering.consume(budget_s=5)
    (again,) = open_alerts(victim["a"])
    assert again.pk != alert.pk  # a new burst, a new alert
    assert BillingAlert.objects.filter(kind=BillingAlert.Kind.REFUSED_USAGE).count() == 2


def test_the_dead_letter_is_bounded(backend, victim, monkeypatch):
    if backend.kind == "redis":
        monkeypatch.setattr(metering, "DEAD_LETTER_MAXLEN", 10)
        pipe = backend.r.pipeline()
        for i in range(600):
            pipe.xadd(backend.stream, {"e": signing.dumps(bill(victim, f"f{i}"))})
        pipe.execute()
        assert metering.consume(budget_s=10)["refused"] == 600
        # MAXLEN ~: Redis trims whole nodes of its radix tree (stream-node-max-entries, 100 by default)
        assert backend.r.xlen(metering.dead_letter_stream(backend.stream)) <= 10 + 100
    else:
        monkeypatch.setattr(metering, "SPOOL_ROTATE_BYTES", 2_000)
        for i in range(60):
            backend.hostile({"e": signing.dumps(bill(victim, f"f{i}"))})
            metering.consume(budget_s=5)
        sizes = [p.stat().st_size for p in backend.spool.glob(f"{metering.DEAD_SPOOL}*")]
        assert len(sizes) == 2 and all(s <= 2_000 + 4_200 for s in sizes)
    assert billed(victim["a"]) == 0


def test_a_consumer_killed_before_its_ack_refuses_the_entry_again_never_bills_it(backend, victim, monkeypatch):
    if backend.kind != "redis":
        pytest.skip("the stream's consumer group")
    backend.hostile({"e": signing.dumps(bill(victim))})

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed between the count and the ack")

    monkeypatch.setattr(metering, "_dead_letter_fields", die)
    with pytest.raises(KeyboardInterrupt):
        metering.consume(budget_s=5)
    assert backend.left_in_stream() == (1, 1)  # pending, not acked
    monkeypatch.undo()
    monkeypatch.setattr(metering, "CLAIM_IDLE_MS", 0)
    time.sleep(0.01)
    assert metering.consume(budget_s=5)["refused"] == 1
    assert backend.left_in_stream() == (0, 0) and billed(victim["a"]) == 0
    assert refusals() == {"unsigned": 2}  # counted at least once (here twice), billed never


def test_entries_refused_for_a_key_rotated_in_the_wrong_order_can_be_requeued(backend, victim, settings):
    """The gateways got the new key before the consumer: their events are refused (unknown_key), not lost."""
    if backend.kind != "redis":
        pytest.skip("the dead-letter stream")
    from django.core.management import call_command

    settings.TESSERA_USAGE_SIGNING_KEY = KEY_OLD  # the consumer's key
    backend.hostile(signing.Keyring(KEY_NEW.encode()).seal(bill(victim, "served-new", 5, 7)))  # a gateway's
    backend.hostile({"e": signing.dumps(bill(victim)), "k": signing.key_id(KEY_NEW.encode()), "s": "0" * 64})
    assert metering.consume(budget_s=5) == {"processed": 2, "new": 0, "refused": 2}
    settings.TESSERA_USAGE_SIGNING_KEY, settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = KEY_NEW, KEY_OLD  # fixed
    call_command("usage_consumer", "--requeue-refused")
    assert metering.consume(budget_s=5) == {"processed": 1, "new": 1, "refused": 0}
    assert list(UsageEvent.objects.values_list("event_id", "input_tokens")) == [("served-new", 5)]
    (left,) = backend.dead_letter()  # the forged one stays, with the reason it was refused for then
    assert left["refused"] == "unknown_key" and json.loads(left["e"])["id"] == "forged-1"
    assert signing.keyring().open({k: v.encode() for k, v in left.items()}) == (None, "forged")
    assert metering.requeue_refused() == (0, 1)
