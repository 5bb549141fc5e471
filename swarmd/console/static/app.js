// The swarmd console's page: one EventSource for the swarm, jobs, services and this node
// (GET /api/v1/events), one more for the output of the job shown. Everything a member, a job
// or a user wrote is put in the page as text (textContent, createTextNode), never as markup,
// and stripped of control and bidi-override characters first.
"use strict";

const API = "/api/v1";
const HISTORY = 120; // snapshots kept for the node's charts (2 minutes at one a second)
const OUTPUT_LINES = 500; // output lines kept on the page
const state = { snapshot: null, history: [], job: null, service: null, follow: null, output: [], serviceRates: {} };

// --- text in, text out ---------------------------------------------------------------------

const CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
function clean(value) {
  return value === null || value === undefined ? "" : String(value).replace(CONTROL, "\ufffd");
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, clean(value));
    else if (key === "title") node.title = clean(value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(clean(child)));
  }
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  return node;
}
function short(peer) { return peer ? clean(peer).slice(-8) : ""; }
function age(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 120) return `${seconds.toFixed(0)} s`;
  if (seconds < 7200) return `${(seconds / 60).toFixed(0)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}
function ms(value) { return value === null || value === undefined ? "" : `${Number(value).toFixed(1)} ms`; }
function when(epoch) { return epoch ? new Date(epoch * 1000).toLocaleTimeString() : ""; }
function fill(tbody, rows) { tbody.replaceChildren(...rows); }
function failed(part) { return part && typeof part === "object" && "error" in part && Object.keys(part).length === 1; }

// --- views ---------------------------------------------------------------------------------

function showView() {
  const name = (location.hash || "#swarm").slice(1);
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== name;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("on", link.dataset.view === name);
}

function renderSwarm(part) {
  const tbody = document.querySelector("#members tbody");
  const summary = document.getElementById("swarm-summary");
  if (failed(part)) { fill(tbody, [el("tr", {}, el("td", {}, part.error))]); return; }
  const members = part.members || [];
  const counts = {};
  for (const m of members) counts[m.state] = (counts[m.state] || 0) + 1;
  summary.replaceChildren(
    el("p", {}, "swarm ", el("code", {}, part.swarm || "(none)")),
    el("p", {}, "this node ", el("code", {title: part.me ? part.me.peer : ""}, part.me ? short(part.me.peer) : "")),
    el("p", {}, Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(", ") || "no other member"));
  fill(tbody, members.map((m) => {
    const path = (part.paths || {})[m.peer];
    const labels = Object.entries(m.labels || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    return el("tr", {"data-peer": m.peer, "data-state": m.state},
      el("td", {title: m.peer}, short(m.peer)), el("td", {class: `state ${clean(m.state)}`}, m.state),
      el("td", {}, ms(m.rtt_ms)), el("td", {}, m.summary || ""), el("td", {class: "labels"}, labels),
      el("td", {}, m.nat || ""), el("td", {}, age(m.record_age_s)),
      el("td", {}, path ? (path.relay ? `via ${short(path.relay)}` : clean(path.path || "")) : ""));
  }));
  drawMap(part);
}

// Vivaldi coordinates have several dimensions: the map shows the plane of the two along which
// the members spread most (principal components by power iteration), heights left out.
function project(vectors) {
  const n = vectors.length, d = vectors[0].length;
  const mean = new Array(d).fill(0);
  for (const v of vectors) v.forEach((x, i) => { mean[i] += x / n; });
  const centred = vectors.map((v) => v.map((x, i) => x - mean[i]));
  const axes = [];
  for (let k = 0; k < Math.min(2, d); k++) {
    let axis = new Array(d).fill(0).map((_, i) => (i === k ? 1 : 0.01 * (i + 1)));
    for (let round = 0; round < 50; round++) {
      const next = new Array(d).fill(0);
      for (const v of centred) {
        const dot = v.reduce((s, x, i) => s + x * axis[i], 0);
        v.forEach((x, i) => { next[i] += dot * x; });
      }
      for (const prev of axes) {
        const dot = next.reduce((s, x, i) => s + x * prev[i], 0);
        prev.forEach((x, i) => { next[i] -= dot * x; });
      }
      const norm = Math.hypot(...next) || 1;
      axis = next.map((x) => x / norm);
    }
    axes.push(axis);
  }
  return centred.map((v) => axes.map((a) => v.reduce((s, x, i) => s + x * a[i], 0)).concat([0, 0]).slice(0, 2));
}

// Classical multidimensional scaling of an RTT matrix into the plane (for a swarm whose
// coordinates have not moved from the origin yet: a new one).
function mds(d) {
  const n = d.length;
  const sq = d.map((row) => row.map((x) => x * x));
  const rowMean = sq.map((row) => row.reduce((a, b) => a + b, 0) / n);
  const all = rowMean.reduce((a, b) => a + b, 0) / n;
  const b = sq.map((row, i) => row.map((x, j) => -0.5 * (x - rowMean[i] - rowMean[j] + all)));
  const out = d.map(() => [0, 0]);
  const found = [];
  for (let k = 0; k < 2; k++) {
    let v = d.map((_, i) => 1 + ((i * 7 + k * 3) % 5));
    let value = 0;
    for (let round = 0; round < 100; round++) {
      let w = b.map((row) => row.reduce((s, x, j) => s + x * v[j], 0));
      for (const [u] of found) {
        const dot = w.reduce((s, x, i) => s + x * u[i], 0);
        w = w.map((x, i) => x - dot * u[i]);
      }
      const norm = Math.hypot(...w) || 1;
      value = norm;
      v = w.map((x) => x / norm);
    }
    found.push([v, value]);
    v.forEach((x, i) => { out[i][k] = x * Math.sqrt(Math.max(value, 0)); });
  }
  return out;
}

// The plane to draw: the coordinates' two principal components once the members have spread
// (a coordinate is where Vivaldi put it: distance ≈ RTT), else the RTTs measured, by MDS.
function layout(part, members) {
  const dims = members[0].coord ? members[0].coord.length - 3 : 0;
  if (dims > 0 && members.every((m) => m.coord)) {
    const points = project(members.map((m) => m.coord.slice(0, dims)));
    const spread = Math.max(...points.map((p) => Math.hypot(p[0], p[1])));
    if (spread >= 1) return {points, by: "network coordinates"};
  }
  if (members.length > 200) return {points: members.map((_, i) => [i % 20, Math.floor(i / 20)]), by: "nothing yet"};
  const index = new Map(members.map((m, i) => [m.peer, i]));
  const rtt = members.map(() => members.map(() => null));
  const me = part.me ? index.get(part.me.peer) : undefined;
  members.forEach((m, i) => {
    if (me !== undefined && i !== me && typeof m.rtt_ms === "number") { rtt[me][i] = rtt[i][me] = m.rtt_ms; }
    for (const [peer, value] of Object.entries(m.rtts_ms || {})) {
      const j = index.get(peer);
      if (j !== undefined && j !== i && typeof value === "number") { rtt[i][j] = rtt[j][i] = value; }
    }
  });
  const d = rtt.map((row, i) => row.map((x, j) => {
    if (i === j) return 0;
    if (x !== null) return x;
    const via = me !== undefined ? (rtt[i][me] || 0) + (rtt[me][j] || 0) : 0;
    return via || 50;
  }));
  return {points: mds(d), by: "measured RTTs (the coordinates are still settling)"};
}

function drawMap(part) {
  const map = document.getElementById("map");
  const members = (part.me ? [{...part.me, me: true}] : []).concat(part.members || []);
  map.replaceChildren();
  if (members.length === 0) return;
  const {points, by} = layout(part, members);
  document.getElementById("map-by").textContent = by;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const span = Math.max(Math.max(...xs) - Math.min(...xs), Math.max(...ys) - Math.min(...ys), 1);
  const scale = 320 / span;
  const cx = (Math.max(...xs) + Math.min(...xs)) / 2, cy = (Math.max(...ys) + Math.min(...ys)) / 2;
  const at = new Map(members.map((m, i) => [m.peer, [300 + (points[i][0] - cx) * scale, 200 + (points[i][1] - cy) * scale]]));
  const me = part.me && at.get(part.me.peer);
  for (const [peer, path] of Object.entries(part.paths || {})) {
    const to = at.get(peer);
    if (!me || !to) continue;
    const via = path.relay && at.get(path.relay);
    const line = (a, b) => svg("line", {x1: a[0], y1: a[1], x2: b[0], y2: b[1], class: via ? "path relayed" : "path"});
    if (via) { map.append(line(me, via), line(via, to)); } else { map.append(line(me, to)); }
  }
  members.forEach((m) => {
    const [x, y] = at.get(m.peer);
    const dot = svg("circle", {cx: x, cy: y, r: m.me ? 8 : 6, class: `member ${m.me ? "me" : clean(m.state)}`,
                               "data-peer": clean(m.peer)});
    const title = svg("title");
    title.textContent = `${clean(m.peer)} (${clean(m.state)})`;
    dot.append(title);
    const label = svg("text", {x: x + 10, y: y + 4, class: "member-label"});
    label.textContent = short(m.peer);
    map.append(dot, label);
  });
  if (50 * scale < 560) {
    const bar = svg("line", {x1: 20, y1: 385, x2: 20 + 50 * scale, y2: 385, class: "scale"});
    const barText = svg("text", {x: 25 + 50 * scale, y: 389, class: "member-label"});
    barText.textContent = "50 ms";
    map.append(bar, barText);
  }
}

function renderJobs(part) {
  const tbody = document.querySelector("#job-list tbody");
  if (failed(part)) { fill(tbody, [el("tr", {}, el("td", {}, part.error))]); return; }
  fill(tbody, (part.jobs || []).map((j) => {
    const row = el("tr", {"data-job": j.id, class: j.id === state.job ? "selected" : ""},
      el("td", {}, el("a", {}, j.id)), el("td", {}, j.name || ""), el("td", {class: `state ${clean(j.state)}`}, j.state),
      el("td", {}, (j.nodes || []).map(short).join(" ")), el("td", {}, (j.attempts || []).length || ""),
      el("td", {}, j.exit_code === null || j.exit_code === undefined ? "" : j.exit_code), el("td", {}, j.reason || ""));
    row.addEventListener("click", () => selectJob(j.id));
    return row;
  }));
  if (state.job) refreshJob();
}

async function api(path, options) {
  const response = await fetch(API + path, {credentials: "same-origin", ...options});
  const body = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function selectJob(id) {
  state.job = id;
  state.output = [];
  document.getElementById("job-detail").hidden = false;
  document.getElementById("job-title").textContent = `job ${clean(id)}`;
  document.getElementById("job-output").textContent = "";
  if (state.follow) state.follow.close();
  const follow = state.follow = new EventSource(`${API}/jobs/${encodeURIComponent(id)}/logs/follow`);
  const said = document.getElementById("job-output-state");
  said.textContent = "live";
  follow.addEventListener("lines", (event) => {
    for (const [rank, text] of JSON.parse(event.data)) state.output.push(`[rank ${rank}] ${clean(text)}`);
    state.output = state.output.slice(-OUTPUT_LINES);
    const pre = document.getElementById("job-output");
    pre.textContent = state.output.join("\n");
    pre.scrollTop = pre.scrollHeight;
  });
  follow.addEventListener("end", () => { said.textContent = "(the job ended)"; follow.close(); });
  follow.addEventListener("error", () => { if (follow.readyState === EventSource.CLOSED) said.textContent = ""; });
  refreshJob();
}

async function refreshJob() {
  const id = state.job;
  let j;
  try { j = await api(`/jobs/${encodeURIComponent(id)}`); } catch (err) {
    document.getElementById("job-state").textContent = clean(err.message); return;
  }
  if (id !== state.job) return;
  const h = j.handover;
  const handover = h && h.coordinator
    ? `; coordinated by ${short(h.coordinator)}${h.epoch > 0 ? ` since a hand-over at ${when(h.since)} (epoch ${Number(h.epoch)})` : ""}`
    : "";
  document.getElementById("job-state").textContent = `${clean(j.state)}${j.phase ? ` (${clean(j.phase)})` : ""}${handover}`;
  document.getElementById("job-cancel").hidden = ["succeeded", "failed", "cancelled"].includes(j.state);
  drawTimeline(j);
  fill(document.querySelector("#job-checkpoints tbody"), (j.checkpoints || []).map((c) =>
    el("tr", {}, el("td", {}, c.name), el("td", {}, c.size ? `${(c.size / 1024).toFixed(0)} kB` : ""),
       el("td", {}, (c.holders || []).map(short).join(" ")))));
}

function drawTimeline(j) {
  const box = document.getElementById("job-timeline");
  const attempts = j.attempts || [];
  if (attempts.length === 0) { box.replaceChildren(el("p", {}, "not started")); return; }
  const start = Math.min(...attempts.map((a) => a.placed || a.started || j.created || 0));
  const end = Math.max(...attempts.map((a) => a.ended || Date.now() / 1000));
  const span = Math.max(end - start, 1);
  box.replaceChildren(...attempts.map((a) => {
    const from = ((a.placed || a.started || start) - start) / span * 100;
    const to = ((a.ended || Date.now() / 1000) - start) / span * 100;
    const bar = el("div", {class: `bar ${a.ended ? (a.why ? "ended" : "done") : "running"}`,
                          title: a.why || ""}, `#${a.n} on ${(a.nodes || []).length} host(s)`);
    bar.style.marginLeft = `${from.toFixed(2)}%`;
    bar.style.width = `${Math.max(to - from, 2).toFixed(2)}%`;
    return el("div", {class: "attempt"}, bar,
      el("span", {class: "why"}, `${when(a.started)}${a.why ? `: ${a.why}` : ""}${a.resumed_from ? ` (from ${a.resumed_from})` : ""}`));
  }));
}

