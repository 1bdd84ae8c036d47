"""PostgreSQL: tell the planner that a usage rollup's deployment determines its tenant. Without it the planner
multiplies the two columns' distinct counts, expects ~25k (tenant, deployment) groups for a month at 1,000
deployments instead of ~1,000, and the usage summary (GROUP BY tenant, deployment) sorts every hourly row on
disk instead of hashing them in memory: 66 ms -> 39 ms at the scale bench's 77k rows a month."""

from django.db import migrations


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("CREATE STATISTICS IF NOT EXISTS telemetry_usagehourly_tenant_deployment (ndistinct) "
                              "ON tenant_id, deployment_id FROM telemetry_usagehourly")
        schema_editor.execute("ANALYZE telemetry_usagehourly")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP STATISTICS IF EXISTS telemetry_usagehourly_tenant_deployment")


class Migration(migrations.Migration):
    dependencies = [("telemetry", "0010_planner_rollups")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
