"""One spend figure and one spend-limit rule (issue 30): billing.spend's SQL rule (`reached`) is the rule in
Decimal arithmetic for every limit, ratio and spend (property test), and orders, the gateway, the API, the console
and the portal give the same answer for no limit (None), a limit of 0 (nothing may be spent) and a limit."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.gateway.state import Loader
from marketplace.models import Invoice
from marketplace.services import billing, orders
from marketplace.services.billing import spend
from marketplace.web import console
from tenants.models import Tenant
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import InvoiceFactory, MembershipFactory, TenantFactory, make_key

pytestmark = pytest.mark.django_db
D = Decimal


def rule(spent: Decimal, limit: Decimal | None, ratio: Decimal) -> bool:
    """The spend-limit rule as the README states it, in exact Decimal arithmetic."""
    return limit is not None and spent >= limit * ratio


cents = st.integers(min_value=0, max_value=10**13).map(lambda n: D(n) / 100)  # up to 14 digits, 2 places
ratios = st.integers(min_value=0, max_value=999).map(lambda n: D(n) / 100)
#: (limit: None, 0 or an amount; warn ratio; block ratio; spend: none (no invoice), an amount, or near a threshold)
cases = st.lists(st.tuples(st.one_of(st.none(), st.just(D(0)), cents), ratios, ratios,
                           st.one_of(st.none(), cents, st.tuples(st.sampled_from([-1, 0, 1]), st.booleans()))),
                 min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=cases)
def test_the_sql_rule_is_the_rule_in_decimal_arithmetic(cases):
    month = billing.month_of(datetime.now(UTC))
    with transaction.atomic():
        want = {}
        for i, (limit, r1, r2, spent) in enumerate(cases):
            warn_ratio, block_ratio = min(r1, r2), max(r1, r2)
            if isinstance(spent, tuple):  # a cent below, at or above a threshold (where rounding would show)
                step, at_block = spent
                base = (limit or D(0)) * (block_ratio if at_block else warn_ratio)
                spent = max(D(0), billing.money(base) + step * D("0.01"))
            t = TenantFactory(monthly_spend_limit=limit, spend_warn_ratio=warn_ratio, spend_block_ratio=block_ratio)
            if spent is not None:
                InvoiceFactory(tenant=t, period_start=month, total=spent)
            total = D(0) if spent is None else spent
            want[t.pk] = (rule(total, limit, warn_ratio), rule(total, limit, block_ratio), total)
            assert i < 12
        got = {r["pk"]: (r["warn"], r["is_blocked"], spend.Spend.from_row(r, month).spend)
               for r in spend.figures(Tenant.objects.filter(pk__in=want), month).values(*spend.FULL_ROW)}
        assert got == want
        transaction.set_rollback(True)


@pytest.fixture
def acme(db):
    tenant = TenantFactory(slug="acme", currency="USD")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    return tenant, owner


def readers(tenant: Tenant, owner, operator, client_for) -> dict[str, bool]:
    """Is `tenant` blocked, as each reader of the spend figure answers it."""
    tenant.refresh_from_db()
    try:
        billing.check_can_order(tenant)
        by_orders = False
    except billing.SpendLimitReached:
        by_orders = True
    _, key = make_key(tenant, ["billing:read"])
    api = client_for(key=key).get("/api/v1/billing/spend/").json()["results"]
    home = client_for(user=owner).get("/portal/").content.decode()
    page = client_for(user=operator).get(f"/console/tenants/{tenant.pk}/").content.decode()
    return {
        "orders": by_orders,
        "gateway": Loader().load().tenants[tenant.pk].spend_blocked,
        "api": api[0]["blocked"],
        "console overview": any(s.blocked for s in console.spend_alerts() if s.tenant_id == tenant.pk),
        "console tenant page": '<span class="badge failed">blocked</span>' in page,
        "portal": "Spend limit reached" in home or "Spend limit 0" in home,
    }


@pytest.fixture
def client_for():
    from django.test import Client

    def make(user=None, key=None):
        c = Client()
        if user is not None:
            c.force_login(user)
        if key is not None:
            c.defaults["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        return c
    return make


@pytest.mark.parametrize(("limit", "spent", "blocked"), [
    (None, None, False),  # no limit, nothing used
    (None, D("5000.00"), False),  # no limit: never blocked
    (D(0), None, True),  # 0: nothing may be spent, from the start of the month
    (D(0), D("0.01"), True),
    (D("10.00"), D("9.99"), False),
    (D("10.00"), D("10.00"), True),  # at the block ratio (1.00)
])
def test_orders_gateway_api_console_and_portal_give_one_answer(acme, operator, client_for, limit, spent, blocked):
    tenant, owner = acme
    tenant.monthly_spend_limit = limit
    tenant.save()
    if spent is not None:
        InvoiceFactory(tenant=tenant, period_start=billing.month_of(datetime.now(UTC)), total=spent,
                       rated_at=datetime.now(UTC))
    answers = readers(tenant, owner, operator, client_for)
    assert answers == dict.fromkeys(answers, blocked)


def test_an_order_refused_by_a_limit_of_0_says_so(acme, h100_node, tiers):
    tenant, owner = acme
    tenant.monthly_spend_limit = D(0)
    tenant.save()
    with pytest.raises(billing.SpendLimitReached, match="limit is 0 USD: nothing may be spent"):
        orders.create_order(principal_for_user(owner), tenant=tenant, tier=tiers["1g"])


def test_the_answer_says_how_fresh_the_figure_is(acme, operator, client_for):
    tenant, owner = acme
    tenant.monthly_spend_limit = D("1.00")
    tenant.save()
    rated = datetime(2026, 12, 4, 10, 30, tzinfo=UTC)
    month = billing.month_of(datetime.now(UTC))
    InvoiceFactory(tenant=tenant, period_start=month, total=D("2.00"), rated_at=rated)
    s = spend.of(tenant)
    assert s.rated_at == rated and "as rated at 2026-12-04 10:30:00 UTC" in s.message
    row = client_for(user=operator).get("/api/v1/billing/spend/?tenant=acme").json()["results"][0]
    assert row["rated_at"] == "2026-12-04T10:30:00Z" and row["blocked"] and row["ratio"] == 2.0
    assert Loader().load().tenants[tenant.pk].spend_message == s.message
    Invoice.objects.filter(tenant=tenant).delete()
    assert spend.of(tenant).rated_at is None and spend.of(tenant).as_of == "nothing rated this month yet"


def test_operators_set_no_limit_and_0_in_the_api_and_the_console(acme, operator, client_for, as_user):
    tenant, _owner = acme
    api = as_user(operator)
    assert api.patch("/api/v1/tenants/acme/", {"monthly_spend_limit": "0"}, format="json").status_code == 200
    tenant.refresh_from_db()
    assert tenant.monthly_spend_limit == D(0)
    assert api.patch("/api/v1/tenants/acme/", {"monthly_spend_limit": None}, format="json").status_code == 200
    tenant.refresh_from_db()
    assert tenant.monthly_spend_limit is None
    form = {"max_slices": tenant.max_slices, "max_slices_per_tier": tenant.max_slices_per_tier,
            "max_memory_gb": tenant.max_memory_gb, "spend_warn_ratio": "0.80", "spend_block_ratio": "1.00"}
    c = client_for(user=operator)
    assert c.post(f"/console/tenants/{tenant.pk}/", {**form, "monthly_spend_limit": "0"}).status_code == 302
    tenant.refresh_from_db()
    assert tenant.monthly_spend_limit == D(0)
    assert "nothing may be spent" in c.get(f"/console/tenants/{tenant.pk}/").content.decode()
    assert c.post(f"/console/tenants/{tenant.pk}/", {**form, "monthly_spend_limit": ""}).status_code == 302
    tenant.refresh_from_db()
    assert tenant.monthly_spend_limit is None


@pytest.mark.django_db(transaction=True)
def test_the_migration_turns_a_stored_0_into_no_limit():
    """Until 0004 a stored 0 meant "no limit" to orders, the API and the console: it becomes null (no limit), and
    a limit stays as it was."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("tenants", "0003_gateway_inference")], [("tenants", "0004_spend_limit_zero_means_zero")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("tenants", "Tenant")
    zero = old.objects.create(name="Z", slug="zero", billing_email="z@z.example", monthly_spend_limit=D(0))
    some = old.objects.create(name="S", slug="some", billing_email="s@s.example", monthly_spend_limit=D("5.00"))
    executor = MigrationExecutor(connection)
    try:
        executor.migrate(after)
        new = executor.loader.project_state(after).apps.get_model("tenants", "Tenant")
        assert new.objects.get(pk=zero.pk).monthly_spend_limit is None
        assert new.objects.get(pk=some.pk).monthly_spend_limit == D("5.00")
    finally:  # back to the latest schema, for the tests after this one
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
