"""A SECOND COPY, kept for speed, of plotly's own figure JSON (its graph-object validation and ``to_json``), named
as such in telemetry.charts, which uses it.

Plotly figures as the plain dicts plotly.js reads, for charts whose traces are large (a 1,000-row heatmap):
building a ``plotly.graph_objects.Figure`` validates and deep-copies every cell, and ``fig.to_json()`` then
encodes it once more, which cost more than the chart's queries. These helpers write the figure in the form
plotly's own validation gives it (a layout title as ``{"text": ...}``, a named colorscale spelt out, the
template expanded), so the JSON is the same as ``json.loads(go.Figure(spec).to_json())`` for the same spec:
tests/unit/test_telemetry.py holds every fleet chart to that."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache, lru_cache


def title(text: str) -> dict:
    """A title as plotly writes it (``title="x"`` is the same as ``title={"text": "x"}``)."""
    return {"text": text}


@cache
def _template_json(name: str) -> str:
    import plotly.io as pio

    return json.dumps(pio.templates[name].to_plotly_json())


def template(name: str) -> dict:
    """The named template expanded (as plotly writes ``layout.template``); a fresh copy each call."""
    return json.loads(_template_json(name))


@cache
def _colorscale_json(name: str) -> str:
    import plotly.graph_objects as go

    return json.dumps(go.Heatmap(colorscale=name).to_plotly_json()["colorscale"])


def colorscale(name: str) -> list[list]:
    """A named plotly colorscale ("Viridis") as the [[position, color], ...] list plotly expands it to."""
    return json.loads(_colorscale_json(name))


def figure(traces: list[dict], layout: dict) -> dict:
    """{"data", "layout"}: each trace a dict with its "type"; the layout's "template", when a name, expanded."""
    layout = dict(layout)
    if isinstance(layout.get("template"), str):
        layout["template"] = template(layout["template"])
    return {"data": traces, "layout": layout}


def empty(fig: dict, message: str = "no data yet") -> dict:
    """An empty chart says so instead of drawing a blank -1..1 axis: what ``add_annotation`` plus
    ``update_xaxes(visible=False)`` / ``update_yaxes`` do to a figure (every axis of a subplot grid)."""
    layout = fig["layout"]
    layout["annotations"] = [*layout.get("annotations", ()),
                             {"text": message, "showarrow": False, "x": 0.5, "y": 0.5, "xref": "paper",
                              "yref": "paper", "font": {"size": 16, "color": "#666"}}]
    for letter in "xy":
        update_axes(layout, letter, {"visible": False})
    return fig


@lru_cache(maxsize=64)
def _subplots_json(rows: int, cols: int, shared_xaxes: bool, horizontal_spacing: float | None,
                   vertical_spacing: float | None, subplot_titles: tuple[str, ...]) -> str:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=shared_xaxes, horizontal_spacing=horizontal_spacing,
                        vertical_spacing=vertical_spacing, subplot_titles=subplot_titles)
    refs = {}
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            sub = fig.get_subplot(r, c)
            refs[f"{r},{c}"] = [sub.xaxis.plotly_name, sub.yaxis.plotly_name]
    return json.dumps({"layout": fig.to_plotly_json()["layout"], "refs": refs})


@dataclass
class Subplots:
    """A ``make_subplots`` grid as plotly lays it out: ``layout`` (the axes' domains and anchors, the subplot
    titles' annotations; a fresh copy each call) and the layout keys of the axes of each cell."""

    layout: dict
    refs: dict[str, list[str]]

    def axes(self, row: int, col: int) -> tuple[str, str]:
        """("xaxis2", "yaxis2"): the layout keys of the cell's axes."""
        x, y = self.refs[f"{row},{col}"]
        return x, y

    def trace(self, trace: dict, row: int, col: int) -> dict:
        """The trace placed in the cell, as ``add_trace(trace, row, col)`` writes it ("xaxis": "x2", "yaxis": "y2")."""
        x, y = self.axes(row, col)
        return {**trace, "xaxis": "x" + x[len("xaxis"):], "yaxis": "y" + y[len("yaxis"):]}

    def update(self, row: int, col: int, x: dict | None = None, y: dict | None = None) -> None:
        """``update_xaxes(**x, row=row, col=col)`` / ``update_yaxes``: one level of nested dicts merged."""
        for key, values in zip(self.axes(row, col), (x, y), strict=True):
            if values:
                update_axis(self.layout, key, values)


def subplots(rows: int, cols: int, *, shared_xaxes: bool = False, horizontal_spacing: float | None = None,
             vertical_spacing: float | None = None, subplot_titles: tuple[str, ...] = ()) -> Subplots:
    """``make_subplots(...)``'s layout, built by plotly once per distinct grid and copied per call."""
    built = json.loads(_subplots_json(rows, cols, shared_xaxes, horizontal_spacing, vertical_spacing,
                                      tuple(subplot_titles)))
    return Subplots(built["layout"], built["refs"])


_AXIS = re.compile(r"[xy]axis\d*")


def axis_keys(layout: dict, letter: str) -> list[str]:
    """The layout keys of every x (or y) axis: "xaxis" always (a one-plot figure has it), "xaxis2"... when there."""
    return [f"{letter}axis"] + [k for k in layout if _AXIS.fullmatch(k) and k[0] == letter and k != f"{letter}axis"]


def update_axis(layout: dict, key: str, values: dict) -> None:
    """Merge `values` into ``layout[key]`` as plotly's ``update`` does (a nested dict such as the title merged
    one level down)."""
    axis = layout[key] = dict(layout.get(key) or {})
    for k, v in values.items():
        axis[k] = {**axis[k], **v} if isinstance(v, dict) and isinstance(axis.get(k), dict) else v


def update_axes(layout: dict, letter: str, values: dict) -> None:
    """``fig.update_xaxes(**values)`` (letter "x") or ``update_yaxes`` (letter "y"): every such axis."""
    for key in axis_keys(layout, letter):
        update_axis(layout, key, values)
