// Live updates and charts for the clawback dashboard. No inline script: the page's CSP allows
// only scripts from this origin.
"use strict";

function drawCharts(root) {
  for (const el of root.querySelectorAll(".chart:not([data-drawn])")) {
    el.dataset.drawn = "1";
    const chart = JSON.parse(el.dataset.chart);
    const names = Object.keys(chart.series);
    const colors = ["#2a7", "#d44", "#37c", "#c80", "#85c", "#888"];
    const labels = chart.xlabels;
    const opts = {
      width: Math.max(260, el.clientWidth - 8),
      height: chart.small ? 140 : 180,
      // uPlot fails on a span near float precision (a loss of -1 twice): widen it to a readable one.
      scales: { x: { time: false }, y: { range: (u, min, max) => {
        const span = Math.max(max - min, 1e-3 * Math.max(1, Math.abs(max)));
        return uPlot.rangeNum((min + max - span) / 2, (min + max + span) / 2, 0.1, true);
      } } },
      axes: [{ values: labels ? (u, ticks) => ticks.map((t) => labels[chart.x.indexOf(t)] ?? "") : undefined }, { size: 56 }],
      series: [{ label: labels ? "version" : "step", value: labels ? (u, v) => labels[chart.x.indexOf(v)] ?? "" : undefined },
        ...names.map((name, i) => ({ label: name, stroke: colors[i % colors.length], width: 2, points: { show: true } }))],
    };
    new uPlot(opts, [chart.x, ...names.map((n) => chart.series[n])], el);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  drawCharts(document);
  const url = document.body.dataset.events;
  if (!url) return;
  const dot = document.getElementById("live-dot");
  const events = new EventSource(url);
  let lost = null;  // the daemon ends each stream after a while: offline only if no reconnect follows
  events.onopen = () => { clearTimeout(lost); dot.className = "online"; };
  events.onerror = () => { clearTimeout(lost); lost = setTimeout(() => dot.className = "offline", 3000); };
  events.addEventListener("changed", () => htmx.trigger(document.body, "changed"));
});
document.addEventListener("htmx:afterSettle", (e) => drawCharts(e.detail.elt));
// A live refresh never replaces a form being filled in (a memory note being edited).
document.addEventListener("htmx:beforeRequest", (e) => {
  const elt = e.detail.elt;
  if (elt.tagName === "SECTION" && [...elt.querySelectorAll("input[type=text]")].some((i) => i.value !== i.defaultValue)) {
    e.preventDefault();
  }
});
