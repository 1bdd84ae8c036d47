"""Billing: each rule in one module.

- ``units``: calendar months (UTC), money rounded to the cent, exact durations.
- ``plans``: which price plan is in force (``PlanBook``), and the planner's list price.
- ``rating``: the rule that prices a tenant's month (``rate_month``) and its loaders (``rate``, ``rate_months_many``).
- ``spread``: the charts' money, a second copy of the rating's linear part kept for speed (named there).
- ``invoices``: drafts, re-rating, finalization, every used month invoiced.
- ``credit_notes``: corrections of finalized invoices (and their one sign convention), the net balance.
- ``documents``: the invoice and credit-note PDFs (and the parties frozen on them).
- ``spend``: the spend figure and the spend-limit rule, for orders, the gateway, the API, the console, the portal.
- ``alerts``: billing alerts for operators.
- ``runs``: the rating beat, fanned out per tenant.

Callers use ``from marketplace.services import billing`` and the names below; the modules are the places
where each rule is written.
"""

from .alerts import alert, rating_failed, resolve_alerts
from .credit_notes import credit_note_payload, issue_credit_note, left_to_credit, net_balance
from .invoices import (
    ENSURE_LOOKBACK,
    FinalizeBlocked,
    current_invoice,
    draft_for,
    ensure_invoices,
    finalize,
    finalize_due,
    finalize_tenant_due,
    invoice_payload,
    periods_used,
    refresh,
)
from .plans import PlanBook, list_price_per_hour
from .rating import (
    Draft,
    Held,
    L,
    MonthInputs,
    Rated,
    commitment_topups,
    period_currency,
    rate,
    rate_month,
    rate_months_many,
)
from .runs import finish_rating_run, rate_run_tenant, rate_tenant, start_rating_run
from .spend import SpendLimitReached, check_can_order, evaluate_spend
from .spread import COMMITMENT, SLICES, TOKENS, Spread, amount_between, amount_by_bucket, spread_amounts
from .units import CENT, MILLION, bounds, money, month_of, months, next_month, seconds

__all__ = [
    "CENT", "COMMITMENT", "ENSURE_LOOKBACK", "MILLION", "SLICES", "TOKENS", "Draft", "FinalizeBlocked", "Held", "L",
    "MonthInputs", "PlanBook", "Rated", "SpendLimitReached", "Spread", "alert", "amount_between", "amount_by_bucket",
    "bounds", "check_can_order", "commitment_topups", "credit_note_payload", "current_invoice", "draft_for",
    "ensure_invoices", "evaluate_spend", "finalize", "finalize_due", "finalize_tenant_due", "finish_rating_run",
    "invoice_payload", "issue_credit_note", "left_to_credit", "list_price_per_hour", "money", "month_of", "months",
    "net_balance", "next_month",
    "period_currency", "periods_used", "rate", "rate_month", "rate_months_many", "rate_run_tenant", "rate_tenant",
    "rating_failed", "refresh", "resolve_alerts", "seconds", "spread_amounts", "start_rating_run",
]
