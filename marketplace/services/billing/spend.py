"""Spend limits: one spend figure and one rule, read by orders, the gateway, the API, the console and the portal.

The figure (`figures`): a tenant's spend in a month is its month's invoice as last rated: a draft's total as of its
`rated_at` (the rating beat re-rates every draft each TESSERA_RATING_INTERVAL_S, and `POST .../refresh/` on
request), or a finalized invoice's final total (a month finalized early counts its final total). No invoice that
month: nothing was used, 0 (`rated_at` null). Nothing is rated to answer it, so every reader sees the same figure,
and each answer carries `rated_at`: how fresh it is. The gateway reads it (with its keys and routes) every
TESSERA_GATEWAY_REFRESH_S, so its view lags the stored figure by at most that.

The limit (`Tenant.monthly_spend_limit`, in the invoice's currency):

* None: no limit; never warned, never blocked.
* 0: nothing may be spent: blocked (no new order, no inference) from the start of the month, spend or not.
* otherwise: warned when spend >= limit x spend_warn_ratio, blocked when spend >= limit x spend_block_ratio.

The rule (`reached`) is written once, in SQL, because the spend list filters and pages by it in the database and
the gateway reads every tenant's at once; one tenant's answer (`of`) is the same query for one row. It is exact
on both databases (`AtLeast`: numerics on PostgreSQL, integer hundredths on SQLite, whose decimals are floats);
tests/unit/test_spend_rule.py holds it to the rule in Decimal arithmetic (a property test) and checks that the five
readers give the same answer for None, 0 and a limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from django.db import transaction
from django.db.models import (
    BigIntegerField,
    BooleanField,
    Case,
    DecimalField,
    ExpressionWrapper,
    F,
    FilteredRelation,
    Func,
    Q,
    QuerySet,
    Value,
    When,
)
from django.db.models.expressions import Combinable
from django.db.models.functions import Cast, Coalesce, Round
from django.db.models.lookups import GreaterThanOrEqual
from django.utils import timezone

from marketplace.models import SpendNotice
from marketplace.services import webhooks
from tenants.errors import ServiceError
from tenants.models import Tenant

from .units import money, month_of

MONEY = DecimalField(max_digits=14, decimal_places=2)

#: the values of a `figures` row a list reads (the spend API: no more columns than it shows, they cost per row)
ROW = ("slug", "currency", "monthly_spend_limit", "spend", "invoice_currency", "invoice_status", "rated_at", "warn",
       "is_blocked")
#: ... and all a `Spend` can say (the tenant's id and name, the warning and block amounts)
FULL_ROW = (*ROW, "pk", "name", "spend_warn_ratio", "spend_block_ratio")


class SpendLimitReached(ServiceError):
    status_code = 409


def _hundredths(expr: Combinable) -> Cast:
    """expr x 100 as an exact integer (money and ratios have two decimal places): SQLite's REAL rounded back to the
    integer it stands for."""
    return Cast(Round(ExpressionWrapper(expr * Value(100), output_field=DecimalField())), BigIntegerField())


class AtLeast(Func):
    """spend >= limit x ratio, exactly on each database: PostgreSQL compares numerics (exact as they are); SQLite,
    whose decimals are floating point, compares integer hundredths (spend x 100 x 100 >= limit x 100 x ratio x
    100). NULL when the limit is NULL."""

    arity = 3
    output_field = BooleanField()

    def _compile(self, compiler, connection, lhs, rhs):
        expr = GreaterThanOrEqual(lhs, rhs).resolve_expression(compiler.query, allow_joins=False)
        return compiler.compile(expr)

    def as_sql(self, compiler, connection, **extra_context):
        spend, limit, ratio = self.get_source_expressions()
        return self._compile(compiler, connection, spend, ExpressionWrapper(limit * ratio, output_field=MONEY))

    def as_sqlite(self, compiler, connection, **extra_context):
        spend, limit, ratio = self.get_source_expressions()
        return self._compile(compiler, connection,
                             ExpressionWrapper(_hundredths(spend) * Value(100), output_field=BigIntegerField()),
                             ExpressionWrapper(_hundredths(limit) * _hundredths(ratio), output_field=BigIntegerField()))


def reached(spend: Combinable, ratio: str) -> Case:
    """SQL, THE spend-limit rule: true when the tenant has a limit and spend >= limit x `ratio` (a Tenant field:
    spend_warn_ratio, spend_block_ratio); false without a limit (the NULL limit makes the comparison NULL)."""
    return Case(When(AtLeast(spend, F("monthly_spend_limit"), F(ratio)), then=Value(True)), default=Value(False),
                output_field=BooleanField())


def figures(tenants: QuerySet[Tenant], period_start: date, *, warn: bool | None = None,
            blocked: bool | None = None) -> QuerySet[Tenant]:
    """`tenants` with their spend figure for the month of `period_start` and the rule's answers (see the module
    docstring), in the same query: spend, invoice_currency, invoice_status (null: no invoice), rated_at, warn,
    is_blocked; only those at (True) or below (False) the warning or block ratio when `warn` or `blocked` is given.
    The month's invoice is a LEFT JOIN (one per tenant and month)."""
    qs = tenants.annotate(month=FilteredRelation("invoices", condition=Q(invoices__period_start=period_start)))
    qs = qs.annotate(spend=Coalesce(F("month__total"), Value(Decimal(0)), output_field=MONEY),
                     invoice_currency=F("month__currency"), invoice_status=F("month__status"),
                     rated_at=F("month__rated_at"))
    qs = qs.annotate(warn=reached(F("spend"), "spend_warn_ratio"),
                     is_blocked=reached(F("spend"), "spend_block_ratio"))
    if warn is not None:
        qs = qs.filter(warn=warn)
    if blocked is not None:
        qs = qs.filter(is_blocked=blocked)
    return qs