function renderServices(part) {
  const tbody = document.querySelector("#service-list tbody");
  if (failed(part)) { fill(tbody, [el("tr", {}, el("td", {}, part.error))]); return; }
  fill(tbody, (part.services || []).map((s) => {
    const row = el("tr", {"data-service": s.name}, el("td", {}, el("a", {}, s.name)), el("td", {}, s.replicas),
      el("td", {}, s.serving), el("td", {}, s.access || ""), el("td", {}, short(s.controller)));
    row.addEventListener("click", () => { state.service = s.name; refreshService(); });
    return row;
  }));
  if (state.service) refreshService();
}

async function refreshService() {
  const name = state.service;
  let s;
  try { s = await api(`/services/${encodeURIComponent(name)}`); } catch (err) { return; }
  if (name !== state.service) return;
  const shown = document.getElementById("service-detail").hidden === false && state.shownService === name;
  document.getElementById("service-detail").hidden = false;
  document.getElementById("service-title").textContent = `service ${clean(name)}`;
  if (!shown) document.getElementById("service-wanted").value = String(Number(s.replicas_wanted) || 0);
  state.shownService = name;
  const num = (v, digits = 1) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "");
  fill(document.querySelector("#service-replicas tbody"), (s.replicas || []).map((r) =>
    el("tr", {}, el("td", {}, r.index), el("td", {}, short(r.host)),
       el("td", {}, r.healthy ? (r.draining ? "draining" : "yes") : "no"), el("td", {}, ms(r.rtt_ms)),
       el("td", {}, num(r.rate_per_s, 2)), el("td", {}, num(r.in_flight, 0)), el("td", {}, ms(r.p50_ms)),
       el("td", {}, ms(r.p99_ms)), el("td", {}, ms(r.demand_rtt_ms)), el("td", {}, r.job || ""))));
  const auto = s.autoscale || {};
  const demand = auto.demand || {};
  const points = demand.points || [];
  const total = points.reduce((a, [, w]) => a + Number(w || 0), 0) || 1;
  fill(document.querySelector("#service-entries tbody"), points.length
    ? points.map(([peer, w]) => el("tr", {}, el("td", {title: peer}, short(peer)), el("td", {}, `${(Number(w) / total * 100).toFixed(0)} %`)))
    : [el("tr", {}, el("td", {}, "no requests measured yet"), el("td", {}, ""))]);
  const g = s.gateway;
  document.getElementById("service-gateway").textContent = g
    ? `this member's gateway: ${num(g.rate_per_s, 2)} req/s, ${g.requests || 0} requests, ${g.failures || 0} failed, p50 ${ms(g.p50_ms)}, p99 ${ms(g.p99_ms)}`
    : "this member's gateway has seen no request for it";
  const d = auto.decision;
  document.getElementById("service-decision").textContent = d
    ? `${Number(d.replicas)} replica(s), ${clean(d.mode)}: ${clean(d.reason)}${typeof d.forecast_rate === "number" ? `; forecast ${d.forecast_rate.toFixed(2)} req/s` : ""}`
    : (s.autoscale ? "no decision yet" : "a fixed number of replicas (no autoscaling)");
  fill(document.getElementById("service-events"), (auto.events || []).slice().reverse().map((e) =>
    el("li", {}, `${when(e.at)} ${Number(e.from)} → ${Number(e.to)} (${clean(e.mode)}): ${clean(e.reason)}`)));
  drawServiceChart(s, demand);
  const facts = document.getElementById("service-facts");
  facts.replaceChildren(...flatten(s, "", ["replicas"]).map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]).flat());
}

