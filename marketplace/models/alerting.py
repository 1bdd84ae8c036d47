"""What services.alerting last sent: one row per alarm firing (selectors.alarms' key), so Alertmanager is told
when an alarm resolves and the mail/webhook fallback notifies once per firing and once per resolution."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AlarmState(models.Model):
    key = models.CharField(max_length=400, unique=True, help_text="alertname|node|tenant")
    labels = models.JSONField(default=dict)
    summary = models.CharField(max_length=500, blank=True, default="")
    started_at = models.DateTimeField(default=timezone.now)
    last_sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return self.key
