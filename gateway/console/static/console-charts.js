/* livelora console: draws each <figure class="chart"> from its JSON spec with the vendored Chart.js
   (gateway/console/charts.py writes the spec). window.liveloraCharts() lists each chart's drawn text boxes
   (title, legend items, tick labels, version-change labels) and its number of data points, for tests. */
(function () {
  "use strict";
  var PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9"];
  var FONT = 11;

  function box(list, text, left, top, width, height) {
    list.push({ text: String(text), left: left, top: top, width: width, height: height });
  }

  /* Dashed vertical lines at version changes, each labelled; a label goes to the first row where it overlaps
     no other, kept inside the plot area (never cut off); labels that fit no row are left out (the line stays). */
  var marksPlugin = {
    id: "liveloraMarks",
    afterDatasetsDraw: function (chart) {
      var marks = chart.canvas.$spec.marks || [], area = chart.chartArea, ctx = chart.ctx, x = chart.scales.x;
      var rows = Math.max(1, Math.floor((area.bottom - area.top) / (FONT + 6)) - 1), placed = [];
      chart.$markBoxes = [];
      ctx.save();
      ctx.font = FONT + "px sans-serif";
      ctx.textBaseline = "top";
      marks.forEach(function (m) {
        var px = x.getPixelForValue(m.x);
        ctx.strokeStyle = "#777";
        ctx.setLineDash([4, 3]);
        ctx.beginPath(); ctx.moveTo(px, area.top); ctx.lineTo(px, area.bottom); ctx.stroke();
        var w = ctx.measureText(m.label).width, left = Math.min(Math.max(px + 3, area.left), area.right - w);
        for (var r = 0; r < rows; r++) {
          var top = area.top + 2 + r * (FONT + 4);
          var clash = placed.some(function (b) { return b.top === top && left < b.left + b.width + 4 && b.left < left + w + 4; });
          if (!clash) {
            ctx.fillStyle = "#333";
            ctx.fillText(m.label, left, top);
            var b = { text: m.label, left: left, top: top, width: w, height: FONT };
            placed.push(b); chart.$markBoxes.push(b);
            return;
          }
        }
      });
      ctx.restore();
    }
  };

  function timeTicks(spec) {
    var labels = {};
    (spec.x.ticks || []).forEach(function (t) { labels[t[0]] = t[1]; });
    return {
      afterBuildTicks: function (scale) { scale.ticks = (spec.x.ticks || []).map(function (t) { return { value: t[0] }; }); },
      callback: function (v) { return labels[v]; }
    };
  }

  function config(spec) {
    var horizontal = !!spec.horizontal, y = spec.y || {};
    var valueAxis = {
      beginAtZero: y.min === 0, min: y.min, max: y.max, stacked: !!spec.stacked,
      ticks: { precision: y.integer ? 0 : undefined, maxTicksLimit: 6,
               callback: y.percent ? function (v) { return Math.round(v * 100) + " %"; } : undefined }
    };
    var xAxis = { stacked: !!spec.stacked, ticks: { maxRotation: 0, autoSkip: true, autoSkipPadding: 12, padding: 8 } };
    if (spec.x.kind === "time") {
      var tt = timeTicks(spec);
      xAxis.type = "linear";
      xAxis.ticks.align = "inner"; /* the first and last labels start and end at their tick: none sticks out */
      xAxis.ticks.autoSkipPadding = 40;
      xAxis.afterBuildTicks = tt.afterBuildTicks;
      xAxis.ticks.callback = tt.callback;
      if (spec.x.ticks.length) { xAxis.min = Math.min(spec.x.ticks[0][0], xMin(spec)); xAxis.max = Math.max(spec.x.ticks[spec.x.ticks.length - 1][0], xMax(spec)); }
    } else if (spec.x.kind === "step") {
      xAxis.type = "linear";
      xAxis.ticks.precision = 0;
      xAxis.title = { display: true, text: "step" };
    }
    var data = { datasets: spec.datasets.map(function (d, i) {
      return Object.assign({}, d, { borderColor: PALETTE[i % PALETTE.length], backgroundColor: PALETTE[i % PALETTE.length],
                                    pointRadius: 3, spanGaps: false });
    }) };
    if (spec.x.labels) data.labels = spec.x.labels;
    return {
      type: spec.type,
      data: data,
      plugins: [marksPlugin],
      options: {
        animation: false, responsive: true, maintainAspectRatio: false, indexAxis: horizontal ? "y" : "x",
        parsing: spec.type === "line" ? { xAxisKey: "x", yAxisKey: "y" } : undefined,
        scales: horizontal ? { x: valueAxis, y: { ticks: { autoSkip: false } } } : { x: xAxis, y: valueAxis },
        plugins: {
          title: { display: true, text: spec.title, font: { size: 13 } },
          legend: { display: spec.datasets.length > 1, position: "bottom" },
          tooltip: { callbacks: spec.x.kind === "time" ? { title: function (items) {
            return items.length ? new Date(items[0].parsed.x * 1000).toLocaleString() : ""; },
            label: function (item) { var p = item.raw; return "liked " + Math.round(p.y * 100) + " % of " + p.n + " ratings"; } } : {} }
        }
      }
    };
  }

  function xs(spec) {
    var out = (spec.marks || []).map(function (m) { return m.x; });
    spec.datasets.forEach(function (d) { d.data.forEach(function (p) { if (p && p.x !== undefined) out.push(p.x); }); });
    return out;
  }
  function xMin(spec) { return Math.min.apply(null, xs(spec)); }
  function xMax(spec) { return Math.max.apply(null, xs(spec)); }

  function draw(root) {
    if (typeof Chart === "undefined") return;
    root.querySelectorAll("figure.chart").forEach(function (fig) {
      var canvas = fig.querySelector("canvas"), data = fig.querySelector("script.chart-data");
      if (!canvas || !data || Chart.getChart(canvas)) return;
      var spec = JSON.parse(data.textContent);
      var points = spec.datasets.reduce(function (n, d) { return n + d.data.filter(function (p) { return p !== null && (p.y === undefined ? true : p.y !== null); }).length; }, 0);
      if (!points) { fig.classList.add("empty"); fig.querySelector(".chart-box").textContent = spec.title + ": no data yet"; return; }
      canvas.$spec = spec;
      new Chart(canvas, config(spec));
    });
  }

  window.liveloraCharts = function () {
    return Array.prototype.map.call(document.querySelectorAll("figure.chart canvas"), function (canvas) {
      var chart = Chart.getChart(canvas), boxes = [], ctx = chart.ctx, r = canvas.getBoundingClientRect();
      var t = chart.titleBlock;
      ctx.save();
      ctx.font = "bold 13px " + Chart.defaults.font.family;
      var tw = ctx.measureText(chart.canvas.$spec.title).width;
      box(boxes, chart.canvas.$spec.title, (t.left + t.right - tw) / 2, (t.top + t.bottom - 13) / 2, tw, 13);
      (chart.legend.legendHitBoxes || []).forEach(function (h, i) {
        if (chart.legend.options.display) box(boxes, chart.legend.legendItems[i].text, h.left, h.top, h.width, h.height);
      });
      Object.values(chart.scales).forEach(function (scale) {
        ctx.font = Chart.helpers.toFont(scale.options.ticks.font).string;
        var size = Chart.helpers.toFont(scale.options.ticks.font).size;
        scale.ticks.forEach(function (tick, i) {
          if (tick.label === undefined || tick.label === null || tick.label === "") return;
          var lines = [].concat(tick.label), w = Math.max.apply(null, lines.map(function (s) { return ctx.measureText(String(s)).width; }));
          var h = lines.length * size * 1.2, p = scale.getPixelForTick(i);
          var inner = scale.options.ticks.align === "inner", last = scale.ticks.length - 1;
          var left = inner && i === 0 ? p : inner && i === last ? p - w : p - w / 2;
          if (scale.isHorizontal()) box(boxes, lines.join(" "), left, scale.top + scale.options.ticks.padding, w, h);
          else box(boxes, lines.join(" "), scale.right - scale.options.ticks.padding - w, p - h / 2, w, h);
        });
      });
      ctx.restore();
      (chart.$markBoxes || []).forEach(function (b) { boxes.push(b); });
      var n = chart.data.datasets.reduce(function (s, d) { return s + d.data.filter(function (p) { return p !== null; }).length; }, 0);
      return { title: chart.canvas.$spec.title, points: n, marks: (chart.$markBoxes || []).length, boxes: boxes,
               width: r.width, height: r.height };
    });
  };

  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function () { draw(document); });
})();