// The scaler's observed rate per bin and its forecast when it has one; else the demand's rate
// as this page saw it.
function drawServiceChart(s, demand) {
  const box = document.getElementById("service-chart");
  const scaler = (s.autoscale || {}).scaler;
  let observed = scaler && scaler.history && scaler.history.length ? scaler.history : null;
  const forecast = scaler && scaler.forecast ? scaler.forecast : [];
  if (!observed) {
    const seen = state.serviceRates[s.name] = (state.serviceRates[s.name] || []).concat(
      typeof demand.rate_per_s === "number" ? [[Date.now() / 1000, demand.rate_per_s]] : []).slice(-HISTORY);
    observed = seen;
  }
  const all = observed.concat(forecast);
  box.replaceChildren();
  if (all.length < 2) return;
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const top = Math.max(1, ...all.map((p) => p[1]));
  const xy = (p) => `${((p[0] - t0) / Math.max(t1 - t0, 1) * 470 + 5).toFixed(1)},${(115 - p[1] / top * 105).toFixed(1)}`;
  box.append(svg("polyline", {points: observed.map(xy).join(" "), class: "series"}));
  if (forecast.length) box.append(svg("polyline", {points: forecast.map(xy).join(" "), class: "series forecast"}));
  const label = svg("text", {x: 5, y: 12, class: "member-label"});
  label.textContent = `${top.toFixed(1)} req/s`;
  box.append(label);
}

