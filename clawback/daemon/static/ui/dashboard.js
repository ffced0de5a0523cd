// Live updates and charts for the clawback dashboard. No inline script: the page's CSP allows
// only scripts from this origin.
"use strict";

function drawCharts(root) {
  for (const el of root.querySelectorAll(".chart:not([data-drawn])")) {
    el.dataset.drawn = "1";
    const chart = JSON.parse(el.dataset.chart);
    const colors = ["#2f5fd0", "#85c", "#888"];  // for series without a colour of their own
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
        ...chart.series.map((s, i) => ({ label: s.label, stroke: s.color || colors[i % colors.length], width: 2,
                                         points: { show: true } }))],
    };
    new uPlot(opts, [chart.x, ...chart.series.map((s) => s.values)], el);
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
// Paging: the section then fetches that page, also when a live update refreshes it.
document.addEventListener("click", (e) => {
  const button = e.target.closest("button[data-page]");
  if (!button) return;
  const section = button.closest("section");
  section.setAttribute("hx-get", button.dataset.page);
  htmx.process(section);
  htmx.ajax("GET", button.dataset.page, { target: section, swap: "innerHTML" });
});
// A section's refresh answered after the person paged it elsewhere (sent, or due, before the
// click) would put the old page back: only the page the section now asks for is swapped in.
document.addEventListener("htmx:beforeSwap", (e) => {
  const elt = e.detail.target;
  if (elt.tagName === "SECTION" && elt.hasAttribute("hx-get") && e.detail.requestConfig.verb === "get"
      && e.detail.pathInfo.requestPath !== elt.getAttribute("hx-get")) {
    e.detail.shouldSwap = false;
  }
});
// A live refresh never replaces a form being filled in (a memory note being edited).
document.addEventListener("htmx:beforeRequest", (e) => {
  const elt = e.detail.elt;
  if (elt.tagName === "SECTION" && [...elt.querySelectorAll("input[type=text]")].some((i) => i.value !== i.defaultValue)) {
    e.preventDefault();
  }
});
