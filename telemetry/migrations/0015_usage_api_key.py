"""Usage events and hourly rollups carry the API key (its prefix) the gateway served them for; the hourly rollups'
unique key includes it.

SQLite rebuilds a table to change its constraints, and a rebuilt table has lost its triggers: the daily rollups'
triggers (0013_usage_daily) are made again here, on SQLite only (PostgreSQL alters the table in place).
"""

import importlib

from django.db import migrations, models


def remake_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "sqlite":
        return
    daily = importlib.import_module("telemetry.migrations.0013_usage_daily")
    for name in ("ins", "upd", "del"):
        schema_editor.execute(f"DROP TRIGGER IF EXISTS telemetry_usage_daily_{name}")
    for sql in daily.SQLITE_TRIGGERS:
        schema_editor.execute(sql)


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0017_webhook_next_attempt'),
        ('telemetry', '0014_node_activity'),
        ('tenants', '0005_key_limit_ceilings'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='usagehourly',
            name='usage_hour_unique',
        ),
        migrations.AddField(
            model_name='usageevent',
            name='api_key',
            field=models.CharField(blank=True, default='', help_text='the prefix of the API key the gateway served the request for; empty: none (reported usage, a portal session)', max_length=16),
        ),
        migrations.AddField(
            model_name='usagehourly',
            name='api_key',
            field=models.CharField(blank=True, default='', help_text='the prefix of the API key the usage was served for; empty: none', max_length=16),
        ),
        migrations.AddConstraint(
            model_name='usagehourly',
            constraint=models.UniqueConstraint(fields=('tenant', 'deployment', 'adapter', 'api_key', 'hour'), name='usage_hour_unique'),
        ),
        migrations.RunPython(remake_sqlite_triggers, migrations.RunPython.noop, elidable=False),
    ]