// A nested reply as "a.b.c: value" pairs: shown as text, whatever a daemon adds.
function flatten(value, prefix, skip) {
  if (value === null || typeof value !== "object") return [[prefix, value === null ? "" : String(value)]];
  if (Array.isArray(value) && value.every((x) => x === null || typeof x !== "object")) return [[prefix, value.join(", ")]];
  const out = [];
  for (const [key, inner] of Object.entries(value)) {
    if (!prefix && (skip || []).includes(key)) continue;
    out.push(...flatten(inner, prefix ? `${prefix}.${key}` : key));
  }
  return out.slice(0, 400);
}

const CHARTS = [
  ["members alive", (s) => (s.swarm.members || []).filter((m) => m.state === "alive").length + 1],
  ["gossip in, kB/s", (s, prev) => prev && s.node.gossip && prev.node.gossip
    ? Math.max(0, (s.node.gossip.bytes_in - prev.node.gossip.bytes_in) / 1024 / Math.max(s.node.uptime_s - prev.node.uptime_s, 0.1)) : null],
  ["ranks running here", (s) => Number((s.node.jobs && s.node.jobs.ranks_here) || 0)],
  ["pairs relayed here", (s) => Number((s.node.routing && s.node.routing.relay && s.node.routing.relay.pairs) || 0)],
  ["coordinate error", (s) => (s.node.routing && s.node.routing.coordinate ? Number(s.node.routing.coordinate.error) : null)],
];

