// tritonllm Studio page: polls the server's JSON API every second and redraws what changed.
// Text from run folders is always inserted as text (textContent), never as HTML.
"use strict";

const POLL_MS = 1000;
const DETAIL_MS = 3000;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#65a30d", "#4b5563"];
// Each chart: title and its series [record kind, field, label]; a chart appears once one run has data for it.
const CHARTS = [
  {id: "loss", title: "loss (nats/token)", series: [["train", "loss", "train"], ["val", "val_loss", "val"]]},
  {id: "lr", title: "learning rate", series: [["train", "lr", "lr"]]},
  {id: "tokens_per_s", title: "tokens/s", series: [["train", "tokens_per_s", "tokens/s"]]},
  {id: "mfu", title: "MFU", series: [["train", "mfu", "MFU"]]},
  {id: "grad_norm", title: "gradient norm (before clipping)", series: [["train", "grad_norm", "grad norm"]]},
  {id: "skipped", title: "skipped steps (cumulative)", series: [["skip", "__count", "skipped"]]},
  {id: "gpu_mem", title: "GPU memory used (GB)", series: [["train", "gpu_mem_gb", "used"], ["train", "peak_mem_gb", "torch peak"]]},
  {id: "gpu_util", title: "GPU utilisation (%)", series: [["train", "gpu_util", "util"]]},
  {id: "gpu_temp", title: "GPU temperature (°C)", series: [["train", "gpu_temp_c", "temp"]]},
  {id: "gpu_power", title: "GPU power (W)", series: [["train", "gpu_power_w", "power"]]},
  {id: "moe", title: "MoE load", hideZero: true,
   series: [["train", "moe_max_load", "max load"], ["train", "moe_aux", "aux"], ["train", "moe_z", "z"]]},
  {id: "z_loss", title: "z-loss and auxiliary loss", hideZero: true, series: [["train", "z_loss", "z"], ["train", "aux", "aux"]]},
];
// axis tick labels with three significant digits, so MFU 3e-8 or lr 6e-4 read as such
const fmtTick = (v) => (v === 0 ? "0" : Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3 ? v.toExponential(1) : String(+v.toPrecision(3)));
const ticks = (u, vals) => vals.map(fmtTick);
const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6].map((p) => m * p)).sort((x, y) => x - y);  // whole steps

const state = {
  runs: new Map(),        // id -> summary
  data: new Map(),        // id -> {count, records}
  overlay: new Set(),     // ids drawn on the charts
  colors: new Map(),      // id -> color
  selected: null,         // id whose details are shown
  detail: null,           // /api/run answer for the selected run
  detailAt: 0,
  authorized: false,
  charts: new Map(),      // chart id -> {plot, key, zoomed, box}
};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children) if (c !== undefined && c !== null) e.append(c instanceof Node ? c : String(c));
  return e;
}

