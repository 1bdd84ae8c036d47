"""No page is wider than the phone or the desktop it is shown on (issue 15 point 4).

An operator and a tenant owner visit every page their navigation reaches, plus the detail pages (allocation,
slice, tier, tenant, invoice, model, a planner answer) with a real node worker's data, at 1440x900 and 390x844.
Each page: the document is no wider than the viewport, and no amount or button sits beyond its edge where
nothing scrolls it into view (a wide table scrolls inside its own container, which must itself fit); row
actions (key revoke, member remove) and invoice amounts are in view without scrolling; on a desktop no table is
wider than its card. Screenshots of the pages that overflowed before go to test-artifacts/screenshots/layout-*.png
(and to $LAYOUT_SHOTS_PREFIX<name>.png too when that is set, for a reviewer).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlencode, urlparse

import pytest

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import billing, orders
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory, make_key
from tests.fleet_fixtures import make_tier
from tests.worker_process import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SIZES = [(1440, 900), (390, 844)]

# Where an element is, against the viewport and the nearest ancestor that scrolls sideways.
MEASURE = """() => {
  const vw = document.documentElement.clientWidth;
  const out = [];
  const describe = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
      (el.className && typeof el.className === 'string' ? '.' + el.className.trim().split(/\\s+/).join('.') : '') +
      ' "' + (el.innerText || el.value || '').trim().slice(0, 40) + '"';
  const scroller = el => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      const s = getComputedStyle(p);
      if (/(auto|scroll|hidden)/.test(s.overflowX) && p.scrollWidth > p.clientWidth + 1) return p;
    }
    return null;
  };
  const sel = 'td.num, th.num, .stat .value, button, .button, input[type=submit]';
  for (const el of document.querySelectorAll(sel)) {
    const r = el.getBoundingClientRect();
    if (!r.width || !r.height) continue;
    const box = scroller(el);
    // reachable by scrolling its container: then the container must be on screen
    const rr = box ? box.getBoundingClientRect() : r;
    if (rr.right > vw + 1 || rr.left < -1) out.push({what: describe(el), left: rr.left, right: rr.right});
  }
  // row actions (revoke, remove, leave) and an invoice's amounts are in view without scrolling the table
  const actions = 'table form[action*="/revoke/"] button, table form[action*="/remove/"] button, td.amount';
  const kept = document.querySelectorAll(actions);
  for (const el of kept) {
    const r = el.getBoundingClientRect();
    if (r.width && (r.right > vw + 1 || r.left < -1))
      out.push({what: 'in view: ' + describe(el), left: r.left, right: r.right});
  }
  // content wider than its card: spilling out (overflow visible) or scrolling inside it
  const spill = [];
  for (const el of document.querySelectorAll('.card, .table-wrap')) {
    if (el.scrollWidth > el.clientWidth + 1)
      spill.push(describe(el).slice(0, 60) + ' ' + el.scrollWidth + '>' + el.clientWidth);
  }
  return {scrollWidth: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
          offscreen: out, spill: spill, kept_in_view: kept.length};
}"""


@pytest.fixture
def world(node_worker):
    node, worker = node_worker
    op = OperatorFactory(email="ops@layout.example")
    t1 = make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb", hour="0.9000")
    t3 = make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.7000")
    make_tier("h200-whole", "h200-sxm-141gb", None, hour="3.5000")  # a tier with no node: prices, no capacity
    acme = TenantFactory(slug="acme-international-research", name="Acme International Research Laboratories",
                         monthly_spend_limit="25000.00")
    owner = MembershipFactory(tenant=acme, role=Role.OWNER,
                              user=UserFactory(email="owner.with.a.long.address@acme-international.example")).user
    MembershipFactory(tenant=acme, role=Role.MEMBER,
                      user=UserFactory(email="member.number.two@acme-international.example"))
    make_key(acme, ("read", "inference", "deploy"), name="production inference key for the chat service",
             created_by=owner)
    p = principal_for_user(op)
    orders.create_order(p, tenant=acme, tier=t1, quantity=2)
    orders.create_order(p, tenant=acme, tier=t3)
    wait_for(lambda: Allocation.objects.filter(state="active").count() == 3, 90, "3 active allocations", worker)
    alloc = Allocation.objects.filter(tenant=acme, tier=t3).get()
    dep = ModelDeployment.objects.create(allocation=alloc, tenant=acme, name="llama-3.1-8b-instruct-customer-support",
                                         backend="python", spec={}, memory_mb=1000, state="ready")
    invoice = billing.current_invoice(acme)
    return {"op": op, "owner": owner, "acme": acme, "alloc": alloc, "tier": t3, "invoice": invoice, "dep": dep}


def _nav_links(page, base: str) -> list[str]:
    hrefs = page.eval_on_selector_all("nav.mainnav a, .subnav a", "els => els.map(e => e.getAttribute('href'))")
    out = []
    for h in hrefs:
        path = urlparse(h).path if h else ""
        if path.startswith(("/console/", "/portal/", "/charts/")) and path not in out:
            out.append(path)
    return out


def _visit_all(page, base: str, paths: list[str], label: str, results: dict) -> None:
    seen: set[str] = set()
    queue = list(paths)
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        for width, height in SIZES:
            page.set_viewport_size({"width": width, "height": height})
            resp = page.goto(f"{base}{path}")
            assert resp is not None and resp.status == 200, (path, resp and resp.status)
            page.wait_for_load_state("networkidle")
            m = page.evaluate(MEASURE)
            results[(label, path, width)] = m
        if "?" not in path:
            queue.extend(p for p in _nav_links(page, base) if p not in seen)


def _planner_path() -> str:
    params = {"plan": "1", "w-TOTAL_FORMS": "2", "w-INITIAL_FORMS": "0", "w-MIN_NUM_FORMS": "0",
              "w-MAX_NUM_FORMS": "40", "w-0-name": "chat-70b", "w-0-tokens_per_s": "30000", "w-0-min_memory_gib": "75",
              "w-0-gpu_model": "", "w-1-name": "embed", "w-1-tokens_per_s": "2500", "w-1-min_memory_gib": "8",
              "w-1-gpu_model": "h100-sxm-80gb", "target_utilization": "70", "growth": "1", "window_days": "7",
              "price_per_kwh": "0.12", "currency": "USD", "gpu_models": ["h100-sxm-80gb", "h200-sxm-141gb"],
              "cost_h100-sxm-80gb": "1.89", "cost_h200-sxm-141gb": "2.50"}
    return "/console/planner/?" + urlencode(params, doseq=True)


def _screenshot(page, base: str, path: str, width: int, height: int, name: str) -> None:
    page.set_viewport_size({"width": width, "height": height})
    page.goto(f"{base}{path}")
    page.wait_for_load_state("networkidle")
    out = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    targets = [out / f"layout-{name}.png"]
    if os.environ.get("LAYOUT_SHOTS_PREFIX"):
        targets.append(Path(os.environ["LAYOUT_SHOTS_PREFIX"] + f"{name}.png"))
    for t in targets:
        page.screenshot(path=str(t), full_page=True)


def test_no_page_is_wider_than_the_viewport(page, live_server, login, world):
    base = live_server.url
    results: dict = {}

    login(page, world["op"].email)
    console = ["/console/", f"/console/allocations/{world['alloc'].pk}/", f"/console/tenants/{world['acme'].pk}/",
               f"/console/tiers/{world['tier'].pk}/", f"/console/invoices/{world['invoice'].pk}/", _planner_path()]
    _visit_all(page, base, console, "operator", results)
    for name, path in (("allocation", console[1]), ("tenant", console[2]), ("tier", console[3]),
                       ("planner", console[5]), ("overview", console[0])):  # the widest before the fix
        _screenshot(page, base, path, 390, 844, f"console-{name}-390")
    _screenshot(page, base, f"/console/allocations/{world['alloc'].pk}/", 1440, 900, "console-allocation-1440")
    page.context.clear_cookies()

    login(page, world["owner"].email)
    portal = ["/portal/", f"/portal/slices/{world['alloc'].pk}/", f"/portal/invoices/{world['invoice'].pk}/",
              f"/portal/models/{world['dep'].pk}/", "/portal/keys/", "/portal/members/"]
    _visit_all(page, base, portal, "tenant", results)
    for name, path in (("slice", portal[1]), ("invoice", portal[2]), ("keys", portal[4]),
                       ("catalog", "/portal/catalog/")):
        _screenshot(page, base, path, 390, 844, f"portal-{name}-390")
    _screenshot(page, base, f"/portal/invoices/{world['invoice'].pk}/", 1440, 900, "portal-invoice-1440")

    report = "\n".join(f"{who:8} {w:5} {m['scrollWidth']:5} px wide {m['height']:6} px tall  {path[:40]:40}"
                       f"  scrolls in card: {len(m['spill'])}  off-screen: {len(m['offscreen'])}"
                       for (who, path, w), m in sorted(results.items()))
    print(report)
    wide = {k: m["scrollWidth"] for k, m in results.items() if m["scrollWidth"] > k[2]}
    off = {k: m["offscreen"][:3] for k, m in results.items() if m["offscreen"]}
    assert len({k[1] for k in results}) >= 25, report  # the navigation was followed
    assert not wide, f"wider than the viewport: {wide}\n{report}"
    assert not off, f"amounts or buttons beyond the viewport's edge: {off}"
    # the checks saw what they check: the invoice's amounts, the keys' revoke, the members' remove
    for path in (portal[2], "/portal/keys/", "/portal/members/"):
        assert results[("tenant", path, 390)]["kept_in_view"] >= 1, path
    # on a desktop every table fits its card (the allocation history once spilled out of it at 1440 px)
    spill = {k: m["spill"] for k, m in results.items() if k[2] == 1440 and m["spill"]}
    assert not spill, f"wider than its card at 1440 px: {spill}"