function renderNode() {
  const charts = document.getElementById("node-charts");
  const ok = state.history.filter((s) => !failed(s.node) && !failed(s.swarm));
  charts.replaceChildren(...CHARTS.map(([title, pick]) => {
    const values = ok.map((s, i) => { try { return pick(s, ok[i - 1]); } catch (err) { return null; } });
    return chart(title, values);
  }));
  const node = state.snapshot && state.snapshot.node;
  const facts = document.getElementById("node-facts");
  if (!node || failed(node)) { facts.replaceChildren(el("dd", {}, node ? node.error : "")); return; }
  facts.replaceChildren(...flatten(node, "").map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]).flat());
}

function chart(title, values) {
  const box = svg("svg", {viewBox: "0 0 240 60", class: "chart"});
  const nums = values.map((v) => (typeof v === "number" && isFinite(v) ? v : null));
  const top = Math.max(1, ...nums.filter((v) => v !== null));
  const pts = nums.map((v, i) => (v === null ? null : `${(i / Math.max(HISTORY - 1, 1) * 240).toFixed(1)},${(58 - v / top * 50).toFixed(1)}`))
    .filter((p) => p !== null);
  if (pts.length) box.append(svg("polyline", {points: pts.join(" "), class: "series"}));
  const last = nums.filter((v) => v !== null).pop();
  return el("figure", {class: "chart-box"}, box, el("figcaption", {}, `${title}: ${last === undefined ? "" : Number(last).toFixed(1)}`));
}

