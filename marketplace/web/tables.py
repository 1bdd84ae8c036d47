"""Consistent list pages: sorting (?sort=field or -field, whitelisted), filters (GET params the view
whitelists), pagination (?page=, 25 a page) — one helper every table uses."""

from __future__ import annotations

from dataclasses import dataclass

from django.core.paginator import Paginator
from django.http import QueryDict


@dataclass
class Column:
    key: str  # sort key (ORM path) or "" when the column does not sort
    label: str


@dataclass
class Table:
    page: object
    columns: list[dict]
    query: QueryDict
    total: int

    def url_for_page(self, n: int) -> str:
        q = self.query.copy()
        q["page"] = n
        return "?" + q.urlencode()

    @property
    def prev_url(self) -> str | None:
        return self.url_for_page(self.page.previous_page_number()) if self.page.has_previous() else None

    @property
    def next_url(self) -> str | None:
        return self.url_for_page(self.page.next_page_number()) if self.page.has_next() else None


def table(request, qs, columns: list[Column], *, default_sort: str, per_page: int = 25) -> Table:
    allowed = {c.key for c in columns if c.key}
    sort = request.GET.get("sort", default_sort)
    if sort.lstrip("-") not in allowed:
        sort = default_sort
    qs = qs.order_by(sort, "pk")
    paginator = Paginator(qs, per_page)
    page = paginator.get_page(request.GET.get("page"))
    cols = []
    for c in columns:
        q = request.GET.copy()
        q.pop("page", None)
        if c.key:
            q["sort"] = f"-{c.key}" if sort == c.key else c.key
        cols.append({"label": c.label, "sortable": bool(c.key), "url": "?" + q.urlencode(),
                     "dir": ("asc" if sort == c.key else "desc" if sort == f"-{c.key}" else "")})
    return Table(page=page, columns=cols, query=request.GET, total=paginator.count)
