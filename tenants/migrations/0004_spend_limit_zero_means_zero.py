"""A spend limit of 0 now means "nothing may be spent" (blocked from the start of the month); no limit is null.

Until now the orders' check, the spend API and the console read a stored 0 as "no limit" (the gateway read it as
"block everything"), so every 0 stored today was meant as "no limit": this data migration turns each stored 0 into
null, which keeps those tenants' orders and spend answers as they were and stops the gateway refusing their
inference. Reversing it leaves the nulls alone (a null set on purpose cannot be told from a converted 0).
"""

from decimal import Decimal

import django.core.validators
from django.db import migrations, models


def zero_is_no_limit(apps, schema_editor):
    Tenant = apps.get_model("tenants", "Tenant")
    Tenant.objects.filter(monthly_spend_limit=0).update(monthly_spend_limit=None)


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0003_gateway_inference"),
    ]

    operations = [
        migrations.RunPython(zero_is_no_limit, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="tenant",
            name="monthly_spend_limit",
            field=models.DecimalField(
                blank=True, decimal_places=2,
                help_text="empty (null) = no limit; 0 = nothing may be spent; in the invoice's currency",
                max_digits=14, null=True, validators=[django.core.validators.MinValueValidator(Decimal("0"))]),
        ),
    ]