function render() {
  const s = state.snapshot;
  if (!s) return;
  renderSwarm(s.swarm);
  renderJobs(s.jobs);
  renderServices(s.services);
  renderNode();
}

// --- wiring -----------------------------------------------------------------------------

function connect() {
  const live = document.getElementById("live");
  const events = new EventSource(`${API}/events`);
  events.addEventListener("snapshot", (event) => {
    state.snapshot = JSON.parse(event.data);
    state.history = state.history.concat([state.snapshot]).slice(-HISTORY);
    live.textContent = `live, ${new Date().toLocaleTimeString()}`;
    live.className = "live on";
    render();
  });
  events.addEventListener("error", () => { live.textContent = "reconnecting…"; live.className = "live off"; });
}

document.addEventListener("DOMContentLoaded", () => {
  window.addEventListener("hashchange", showView);
  showView();
  document.getElementById("job-cancel").addEventListener("click", async () => {
    const said = document.getElementById("job-said");
    try {
      const answer = await api(`/jobs/${encodeURIComponent(state.job)}/cancel`, {method: "POST"});
      said.textContent = `cancelling (${clean(answer.state)})`;
    } catch (err) { said.textContent = clean(err.message); }
  });
  document.getElementById("service-scale").addEventListener("click", async () => {
    const said = document.getElementById("service-said");
    const replicas = Number(document.getElementById("service-wanted").value);
    try {
      const answer = await api(`/services/${encodeURIComponent(state.service)}/scale`, {
        method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({replicas})});
      said.textContent = `scaling to ${Number(answer.replicas)}`;
    } catch (err) { said.textContent = clean(err.message); }
  });
  connect();
});
