"""NodeActivity: the GPU samples' activity summed per (node, resolution, time), kept by the database itself.

Triggers on telemetry_gpusample add each inserted, updated or deleted sample's activity x samples and samples to its
node's row (the node of its GPU) in the same transaction, whoever writes the sample; a row is removed with its last
sample. Existing samples are summed here. PostgreSQL: one plpgsql function; SQLite: three triggers.
"""

import django.db.models.deletion
from django.db import migrations, models


WATCHED = "gpu_id, resolution, ts, activity, samples"
NODE = "(SELECT node_id FROM marketplace_gpu WHERE id = {row}.gpu_id)"
KEY = "node_id = {node} AND resolution = {row}.resolution AND ts = {row}.ts"

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION telemetry_node_activity_sync() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE node bigint; left_gpus integer;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.gpu_id = OLD.gpu_id AND NEW.resolution = OLD.resolution AND NEW.ts = OLD.ts THEN
        UPDATE telemetry_nodeactivity SET activity_samples = activity_samples + NEW.activity * NEW.samples
                                                             - OLD.activity * OLD.samples,
                                          samples = samples + NEW.samples - OLD.samples
        WHERE {KEY.format(node=NODE.format(row="NEW"), row="NEW")};
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        node := {NODE.format(row="OLD")};
        UPDATE telemetry_nodeactivity SET activity_samples = activity_samples - OLD.activity * OLD.samples,
                                          samples = samples - OLD.samples, gpus = gpus - 1
        WHERE {KEY.format(node="node", row="OLD")} RETURNING gpus INTO left_gpus;
        IF left_gpus <= 0 THEN
            DELETE FROM telemetry_nodeactivity WHERE {KEY.format(node="node", row="OLD")};
        END IF;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        node := {NODE.format(row="NEW")};
        IF node IS NOT NULL THEN
            INSERT INTO telemetry_nodeactivity (node_id, resolution, ts, activity_samples, samples, gpus)
            VALUES (node, NEW.resolution, NEW.ts, NEW.activity * NEW.samples, NEW.samples, 1)
            ON CONFLICT (node_id, resolution, ts) DO UPDATE SET
                activity_samples = telemetry_nodeactivity.activity_samples + EXCLUDED.activity_samples,
                samples = telemetry_nodeactivity.samples + EXCLUDED.samples, gpus = telemetry_nodeactivity.gpus + 1;
        END IF;
    END IF;
    RETURN NULL;
END $$"""
PG_TRIGGERS = [
    "CREATE TRIGGER telemetry_node_activity_ins AFTER INSERT ON telemetry_gpusample "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_node_activity_sync()",
    f"CREATE TRIGGER telemetry_node_activity_upd AFTER UPDATE OF {WATCHED} ON telemetry_gpusample "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_node_activity_sync()",
    "CREATE TRIGGER telemetry_node_activity_del AFTER DELETE ON telemetry_gpusample "
    "FOR EACH ROW EXECUTE FUNCTION telemetry_node_activity_sync()",
]


def _sq_add(row: str) -> str:
    node = NODE.format(row=row)
    return (f"INSERT OR IGNORE INTO telemetry_nodeactivity (node_id, resolution, ts, activity_samples, samples, gpus) "
            f"SELECT {node}, {row}.resolution, {row}.ts, 0, 0, 0 WHERE {node} IS NOT NULL; "
            f"UPDATE telemetry_nodeactivity SET activity_samples = activity_samples + {row}.activity * {row}.samples, "
            f"samples = samples + {row}.samples, gpus = gpus + 1 WHERE {KEY.format(node=node, row=row)};")


def _sq_remove(row: str) -> str:
    key = KEY.format(node=NODE.format(row=row), row=row)
    return (f"UPDATE telemetry_nodeactivity SET activity_samples = activity_samples - {row}.activity * {row}.samples, "
            f"samples = samples - {row}.samples, gpus = gpus - 1 WHERE {key}; "
            f"DELETE FROM telemetry_nodeactivity WHERE {key} AND gpus <= 0;")


SQLITE_TRIGGERS = [
    f"CREATE TRIGGER telemetry_node_activity_ins AFTER INSERT ON telemetry_gpusample BEGIN {_sq_add('NEW')} END",
    f"CREATE TRIGGER telemetry_node_activity_upd AFTER UPDATE OF {WATCHED} ON telemetry_gpusample "
    f"BEGIN {_sq_remove('OLD')} {_sq_add('NEW')} END",
    f"CREATE TRIGGER telemetry_node_activity_del AFTER DELETE ON telemetry_gpusample BEGIN {_sq_remove('OLD')} END",
]


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        raise NotImplementedError(f"node activity rollups: no triggers for {vendor}")
    schema_editor.execute(
        "INSERT INTO telemetry_nodeactivity (node_id, resolution, ts, activity_samples, samples, gpus) "
        "SELECT g.node_id, s.resolution, s.ts, sum(s.activity * s.samples), sum(s.samples), count(*) "
        "FROM telemetry_gpusample s JOIN marketplace_gpu g ON g.id = s.gpu_id GROUP BY 1, 2, 3")
    for sql in [PG_FUNCTION, *PG_TRIGGERS] if vendor == "postgresql" else SQLITE_TRIGGERS:
        schema_editor.execute(sql)


def drop_triggers(apps, schema_editor):
    pg = schema_editor.connection.vendor == "postgresql"
    for name in ("ins", "upd", "del"):
        schema_editor.execute(f"DROP TRIGGER IF EXISTS telemetry_node_activity_{name}"
                              + (" ON telemetry_gpusample" if pg else ""))
    if pg:
        schema_editor.execute("DROP FUNCTION IF EXISTS telemetry_node_activity_sync()")


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0017_webhook_next_attempt'),
        ('telemetry', '0013_usage_daily'),
    ]

    operations = [
        migrations.CreateModel(
            name='NodeActivity',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('resolution', models.CharField(choices=[('raw', 'Raw (one per collection)'), ('5m', '5-minute averages'), ('1h', 'Hourly averages')], max_length=3)),
                ('ts', models.DateTimeField()),
                ('activity_samples', models.FloatField(default=0.0, help_text="sum of activity x samples over the node's GPUs")),
                ('samples', models.BigIntegerField(default=0)),
                ('gpus', models.IntegerField(default=0, help_text='how many GPU samples the sums are of')),
                ('node', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='marketplace.node')),
            ],
            options={
                'indexes': [models.Index(fields=['resolution', 'ts'], name='telemetry_n_resolut_a049b6_idx')],
                'constraints': [models.UniqueConstraint(fields=('node', 'resolution', 'ts'), name='node_activity_unique')],
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers, elidable=False),
    ]
