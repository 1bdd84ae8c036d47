"""Plotly figures as the plain dicts plotly.js reads, for charts whose traces are large (a 1,000-row heatmap):
building a ``plotly.graph_objects.Figure`` validates and deep-copies every cell, and ``fig.to_json()`` then
encodes it once more, which cost more than the chart's queries. These helpers write the figure in the form
plotly's own validation gives it (a layout title as ``{"text": ...}``, a named colorscale spelt out, the
template expanded), so the JSON is the same as ``json.loads(go.Figure(spec).to_json())`` for the same spec:
tests/unit/test_telemetry.py holds every fleet chart to that."""

from __future__ import annotations

import json
from functools import cache


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


def empty(fig: dict, message: str) -> dict:
    """What ``add_annotation`` plus ``update_xaxes(visible=False)`` / ``update_yaxes`` do to a one-plot figure."""
    layout = fig["layout"]
    layout.setdefault("annotations", []).append({"text": message, "showarrow": False, "x": 0.5, "y": 0.5,
                                                 "xref": "paper", "yref": "paper",
                                                 "font": {"size": 16, "color": "#666"}})
    for axis in ("xaxis", "yaxis"):
        layout[axis] = {**layout.get(axis, {}), "visible": False}
    return fig
