"""Tessera's own alarms (selectors.alarms) to the operators' pager.

With TESSERA_ALERTMANAGER_URL: every cycle (beat's `send-alerts`, TESSERA_ALERT_INTERVAL_S) POSTs each firing alarm
to Alertmanager's `/api/v2/alerts` with stable labels and an `endsAt` three cycles ahead, which is Alertmanager's
own model: it deduplicates by labels, and an alert no longer sent resolves at its `endsAt`. An alarm that cleared
since the last cycle is sent once more with `endsAt` now, so it resolves at once. A Prometheus rule over
`tessera_alarm` gives the same labels, so Alertmanager merges the two.

Without it: each alarm's firing and its resolution are mailed once to TESSERA_ALERT_EMAILS and/or POSTed once to
TESSERA_ALERT_WEBHOOK_URL (Alertmanager's webhook payload, version 4). AlarmState remembers what was sent; a send
that fails changes nothing there, so the next cycle tries again."""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction

from marketplace.models import AlarmState
from marketplace.selectors import alarms as alarms_sel
from marketplace.selectors.alarms import Alarm

log = logging.getLogger(__name__)

#: an alert Alertmanager is sent stays firing this many cycles if Tessera stops sending (then resolves)
ENDS_AFTER_CYCLES = 3
TIMEOUT_S = 10


@dataclass
class Sent:
    firing: int
    new: int
    resolved: int
    target: str  # "alertmanager", "fallback" or "" (nowhere configured)


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _post_json(url: str, body: object) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "tessera-alerting"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        resp.read()


def _generator_url() -> str:
    return f"{settings.TESSERA_SITE_URL}/console/" if settings.TESSERA_SITE_URL else ""


def _alert(labels: dict, summary: str, starts: datetime, ends: datetime) -> dict:
    return {"labels": labels, "annotations": {"summary": summary, "runbook": f"README: Alerts, {labels['alertname']}"},
            "startsAt": _iso(starts), "endsAt": _iso(ends), "generatorURL": _generator_url()}


def send(now: datetime) -> Sent:
    """One cycle: read the alarm set, send it, remember what was sent (see the module docstring)."""
    current = {a.key: a for a in alarms_sel.current(now)}
    states = {s.key: s for s in AlarmState.objects.all()}
    new = [a for k, a in current.items() if k not in states]
    gone = [s for k, s in states.items() if k not in current]
    if settings.TESSERA_ALERTMANAGER_URL:
        ends = now + timedelta(seconds=ENDS_AFTER_CYCLES * settings.TESSERA_ALERT_INTERVAL_S)
        body = [_alert(a.labels, a.summary, states[k].started_at if k in states else now, ends)
                for k, a in current.items()]
        body += [_alert(s.labels, s.summary, s.started_at, now) for s in gone]
        if body:
            _post_json(f"{settings.TESSERA_ALERTMANAGER_URL}/api/v2/alerts", body)
        _remember(now, current, new, gone)
        return Sent(len(current), len(new), len(gone), "alertmanager")
    if not (settings.TESSERA_ALERT_EMAILS or settings.TESSERA_ALERT_WEBHOOK_URL):
        return Sent(len(current), 0, 0, "")
    if new or gone:
        _notify(now, new, gone, {s.key: s.started_at for s in states.values()})
    _remember(now, current, new, gone)
    return Sent(len(current), len(new), len(gone), "fallback")


def _remember(now: datetime, current: dict[str, Alarm], new: list[Alarm], gone: list[AlarmState]) -> None:
    with transaction.atomic():
        AlarmState.objects.filter(pk__in=[s.pk for s in gone]).delete()
        AlarmState.objects.bulk_create([AlarmState(key=a.key, labels=a.labels, summary=a.summary[:500],
                                                   started_at=now, last_sent_at=now) for a in new],
                                       ignore_conflicts=True)
        AlarmState.objects.filter(key__in=list(current)).update(last_sent_at=now)


def _notify(now: datetime, new: list[Alarm], gone: list[AlarmState], started: dict[str, datetime]) -> None:
    """The fallback: one mail and/or one webhook POST for this cycle's firings and resolutions."""
    alerts = [{"status": "firing", **_alert(a.labels, a.summary, now, now), "endsAt": "0001-01-01T00:00:00Z"}
              for a in new]
    alerts += [{"status": "resolved", **_alert(s.labels, s.summary, started.get(s.key, now), now)} for s in gone]
    if settings.TESSERA_ALERT_WEBHOOK_URL:
        _post_json(settings.TESSERA_ALERT_WEBHOOK_URL, {
            "version": "4", "receiver": "tessera", "status": "firing" if new else "resolved",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": _generator_url(),
            "alerts": alerts})
    if settings.TESSERA_ALERT_EMAILS:
        lines = [f"FIRING   {a.summary} [{a.severity}]" for a in new]
        lines += [f"RESOLVED {s.summary}" for s in gone]
        subject = f"[Tessera] {len(new)} alarm(s) firing, {len(gone)} resolved"
        send_mail(subject, "\n".join(lines) + "\n\nRunbooks: README, section Alerts.\n",
                  settings.DEFAULT_FROM_EMAIL, settings.TESSERA_ALERT_EMAILS)