const fmt = (v, digits = 4) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toPrecision(digits) : String(v));
const fmtInt = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
const fmtAge = (t) => { if (!t) return "–"; const s = Date.now() / 1000 - t; return s < 60 ? `${s.toFixed(0)} s ago` : s < 3600 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`; };
const fmtBytes = (b) => (b >= 1e9 ? `${(b / 1e9).toFixed(2)} GB` : `${(b / 1e6).toFixed(1)} MB`);

async function api(path, options) {
  const r = await fetch(path, options);
  const body = await r.json().catch(() => ({error: `HTTP ${r.status}`}));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

function colorOf(id) {
  if (!state.colors.has(id)) state.colors.set(id, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(id);
}

// ------------------------------------------------------------------ run list
function renderRuns(roots) {
  document.getElementById("roots").textContent = roots.join("  ·  ");
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  document.getElementById("no-runs").hidden = state.runs.size > 0;
  for (const s of state.runs.values()) {
    const box = el("input", {type: "checkbox", title: "overlay on the charts"});
    box.checked = state.overlay.has(s.id);
    box.addEventListener("click", (ev) => {
      ev.stopPropagation();
      if (box.checked) state.overlay.add(s.id); else state.overlay.delete(s.id);
      poll();
    });
    const step = s.step === null ? "–" : s.max_steps ? `${s.step} / ${s.max_steps}` : String(s.step);
    const row = el("tr", {"data-run-id": s.id, "data-status": s.status, class: s.id === state.selected ? "selected" : "",
                          on: {click: () => select(s.id)}},
      el("td", {}, box),
      el("td", {title: s.path}, el("span", {class: "swatch", style: `background:${colorOf(s.id)}`}), s.id,
         s.model ? el("span", {class: "hint"}, ` ${s.model}`) : null),
      el("td", {}, el("span", {class: `status ${s.status}`}, s.status)),
      el("td", {class: "num"}, step),
      el("td", {class: "num"}, fmt(s.loss)),
      el("td", {class: "num"}, fmt(s.val_loss)),
      el("td", {class: "num"}, fmtInt(s.tokens_per_s)),
      el("td", {class: "num"}, s.mfu === null || s.mfu === undefined ? "–" : `${(100 * s.mfu).toFixed(1)}%`),
      el("td", {class: "num"}, s.checkpoints),
      el("td", {}, fmtAge(s.updated)),
      el("td", {class: "problem"}, s.problems.length ? s.problems.join("; ") : ""));
    body.append(row);
  }
}

function select(id) {
  state.selected = id;
  state.overlay.add(id);
  state.detail = null;
  state.detailAt = 0;
  document.querySelectorAll("#runs tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.runId === id));
  poll();
}

// ------------------------------------------------------------------ metrics and charts
async function fetchMetrics(id) {
  const d = state.data.get(id) || {count: 0, records: []};
  const got = await api(`/api/metrics?id=${encodeURIComponent(id)}&since=${d.count}`);
  if (got.count < d.count) { d.count = 0; d.records = []; }  // the file was replaced: start over
  d.records.push(...got.records);
  d.count = got.count;
  state.data.set(id, d);
  return got.records.length > 0;
}

function seriesPoints(records, kind, field) {
  const byStep = new Map();
  let n = 0;
  for (const r of records) {
    if (r.kind !== kind || typeof r.step !== "number") continue;
    if (field === "__count") byStep.set(r.step, ++n);
    else if (typeof r[field] === "number") byStep.set(r.step, r[field]);
  }
  const xs = [...byStep.keys()].sort((a, b) => a - b);
  return [xs, xs.map((x) => byStep.get(x))];
}

function renderCharts() {
  const host = document.getElementById("charts");
  for (const spec of CHARTS) {
    const tables = [], series = [{label: "step"}];
    let points = 0, nonzero = false;
    for (const id of state.overlay) {
      const d = state.data.get(id);
      if (!d) continue;
      spec.series.forEach(([kind, field, label], i) => {
        const [xs, ys] = seriesPoints(d.records, kind, field);
        if (!xs.length) return;
        points += xs.length;
        nonzero = nonzero || ys.some((y) => y !== 0);
        tables.push([xs, ys]);
        // a run's colour throughout; its second and third series of a chart dashed
        series.push({label: state.overlay.size > 1 ? `${id} ${label}` : label, stroke: colorOf(id), width: 1.5,
                     dash: i > 0 ? [6, 4] : undefined, spanGaps: true, points: {show: kind !== "train"}});
      });
    }
    let chart = state.charts.get(spec.id);
    if (!tables.length || spec.hideZero && !nonzero) {
      if (chart) { chart.plot.destroy(); chart.box.remove(); state.charts.delete(spec.id); }
      continue;
    }
    const data = uPlot.join(tables);
    const key = series.map((s) => s.label).join("|");
    if (chart && chart.key !== key) { chart.plot.destroy(); chart.box.remove(); state.charts.delete(spec.id); chart = null; }
    if (!chart) {
      const box = el("div", {class: "chart", "data-chart": spec.id}, el("h3", {}, spec.title));
      // keep the order of CHARTS: before the first chart that comes later in the list
      const later = CHARTS.slice(CHARTS.indexOf(spec) + 1).map((c) => state.charts.get(c.id)).find(Boolean);
      host.insertBefore(box, later ? later.box : null);
      chart = {key, zoomed: false, box};
      const width = Math.max(300, box.clientWidth - 16);
      chart.plot = new uPlot({
        width, height: 220, series, legend: {live: false},
        scales: {x: {time: false}}, axes: [{label: "step", incrs: STEP_INCRS}, {size: 64, values: ticks}],
        cursor: {sync: {key: "steps"}, drag: {x: true, y: false}},
        hooks: {setSelect: [(u) => { if (u.select.width > 0) chart.zoomed = true; }]},
      }, data, box);
      chart.plot.over.addEventListener("dblclick", () => { chart.zoomed = false; });
      state.charts.set(spec.id, chart);
    } else {
      chart.plot.setData(data, !chart.zoomed);
    }
    chart.box.dataset.points = String(points);
  }
}

// ------------------------------------------------------------------ the selected run
function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))),
            el("tbody", {}, ...rows.map((r) => (r instanceof Node ? r : el("tr", {}, ...r.map((c) => el("td", {}, c)))))));
}

function renderRun() {
  const d = state.detail, s = state.runs.get(state.selected);
  document.getElementById("run-section").hidden = !s;
  document.getElementById("details").hidden = !s;
  if (!s) return;
  document.getElementById("run-title").textContent = `${s.id} — ${s.status}`;
  const usable = Boolean(s.controllable && d && d.token);
  for (const b of ["btn-stop", "btn-ckpt", "btn-lr"]) document.getElementById(b).disabled = !usable;
  document.getElementById("lr-scale").disabled = !usable;
  const msg = document.getElementById("control-msg");
  if (!msg.dataset.sticky) {
    msg.textContent = usable ? `lr multiplier now ${s.lr_scale}` : !s.controllable ? "controls: only for a running run started with trainer.control=true"
      : !state.authorized ? "controls: open the address that python -m tritonllm.studio printed (it carries the key)" : "";
  }
  document.getElementById("problems").replaceChildren(...s.problems.map((p) => el("li", {class: "problem"}, p)));

  const records = (state.data.get(s.id) || {records: []}).records;
  const samples = records.filter((r) => r.kind === "sample").reverse();
  document.getElementById("samples").replaceChildren(samples.length ? el("div", {}, ...samples.map((r) =>
    el("div", {class: "sample"}, el("div", {class: "hint"}, `step ${r.step}`), el("pre", {}, `${r.prompt || ""}${r.text || ""}`))))
    : el("p", {class: "hint"}, "No samples yet (trainer.sample_tokens and trainer.sample_interval write them)."));
  const events = records.filter((r) => ["skip", "control", "end"].includes(r.kind));
  document.getElementById("events").replaceChildren(events.length ? table(["step", "kind", "what"], events.map((r) => [
    r.step, r.kind, r.kind === "skip" ? `loss ${r.loss}, grad norm ${r.grad_norm}` : r.kind === "control"
      ? r.action + (r.action === "lr_scale" ? ` = ${r.lr_scale}` : "") : r.status + (r.error ? `: ${r.error}` : "")]))
    : el("p", {class: "hint"}, "No skipped steps, control requests or end record yet."));
  if (!d) return;
  document.getElementById("checkpoints").replaceChildren(d.checkpoints.length ? table(
    ["step", "size", "loss", "val loss", "resume with"],
    d.checkpoints.map((c) => [c.step + (c.complete ? "" : " (incomplete)"), fmtBytes(c.bytes), fmt(c.loss), fmt(c.val_loss),
                              c.resume ? el("code", {class: "cmd"}, c.resume)
                              : el("span", {class: "hint"}, "unknown: the run folder has no .hydra/overrides.yaml")]))
    : el("p", {class: "hint"}, "No checkpoints yet."));
  document.getElementById("log").replaceChildren(d.log ? el("div", {}, el("p", {class: "hint"}, `end of ${d.log.file}`),
                                                            el("pre", {}, d.log.text))
    : el("p", {class: "hint"}, "No log file in the run folder (python -m tritonllm.train writes one through Hydra)."));
  const cfg = [];
  if (d.overrides) cfg.push(el("p", {}, "overrides: ", el("code", {}, d.overrides.join(" ") || "(none)")));
  if (d.meta && d.meta.device) cfg.push(el("p", {class: "hint"}, `device ${d.meta.device} on ${d.meta.host}` +
    (d.meta.git && d.meta.git.commit ? `, commit ${d.meta.git.commit.slice(0, 10)}${d.meta.git.dirty ? " (dirty)" : ""}` : "")));
  cfg.push(el("pre", {}, d.config ? JSON.stringify(d.config, null, 2) : "no run_info.json or .hydra/config.yaml"));
  document.getElementById("config").replaceChildren(...cfg);
  const params = d.params || [];
  const total = params.reduce((a, p) => a + p.numel, 0);
  document.getElementById("params").replaceChildren(params.length
    ? el("div", {}, el("p", {}, `${params.length} tensors, ${fmtInt(total)} parameters`),
         table(["name", "shape", "dtype", "count"], params.map((p) => [p.name, `[${p.shape.join(", ")}]`, p.dtype, fmtInt(p.numel)])))
    : el("p", {class: "hint"}, "No parameter table (written by the trainer at start, or read from a checkpoint)."));
  renderEvolve(d.evolve);
}

function renderEvolve(ev) {
  const box = document.getElementById("evolve-box");
  box.hidden = !ev;
  if (!ev) return;
  // the objectives first, then every other column that has a value somewhere
  const first = ["trial", "generation", "status", "val_loss", "tokens_per_s", "peak_mem_gb", "params"];
  const all = [...new Set(ev.rows.flatMap((r) => Object.keys(r)))].filter((c) => ev.rows.some((r) => r[c] !== "" && r[c] !== null));
  const cols = [...first.filter((c) => all.includes(c)), ...all.filter((c) => !first.includes(c))];
  const front = new Set(ev.pareto);
  const rows = ev.rows.map((r, i) => el("tr", {class: front.has(i) ? "pareto" : ""}, ...cols.map((c) => el("td", {}, fmt(r[c])))));
  const plotBox = el("div", {class: "chart", "data-chart": "pareto"}, el("h3", {}, "validation loss against tokens/s (Pareto front in green)"));
  const b = ev.best && ev.best.best;
  const best = b ? `; best under the memory cap (${ev.best.memory_cap_gb ?? "none"} GB): trial ${b.trial}, val loss ${fmt(b.val_loss)}, `
    + `${fmtInt(b.tokens_per_s)} tokens/s, ${fmt(b.peak_mem_gb, 3)} GB` : "";
  document.getElementById("evolve").replaceChildren(
    el("p", {}, `${ev.rows.length} candidates from ${ev.file}, ${front.size} on the Pareto front${best}`),
    plotBox, el("div", {style: "overflow-x:auto"}, table(cols, rows)));
  const pts = ev.rows.map((r, i) => [r.tokens_per_s, r.val_loss, front.has(i)]).filter((p) => typeof p[0] === "number" && typeof p[1] === "number");
  if (!pts.length) return;
  pts.sort((a, b) => a[0] - b[0]);
  new uPlot({width: 560, height: 240, scales: {x: {time: false}}, legend: {live: false},
    axes: [{label: "tokens/s", values: ticks}, {label: "val loss", size: 64, values: ticks}],
    series: [{label: "tokens/s"},
      {label: "candidates", stroke: "#9ca3af", paths: () => null, points: {show: true, size: 6}},
      {label: "Pareto front", stroke: "#16a34a", width: 2, spanGaps: true, points: {show: true, size: 8}}]},
  [pts.map((p) => p[0]), pts.map((p) => p[1]), pts.map((p) => (p[2] ? p[1] : null))], plotBox);
}

// ------------------------------------------------------------------ controls
let armedUntil = 0;
async function control(body) {
  const msg = document.getElementById("control-msg");
  msg.dataset.sticky = "1";
  try {
    const r = await api(`/api/control?id=${encodeURIComponent(state.selected)}`, {
      method: "POST", headers: {"Content-Type": "application/json", "X-Studio-Token": state.detail.token}, body: JSON.stringify(body)});
    msg.textContent = `sent: ${body.action}${body.value !== undefined ? " " + body.value : ""} (the trainer acts at its next log step)`;
    return r;
  } catch (e) {
    msg.textContent = `refused: ${e.message}`;
  } finally {
    setTimeout(() => { delete msg.dataset.sticky; }, 5000);
  }
}

document.getElementById("btn-stop").addEventListener("click", (ev) => {
  const b = ev.currentTarget;
  if (Date.now() > armedUntil) {  // two clicks: the first arms the button for five seconds
    armedUntil = Date.now() + 5000;
    b.classList.add("armed");
    b.textContent = "Click again to stop";
    setTimeout(() => { b.classList.remove("armed"); b.textContent = "Stop (checkpoint, then exit)"; }, 5000);
    return;
  }
  armedUntil = 0;
  b.classList.remove("armed");
  b.textContent = "Stop (checkpoint, then exit)";
  control({action: "stop"});
});
document.getElementById("btn-ckpt").addEventListener("click", () => control({action: "checkpoint"}));
document.getElementById("btn-lr").addEventListener("click", () => control({action: "lr_scale", value: Number(document.getElementById("lr-scale").value)}));

// ------------------------------------------------------------------ the poll loop
let busy = false;
async function poll() {
  if (busy) return;
  busy = true;
  const live = document.getElementById("live");
  try {
    const got = await api("/api/runs");
    state.authorized = got.authorized;
    state.runs = new Map(got.runs.map((s) => [s.id, s]));
    for (const id of [...state.overlay]) if (!state.runs.has(id)) state.overlay.delete(id);
    if (state.selected === null && got.runs.length) { state.selected = got.runs[0].id; state.overlay.add(state.selected); }
    if (state.selected !== null && !state.runs.has(state.selected)) state.selected = null;
    renderRuns(got.roots);
    const changed = await Promise.all([...state.overlay].map(fetchMetrics));
    if (state.selected !== null && (Date.now() - state.detailAt > DETAIL_MS || changed.some(Boolean))) {
      state.detail = await api(`/api/run?id=${encodeURIComponent(state.selected)}`);
      state.detailAt = Date.now();
    }
    renderCharts();
    renderRun();
    live.classList.remove("down");
    live.textContent = "● live";
  } catch (e) {
    live.classList.add("down");
    live.textContent = `● server unreachable (${e.message})`;
  } finally {
    busy = false;
  }
}

poll();
setInterval(poll, POLL_MS);
