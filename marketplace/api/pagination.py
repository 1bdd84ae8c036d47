from django.core.paginator import EmptyPage, PageNotAnInteger
from django.core.paginator import Paginator as DjangoPaginator
from django.db.models import Count, QuerySet, Window
from django.db.models.query import ModelIterable, ValuesIterable
from rest_framework.pagination import PageNumberPagination

#: the annotation that carries the whole list's count on each row of a page
TOTAL = "_page_total"


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class OneQueryPaginator(DjangoPaginator):
    """A SECOND COPY, kept for speed, of Django's ``Paginator.page`` for one query shape, reading Django's private
    attributes (``QuerySet._iterable_class``, ``Paginator._get_page``, the ``count`` cached property's slot in
    ``__dict__``); tests/unit/test_pagination.py holds its pages and counts equal to Django's paginator (a property
    test, which also catches a Django upgrade that changes those attributes).

    A page and the count of the whole list in one query: each row carries COUNT(*) OVER () (computed before
    the LIMIT), so no separate COUNT query. For lists the database produces whole anyway (a few thousand rows at
    most, e.g. one per tenant): the window makes PostgreSQL produce every row of the list where a top-N sort
    would not, so long lists keep the default two queries. An empty page past the first, a DISTINCT or
    combined query, or rows other than instances and dicts: the default way."""

    def page(self, number):
        qs = self.object_list
        if (not isinstance(qs, QuerySet) or qs.query.distinct or qs.query.combinator or qs.query.is_sliced
                or qs._iterable_class not in (ModelIterable, ValuesIterable)):
            return super().page(number)
        try:
            number = int(number)
        except (TypeError, ValueError):
            raise PageNotAnInteger("That page number is not an integer") from None
        if number < 1:
            raise EmptyPage("That page number is less than 1")
        bottom = (number - 1) * self.per_page
        rows = list(qs.annotate(**{TOTAL: Window(Count("*"))})[bottom:bottom + self.per_page])
        if not rows:
            if number == 1 and self.allow_empty_first_page:
                self.__dict__["count"] = 0
                return self._get_page(rows, number, self)
            raise EmptyPage("That page contains no results")
        if isinstance(rows[0], dict):
            total = rows[0][TOTAL]
            for r in rows:
                del r[TOTAL]
        else:
            total = getattr(rows[0], TOTAL)
            for r in rows:
                delattr(r, TOTAL)
        self.__dict__["count"] = total  # (Paginator.count is a cached property: the window's figure)
        if number == self.num_pages and total - bottom > self.per_page:
            return super().page(number)  # (orphans fold into this last page: the default way)
        return self._get_page(rows, number, self)


class OneQueryPagination(Pagination):
    """Pagination whose page and count are one query (OneQueryPaginator, a second copy of Django's paginator kept
    for speed): for short lists."""

    django_paginator_class = OneQueryPaginator
