/* Plotly figures that read on a phone (under 700 px): the legend under the plot, no toolbar over the titles,
   titles and subplot titles wrapped to the width, smaller margins. TesseraCharts.fit(layout) adapts a figure's
   layout in place; TesseraCharts.config is the config to draw it with. */
(function () {
  "use strict";
  var phone = window.matchMedia("(max-width: 700px)").matches;
  function wrap(text, width) {
    if (!text || text.length <= width || text.indexOf("<br>") >= 0) { return text; }
    var out = [], line = "";
    text.split(" ").forEach(function (word) {
      if (line && (line + " " + word).length > width) { out.push(line); line = word; }
      else { line = line ? line + " " + word : word; }
    });
    out.push(line);
    return out.join("<br>");
  }
  function fit(layout) {
    if (!phone) { return layout; }
    layout.legend = {orientation: "h", x: 0, y: -0.2, yanchor: "top", xanchor: "left"};
    layout.margin = Object.assign({}, layout.margin || {}, {r: 10, t: 70});
    if (layout.margin.l === undefined || layout.margin.l > 120) { layout.margin.l = 50; }
    if (layout.title && layout.title.text) { layout.title.text = wrap(layout.title.text, 34); layout.title.font = {size: 14}; }
    (layout.annotations || []).forEach(function (a) { a.text = wrap(a.text, 30); a.font = {size: 12}; });
    return layout;
  }
  window.TesseraCharts = {phone: phone, fit: fit, config: {responsive: true, displaylogo: false, displayModeBar: !phone}};
})();
