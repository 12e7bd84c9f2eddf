"use strict";
// Draws the view model of hybridflow/dashboard/view.py; every number is computed there, this only formats it.
(function () {
  const config = JSON.parse(document.getElementById("hf-config").textContent);
  const NS = "http://www.w3.org/2000/svg";

  function esc(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  }
  function num(v, digits) {
    if (v == null) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return v.toFixed(digits == null ? 4 : digits);
  }
  function secs(v) { return v == null ? "–" : (v < 1 ? (v * 1000).toFixed(1) + " ms" : v.toFixed(3) + " s"); }
  function bytes(v) {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, x = v;
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return x.toFixed(i ? 1 : 0) + " " + units[i];
  }
  function pct(f) { return f == null ? "–" : (100 * f).toFixed(1) + "%"; }
  function body(id) { return document.querySelector("#" + id + " .body"); }
  function fill(id, html) { body(id).innerHTML = html; }
  function empty(why) { return '<p class="empty">' + esc(why) + "</p>"; }
  const NO_STATUS = "no live status: the report of a finished run, or `hybridflow dashboard` without JOB";

  function renderGraph(v) {
    const g = v.graph;
    if (!g.nodes.length) return fill("panel-graph", empty(v.has_status ? "no nodes" : NO_STATUS));
    const W = 250, GAP = 70, PAD = 10, LINE = 14;
    const heights = g.nodes.map((n) => 52 + LINE * Math.min(n.workers.length, 4) + (n.workers.length > 4 ? LINE : 0));
    const rowH = Math.max.apply(null, heights) + 24;
    const layers = Math.max.apply(null, g.nodes.map((n) => n.layer)) + 1;
    const rows = Math.max.apply(null, g.nodes.map((n) => n.row)) + 1;
    const pos = {};
    g.nodes.forEach((n, i) => { pos[n.name] = {x: PAD + n.layer * (W + GAP), y: PAD + n.row * rowH, h: heights[i]}; });
    let svg = '<svg xmlns="' + NS + '" width="' + (PAD * 2 + layers * (W + GAP) - GAP) + '" height="' + (PAD * 2 + rows * rowH) + '">';
    svg += '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">' +
           '<path d="M0,0 L10,5 L0,10 z" fill="#58606b"/></marker></defs>';
    g.edges.forEach((e) => {
      const a = pos[e.src], b = pos[e.dst];
      if (!a || !b) return;
      let d;
      if (a.x === b.x) {  // same layer (a control edge back): a loop on the right
        const x = a.x + W, y1 = a.y + a.h / 2, y2 = b.y + b.h / 2;
        d = "M" + x + "," + y1 + " C" + (x + 50) + "," + y1 + " " + (x + 50) + "," + y2 + " " + x + "," + y2;
      } else {
        const fwd = a.x < b.x;
        const x1 = fwd ? a.x + W : a.x, x2 = fwd ? b.x : b.x + W, y1 = a.y + a.h / 2, y2 = b.y + b.h / 2, mx = (x1 + x2) / 2;
        d = "M" + x1 + "," + y1 + " C" + mx + "," + (y1 + (fwd ? 0 : 30)) + " " + mx + "," + (y2 + (fwd ? 0 : 30)) + " " + x2 + "," + y2;
      }
      svg += '<path class="gedge ' + e.kind + '" d="' + d + '" marker-end="url(#arrow)"><title>' +
             esc(e.src + " → " + e.dst + " (" + e.kind + (e.data_type ? ", " + e.data_type : "") +
                 (e.consistency === "eventual" ? ", eventual" : "") + ")") + "</title></path>";
    });
    g.nodes.forEach((n, i) => {
      const p = pos[n.name];
      svg += '<g class="gnode' + (n.data_parallel ? " dp" : "") + '" data-node="' + esc(n.name) + '" data-parallelism="' + n.parallelism +
             '" transform="translate(' + p.x + "," + p.y + ')">';
      svg += '<rect width="' + W + '" height="' + heights[i] + '" rx="5"/>';
      svg += '<text class="name" x="8" y="16">' + esc(n.name) + '</text><text class="muted" x="' + (W - 8) + '" y="16" text-anchor="end">' + esc(n.role) + "</text>";
      const planned = n.target != null && n.target !== n.parallelism ? " (target " + n.target + ")" : "";
      svg += '<text x="8" y="33">parallelism <tspan class="par" font-weight="600">' + n.parallelism + "</tspan> of planned " +
             esc(n.planned) + planned + (n.data_parallel ? " · data-parallel" : "") + "</text>";
      svg += '<text class="muted" x="8" y="47">group ' + esc(n.group) + " · queue " + esc(n.queue_len) + "</text>";
      n.workers.slice(0, 4).forEach((w, j) => {
        const gpus = w.gpu_ids.length ? " GPU " + w.gpu_ids.join(",") : "";
        svg += '<text class="placement" x="8" y="' + (62 + j * LINE) + '">[' + esc(w.instance) + "] node " +
               esc(String(w.node_id || "?").slice(0, 12)) + " pid " + esc(w.pid) + gpus + "</text>";
      });
      if (n.workers.length > 4) svg += '<text class="muted" x="8" y="' + (62 + 4 * LINE) + '">+' + (n.workers.length - 4) + " more</text>";
      svg += "</g>";
    });
    svg += "</svg>";
    fill("panel-graph", '<div style="overflow:auto">' + svg + '</div><div class="legend">' +
         '<span><span class="swatch" style="background:#58606b"></span>data edge (object store)</span>' +
         '<span><span class="swatch" style="background:#7b95c4"></span>co-located (same process)</span>' +
         '<span><span class="swatch" style="background:#b0563d"></span>control</span></div>');
  }

  function renderMemory(v) {
    const m = v.memory;
    if (!m.rows.length) return fill("panel-memory", empty(v.has_status ? "no workers" : NO_STATUS));
    let h = '<div class="heat">';
    m.rows.forEach((r) => {
      h += '<div class="node" title="' + esc(r.node_id) + '">node ' + esc(r.node_id.slice(0, 12)) + '</div><div class="cells">';
      r.cells.forEach((c) => {
        const f = c.bytes != null && m.max_bytes > 0 ? c.bytes / m.max_bytes : 0;
        const bg = c.bytes == null ? "#f3f4f6" : "rgba(214, 64, 40, " + (0.08 + 0.72 * f).toFixed(3) + ")";
        h += '<div class="cell" data-worker="' + esc(c.worker) + '" data-bytes="' + (c.bytes == null ? "" : c.bytes) +
             '" style="background:' + bg + '" title="pid ' + esc(c.pid) + '"><div>' + esc(c.worker) + '</div><div class="v">' +
             bytes(c.bytes) + '</div><div class="muted">' + esc(c.kind ? c.kind.toUpperCase() : "not sampled yet") + "</div></div>";
      });
      h += "</div>";
    });
    h += '</div><div class="legend"><span>total <b id="memory-total">' + bytes(m.total_bytes) + "</b> in " + m.sampled +
         " workers</span><span>darker: more memory (GPU memory reserved by torch on a GPU, else the process's RSS)</span></div>";
    fill("panel-memory", h);
  }

  function renderEdges(v) {
    if (!v.has_status) return fill("panel-edges", empty(NO_STATUS));
    if (!v.edges.length) return fill("panel-edges", empty("no data edges: every step runs in co-located processes"));
    let h = '<table><tr><th>edge</th><th class="num">transfers</th><th class="num">p50</th><th class="num">p95</th>' +
            '<th class="num">bytes</th><th class="num">bandwidth</th><th class="num">queue</th></tr>';
    v.edges.forEach((e) => {
      h += '<tr data-edge="' + esc(e.key) + '" data-p50="' + e.p50_s + '" data-p95="' + e.p95_s + '" data-bytes="' + e.bytes_total +
           '"><td>' + esc(e.key) + (e.colocated ? ' <span class="muted">(co-located: in process)</span>' : "") +
           '</td><td class="num">' + e.count + '</td><td class="num">' + secs(e.p50_s) + '</td><td class="num">' +
           secs(e.p95_s) + '</td><td class="num">' + bytes(e.bytes_total) + '</td><td class="num">' +
           (e.bandwidth_Bps == null ? "–" : bytes(e.bandwidth_Bps) + "/s") + '</td><td class="num">' + e.queue_len + "/" +
           esc(e.high_watermark) + "</td></tr>";
    });
    fill("panel-edges", h + '</table><div class="legend"><span>latency: from a batch put on the edge to its result taken ' +
         "(queueing and the consumer's work included); bandwidth: bytes over seconds in flight</span></div>");
  }

  const PARTS = [["compute", "var(--compute)"], ["communication", "var(--comm)"], ["scheduling", "var(--sched)"]];

  function renderBreakdown(v) {
    const b = v.breakdown;
    if (!b.steps) return fill("panel-breakdown", empty("no steps yet"));
    let h = '<div class="bar">';
    PARTS.forEach(([p, c]) => { h += '<div style="width:' + (100 * b.fraction[p]).toFixed(2) + "%;background:" + c + '" title="' + p + '"></div>'; });
    h += '</div><table><tr><th>part</th><th class="num">share</th><th class="num">mean per step</th><th class="num">last step</th></tr>';
    PARTS.forEach(([p, c]) => {
      h += '<tr data-part="' + p + '" data-fraction="' + b.fraction[p] + '"><td><span class="swatch" style="background:' + c + '"></span>' + p +
           '</td><td class="num share">' + pct(b.fraction[p]) + '</td><td class="num">' + secs(b.mean_s[p]) + '</td><td class="num">' +
           secs(b.last[p + "_s"]) + "</td></tr>";
    });
    h += '<tr><td>step</td><td class="num">100%</td><td class="num">' + secs(b.mean_s.step) + '</td><td class="num">' + secs(b.last.step_s) + "</td></tr></table>";
    h += stacked(b.series);
    h += '<div class="legend"><span>compute: worker compute on the critical path; communication: the rest of the phases ' +
         "(Ray calls, transfers, queue waits); scheduling: the controller outside the phases</span></div>";
    fill("panel-breakdown", h);
  }

  function stacked(series) {
    const W = 560, H = 90, n = series.length;
    const top = Math.max.apply(null, series.map((s) => s[1] + s[2] + s[3])) || 1;
    const bw = W / n;
    let svg = '<svg viewBox="0 0 ' + W + " " + (H + 14) + '" width="100%" preserveAspectRatio="none">';
    series.forEach((s, i) => {
      let y = H;
      for (let k = 0; k < 3; k++) {
        const hgt = (s[k + 1] / top) * H;
        y -= hgt;
        svg += '<rect x="' + (i * bw).toFixed(2) + '" y="' + y.toFixed(2) + '" width="' + Math.max(bw - 0.5, 0.5).toFixed(2) +
               '" height="' + hgt.toFixed(2) + '" style="fill:' + PARTS[k][1] + '"/>';
      }
    });
    svg += '<text class="muted" x="0" y="' + (H + 12) + '">step ' + series[0][0] + '</text><text class="muted" x="' + W + '" y="' + (H + 12) +
           '" text-anchor="end">step ' + series[n - 1][0] + " · max " + secs(top) + "</text></svg>";
    return svg;
  }

  const CURVE_LABEL = {reward_mean: "reward (mean)", kl: "KL", tokens_per_s: "tokens/s"};

  function renderCurves(v) {
    let h = '<div class="curves">';
    Object.keys(v.curves).forEach((key) => {
      const c = v.curves[key];
      h += '<div class="curve" id="curve-' + key + '"><div class="head"><span>' + esc(CURVE_LABEL[key] || key) + "</span><span>step " +
           esc(c.last_step) + ': <span class="last" data-key="' + key + '" data-value="' + (c.last == null ? "" : c.last) + '">' +
           num(c.last, key === "tokens_per_s" ? 1 : 4) + "</span></span></div>" + line(c.points) + "</div>";
    });
    fill("panel-curves", h + "</div>");
  }

  function line(points) {
    if (!points.length) return '<p class="empty">no values yet</p>';
    const W = 560, H = 70, L = 0;
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    const y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    const sx = (x) => L + (x1 > x0 ? ((x - x0) / (x1 - x0)) * (W - L) : W / 2);
    const sy = (y) => 4 + (y1 > y0 ? (1 - (y - y0) / (y1 - y0)) * (H - 8) : H / 2);
    const d = points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
    return '<svg viewBox="0 0 ' + W + " " + (H + 12) + '" width="100%" preserveAspectRatio="none"><line class="axis" x1="0" y1="' + H +
           '" x2="' + W + '" y2="' + H + '"/><path d="' + d + '" style="fill:none;stroke:var(--accent);stroke-width:1.6" vector-effect="non-scaling-stroke"/>' +
           '<text class="muted" x="0" y="' + (H + 11) + '">min ' + num(y0, 3) + '</text><text class="muted" x="' + W + '" y="' + (H + 11) +
           '" text-anchor="end">max ' + num(y1, 3) + "</text></svg>";
  }

  function renderDecisions(v) {
    const d = v.decisions;
    if (!d.items.length) return fill("panel-decisions", empty(v.has_status ? "no decisions yet" : NO_STATUS));
    let h = '<div class="scroll"><table><tr><th>time</th><th>kind</th><th>node</th><th>reason</th></tr>';
    d.items.slice().reverse().forEach((x) => {
      const t = x.time == null ? "–" : new Date(x.time * 1000).toISOString().replace("T", " ").slice(0, 19) + "Z";
      h += '<tr class="decision" data-kind="' + esc(x.kind) + '"><td class="num">' + t + '</td><td><span class="kind ' + esc(x.kind) + '">' +
           esc(x.kind) + "</span></td><td>" + esc(x.node) + "</td><td>" + esc(x.reason) + "</td></tr>";
    });
    fill("panel-decisions", h + '</table></div><div class="legend"><span>' + d.total + " decisions, newest first</span></div>");
  }

  function render(v) {
    document.getElementById("title").textContent = v.title;
    document.getElementById("step").textContent = v.step;
    document.getElementById("total").textContent = v.total_steps ? " / " + v.total_steps : "";
    document.getElementById("mode").textContent = config.live ? "live" : "report";
    document.getElementById("updated").textContent = "as of " + new Date(v.generated_at * 1000).toISOString().slice(11, 19) + "Z";
    const err = document.getElementById("error");
    err.hidden = !v.error;
    err.textContent = v.error || "";
    renderGraph(v);
    renderMemory(v);
    renderEdges(v);
    renderBreakdown(v);
    renderCurves(v);
    renderDecisions(v);
    document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
  }

  function poll() {
    fetch(config.live, {cache: "no-store"})
      .then((r) => { if (!r.ok) throw new Error("the dashboard server answered " + r.status); return r.json(); })
      .then(render)
      .catch((e) => { const err = document.getElementById("error"); err.hidden = false; err.textContent = String(e.message || e); })
      .finally(() => setTimeout(poll, config.refresh_ms));
  }

  render(JSON.parse(document.getElementById("hf-data").textContent));
  if (config.live) setTimeout(poll, config.refresh_ms);
})();