@dataclass(frozen=True)
class Spend:
    """One tenant's spend figure and the rule's answers, as `figures` gives them (a row of ROW; of FULL_ROW for the
    tenant's id and name and the warning and block amounts)."""

    slug: str
    period_start: date
    spend: Decimal
    currency: str
    limit: Decimal | None
    warn: bool
    blocked: bool
    status: str | None  # the month's invoice's; None: no invoice, nothing used
    rated_at: datetime | None  # when the figure was rated; None: no invoice this month (spend 0)
    tenant_id: int | None = None
    name: str = ""
    warn_ratio: Decimal | None = None
    block_ratio: Decimal | None = None

    @classmethod
    def from_row(cls, row: dict, period_start: date) -> Spend:
        return cls(row["slug"], period_start, money(Decimal(row["spend"])), row["invoice_currency"] or row["currency"],
                   row["monthly_spend_limit"], bool(row["warn"]), bool(row["is_blocked"]), row["invoice_status"],
                   row["rated_at"], row.get("pk"), row.get("name", ""), row.get("spend_warn_ratio"),
                   row.get("spend_block_ratio"))

    @property
    def ratio(self) -> Decimal | None:
        """spend / limit, for showing; None without a limit or with a limit of 0 (nothing may be spent)."""
        return self.spend / self.limit if self.limit else None

    @property
    def percent(self) -> int:
        """How much of the limit is used, 0..100, for a meter (a limit of 0 is all used)."""
        if self.limit is None:
            return 0
        return 100 if not self.limit else min(100, int(self.spend / self.limit * 100))

    @property
    def warn_at(self) -> Decimal | None:
        return None if self.limit is None or self.warn_ratio is None else self.limit * self.warn_ratio

    @property
    def block_at(self) -> Decimal | None:
        return None if self.limit is None or self.block_ratio is None else self.limit * self.block_ratio

    @property
    def as_of(self) -> str:
        """How fresh the figure is, in words."""
        if self.rated_at is None:
            return "nothing rated this month yet"
        return f"as rated at {self.rated_at:%Y-%m-%d %H:%M:%S} UTC"

    @property
    def message(self) -> str:
        """Why new orders and inference are refused (only meaningful when blocked)."""
        if self.limit is not None and not self.limit:
            return (f"The monthly spend limit is 0 {self.currency}: nothing may be spent. New orders and inference "
                    f"are refused until an owner asks the MSP for a limit.")
        return (f"The monthly spend limit is reached ({self.spend} of {self.limit} {self.currency}, {self.as_of}): "
                f"new orders and inference are refused until next month or until the MSP raises the limit.")


def of(tenant: Tenant, now: datetime | None = None) -> Spend:
    """A tenant's spend figure this month (one query; nothing is rated or written)."""
    period = month_of(now or timezone.now())
    row = figures(Tenant.objects.filter(pk=tenant.pk), period).values(*FULL_ROW).get()
    return Spend.from_row(row, period)


def check_can_order(tenant: Tenant) -> None:
    """Orders: refused when the tenant's spend figure is blocked."""
    s = of(tenant)
    if s.blocked:
        raise SpendLimitReached(s.message, field="tenant", code="spend_limit")


def evaluate_spend(tenant: Tenant, now: datetime | None = None) -> list[str]:
    """Record warn/block notices once per month and send the webhooks (the rating beat, right after it re-rated
    the tenant's draft: the figure it judges is the one just stored)."""
    s = of(tenant, now)
    fired: list[str] = []
    for level, hit, event in ((SpendNotice.Level.WARN, s.warn, "spend_limit.warning"),
                              (SpendNotice.Level.BLOCK, s.blocked, "spend_limit.reached")):
        if not hit or s.limit is None:
            continue
        with transaction.atomic():
            notice, created = SpendNotice.objects.get_or_create(
                tenant=tenant, period_start=s.period_start, level=level,
                defaults={"spend": s.spend, "limit": s.limit})
            if created:
                webhooks.emit(tenant, event, f"spend:{tenant.pk}:{s.period_start}:{level}", {
                    "tenant": tenant.slug, "level": level, "spend": str(s.spend), "limit": str(s.limit),
                    "currency": s.currency, "period_start": s.period_start.isoformat(),
                    "rated_at": s.rated_at.isoformat() if s.rated_at else None})
                fired.append(level)
    return fired
