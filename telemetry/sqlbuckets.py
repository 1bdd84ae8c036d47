"""Aggregates computed by the database (PostgreSQL and SQLite alike). Time buckets: a timestamp's UNIX epoch
seconds rounded down to a multiple of ``step`` (charts GROUP BY it instead of reading every sample); and the
maximum of grouped sums (the busiest hour), which the ORM cannot nest."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connections
from django.db.models import BigIntegerField, Func, QuerySet


class EpochBucket(Func):
    """floor(epoch(expr) / step) * step, an integer (seconds since 1970-01-01 UTC)."""

    output_field = BigIntegerField()

    def __init__(self, expression, step: int):
        if int(step) <= 0:
            raise ValueError("step must be a positive number of seconds")
        self.step = int(step)
        super().__init__(expression)

    def as_sql(self, compiler, connection, **extra):  # PostgreSQL (and the default)
        sql, params = compiler.compile(self.source_expressions[0])
        return bucket_sql(connection.vendor, sql, self.step), params

    def as_sqlite(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return bucket_sql("sqlite", sql, self.step), params


def bucket_sql(vendor: str, sql: str, step: int) -> str:
    """The SQL of `EpochBucket` over the timestamp expression `sql`: the one place that says how a bucket is
    computed, for the ORM and for the hand-built statements here."""
    if vendor == "sqlite":
        # Django stores UTC text; strftime('%s') is its epoch ('%%' because the query is %-formatted)
        return f"((CAST(strftime('%%s', {sql}) AS INTEGER) / {int(step)}) * {int(step)})"
    # date_part's double precision, not EXTRACT's numeric: a third of the cost per row, and exact here
    # (whole seconds are exact in a double; a microsecond below a bucket's edge stays below it)
    return f"(FLOOR(DATE_PART('epoch', {sql}) / {int(step)}) * {int(step)})::bigint"


def from_epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(int(seconds), tz=UTC)


def max_per_group(rows: QuerySet, keys: list[str], value: str) -> list[tuple]:
    """The largest `value` per `keys`, computed by the database over `rows` (a ``values(...).annotate(value=...)``
    queryset, itself grouped: e.g. tokens per allocation and hour): a maximum of sums, which the ORM cannot
    nest. Returns (key..., maximum) tuples."""
    sql, params = rows.query.sql_with_params()
    qn = connections[rows.db].ops.quote_name
    cols = ", ".join(qn(k) for k in keys)
    with connections[rows.db].cursor() as cur:
        cur.execute(f"SELECT {cols}, MAX({qn(value)}) FROM ({sql}) AS grouped GROUP BY {cols}", params)
        return cur.fetchall()


def bucket_sums(rows: QuerySet, keys: list[str], time: str, step: int, sums: list[str]) -> list[tuple]:
    """`rows` (a ``values(*keys, time).annotate(...)`` queryset, grouped per exact time: e.g. per sample
    timestamp) summed again per `EpochBucket` of `time` and `keys` by the database: the bucket is computed
    once per group, not once per row (at 1,000 GPUs the heatmap's 24 h: 36k groups, not 286k rows). Returns
    (bucket, key..., sum...) tuples, unordered."""
    sql, params = rows.query.sql_with_params()
    conn = connections[rows.db]
    qn = conn.ops.quote_name
    cols = ", ".join(qn(k) for k in keys)
    total = ", ".join(f"SUM({qn(x)})" for x in sums)
    with conn.cursor() as cur:
        cur.execute(f"SELECT {bucket_sql(conn.vendor, qn(time), step)} AS b, {cols}, {total} "
                    f"FROM ({sql}) AS grouped GROUP BY 1, {cols}", params)
        return cur.fetchall()
