"""Consistent list pages: sorting (?sort=field or -field, whitelisted), filters (the list's FilterSet, the
same one the REST API uses), pagination (?page=, 25 a page) — one helper every table uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import django_filters
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, QueryDict
from django.utils.text import capfirst


@dataclass
class Column:
    key: str  # sort key (ORM path) or "" when the column does not sort
    label: str


@dataclass
class Table:
    page: Page
    columns: list[dict[str, Any]]
    query: QueryDict
    total: int

    def url_for_page(self, n: int) -> str:
        q = self.query.copy()
        q["page"] = str(n)
        return "?" + q.urlencode()

    @property
    def prev_url(self) -> str | None:
        return self.url_for_page(self.page.previous_page_number()) if self.page.has_previous() else None

    @property
    def next_url(self) -> str | None:
        return self.url_for_page(self.page.next_page_number()) if self.page.has_next() else None


def table(request: HttpRequest, qs: QuerySet, columns: list[Column], *, default_sort: str,
          per_page: int = 25) -> Table:
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


@dataclass
class Filtered:
    """A list's FilterSet bound to the page's query string. ``values`` are what the filters hold
    (for the form's selected options); ``problems`` say which values were left out and why."""

    qs: QuerySet
    filterset: django_filters.FilterSet
    values: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def filtered(request: HttpRequest, filterset_class: type[django_filters.FilterSet], qs: QuerySet,
             *, defaults: dict[str, str] | None = None) -> Filtered:
    """Bind the list's FilterSet (the API's) to GET. A value the filter rejects (an edited URL, a state
    that does not exist) is not applied and is reported in words, never a 500; the other filters apply."""
    data = request.GET.copy()
    for name, value in (defaults or {}).items():
        data.setdefault(name, value)
    fs = filterset_class(data, queryset=qs, request=request)
    problems = []
    if not fs.is_valid():
        for name, errors in fs.errors.items():
            # capfirst: a filter's label may be its bare field name (django-filter caches whichever it made first)
            label = capfirst(str(fs.form.fields[name].label or name if name in fs.form.fields else name))
            problems.append(f"{label} “{data.get(name, '')}” was ignored: {' '.join(errors)}")
    values = {name: data.get(name, "") for name in fs.filters}
    return Filtered(qs=fs.qs, filterset=fs, values=values, problems=problems)
