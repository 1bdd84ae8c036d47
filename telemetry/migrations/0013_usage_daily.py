"""UsageDaily: the hourly usage rollups summed per (tenant, deployment, UTC day), kept by the database itself.

Triggers on telemetry_usagehourly add each inserted, updated or deleted hourly row's sums to its day in the same
transaction, whoever writes the row; a day's row is removed with its last hour. Existing hours are summed into
days here. An update that touches only the billed_* columns (the rating) does not fire them. PostgreSQL: one
plpgsql function; SQLite: three triggers of plain statements.
"""

import django.db.models.deletion
from django.db import migrations, models


SUMS = ("input_tokens", "output_tokens", "requests", "events")
WATCHED = "tenant_id, deployment_id, hour, input_tokens, output_tokens, requests, events"

PG_DAY = "date_trunc('day', {row}.hour, 'UTC')"
PG_KEY = "tenant_id = {row}.tenant_id AND deployment_id = {row}.deployment_id AND day = " + PG_DAY
PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION telemetry_usage_daily_sync() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE left_hours integer;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.tenant_id = OLD.tenant_id AND NEW.deployment_id = OLD.deployment_id
            AND {PG_DAY.format(row="NEW")} = {PG_DAY.format(row="OLD")} THEN
        UPDATE telemetry_usagedaily SET {", ".join(f"{c} = {c} + (NEW.{c} - OLD.{c})" for c in SUMS)}
        WHERE {PG_KEY.format(row="NEW")};
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE telemetry_usagedaily SET {", ".join(f"{c} = {c} - OLD.{c}" for c in SUMS)}, hours = hours - 1
        WHERE {PG_KEY.format(row="OLD")} RETURNING hours INTO left_hours;
        IF left_hours <= 0 THEN
            DELETE FROM telemetry_usagedaily WHERE {PG_KEY.format(row="OLD")};
        END IF;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO telemetry_usagedaily (tenant_id, deployment_id, day, {", ".join(SUMS)}, hours)
        VALUES (NEW.tenant_id, NEW.deployment_id, {PG_DAY.format(row="NEW")}, {", ".join(f"NEW.{c}" for c in SUMS)}, 1)
        ON CONFLICT (tenant_id, deployment_id, day) DO UPDATE SET
            {", ".join(f"{c} = telemetry_usagedaily.{c} + EXCLUDED.{c}" for c in SUMS)},
            hours = telemetry_usagedaily.hours + 1;
    END IF;
    RETURN NULL;
END $$"""
PG_TRIGGERS = [
    "CREATE TRIGGER telemetry_usage_daily_ins AFTER INSERT ON telemetry_usagehourly "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_usage_daily_sync()",
    f"CREATE TRIGGER telemetry_usage_daily_upd AFTER UPDATE OF {WATCHED} ON telemetry_usagehourly "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_usage_daily_sync()",
    "CREATE TRIGGER telemetry_usage_daily_del AFTER DELETE ON telemetry_usagehourly "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_usage_daily_sync()",
]

# SQLite: Django stores a datetime as UTC text 'YYYY-MM-DD HH:MM:SS[.ffffff]'; its day is the first 10 characters
SQ_DAY = "substr({row}.hour, 1, 10) || ' 00:00:00'"
SQ_KEY = "tenant_id = {row}.tenant_id AND deployment_id = {row}.deployment_id AND day = " + SQ_DAY


def _sq_add(row: str) -> str:
    return (f"INSERT OR IGNORE INTO telemetry_usagedaily (tenant_id, deployment_id, day, {', '.join(SUMS)}, hours) "
            f"VALUES ({row}.tenant_id, {row}.deployment_id, {SQ_DAY.format(row=row)}, 0, 0, 0, 0, 0); "
            f"UPDATE telemetry_usagedaily SET {', '.join(f'{c} = {c} + {row}.{c}' for c in SUMS)}, hours = hours + 1 "
            f"WHERE {SQ_KEY.format(row=row)};")


def _sq_remove(row: str) -> str:
    return (f"UPDATE telemetry_usagedaily SET {', '.join(f'{c} = {c} - {row}.{c}' for c in SUMS)}, hours = hours - 1 "
            f"WHERE {SQ_KEY.format(row=row)}; "
            f"DELETE FROM telemetry_usagedaily WHERE {SQ_KEY.format(row=row)} AND hours <= 0;")


SQLITE_TRIGGERS = [
    f"CREATE TRIGGER telemetry_usage_daily_ins AFTER INSERT ON telemetry_usagehourly BEGIN {_sq_add('NEW')} END",
    f"CREATE TRIGGER telemetry_usage_daily_upd AFTER UPDATE OF {WATCHED} ON telemetry_usagehourly "
    f"BEGIN {_sq_remove('OLD')} {_sq_add('NEW')} END",
    f"CREATE TRIGGER telemetry_usage_daily_del AFTER DELETE ON telemetry_usagehourly BEGIN {_sq_remove('OLD')} END",
]


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        day, statements = PG_DAY.format(row="h"), [PG_FUNCTION, *PG_TRIGGERS]
    elif vendor == "sqlite":
        day, statements = SQ_DAY.format(row="h"), SQLITE_TRIGGERS
    else:
        raise NotImplementedError(f"usage daily rollups: no triggers for {vendor}")
    schema_editor.execute(
        f"INSERT INTO telemetry_usagedaily (tenant_id, deployment_id, day, {', '.join(SUMS)}, hours) "
        f"SELECT h.tenant_id, h.deployment_id, {day}, {', '.join(f'sum(h.{c})' for c in SUMS)}, count(*) "
        f"FROM telemetry_usagehourly h GROUP BY 1, 2, 3")
    for sql in statements:
        schema_editor.execute(sql)


def drop_triggers(apps, schema_editor):
    for name in ("ins", "upd", "del"):
        on = " ON telemetry_usagehourly" if schema_editor.connection.vendor == "postgresql" else ""
        schema_editor.execute(f"DROP TRIGGER IF EXISTS telemetry_usage_daily_{name}{on}")
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS telemetry_usage_daily_sync()")


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0017_webhook_next_attempt'),
        ('telemetry', '0012_usage_refusal'),
        ('tenants', '0004_spend_limit_zero_means_zero'),
    ]

    operations = [
        migrations.CreateModel(
            name='UsageDaily',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('day', models.DateTimeField(help_text='start of the UTC day')),
                ('input_tokens', models.BigIntegerField(default=0)),
                ('output_tokens', models.BigIntegerField(default=0)),
                ('requests', models.BigIntegerField(default=0)),
                ('events', models.BigIntegerField(default=0)),
                ('hours', models.IntegerField(default=0, help_text="how many hourly rows the day's sums are of")),
                ('deployment', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING,
                                                 related_name='+', to='marketplace.modeldeployment')),
                ('tenant', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING,
                                             related_name='+', to='tenants.tenant')),
            ],
            options={
                'indexes': [models.Index(fields=['day'], name='telemetry_u_day_bd54c8_idx')],
                'constraints': [models.UniqueConstraint(fields=('tenant', 'deployment', 'day'),
                                                        name='usage_day_unique')],
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers, elidable=False),
    ]
