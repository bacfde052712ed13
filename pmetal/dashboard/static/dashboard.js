// pmetal dashboard: renders the node's /api/cluster snapshot, live.
//
// Updates come as server-sent events (/api/events, one "snapshot" event per
// change); where EventSource is missing or keeps failing, the page polls
// /api/cluster every second instead. No framework, no build step: the DOM is
// built with textContent (never innerHTML of data), the topology is an SVG
// drawn here.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const SSE_FAILURES_BEFORE_POLLING = 3;

let lastUpdate = 0;

// ------------------------------------------------------------------ helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function s(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) el.setAttribute(k, v);
  }
  if (text !== undefined) el.textContent = text;
  return el;
}

const short = (id) => (id || "").slice(0, 8);

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

function rate(bps) {
  if (bps === null || bps === undefined || Number.isNaN(bps)) return "-";
  if (bps === 0) return "0 B/s";
  const units = ["B/s", "KB/s", "MB/s", "GB/s"];
  let i = 0;
  while (bps >= 1000 && i < units.length - 1) { bps /= 1000; i++; }
  return `${bps.toFixed(bps < 10 ? 2 : bps < 100 ? 1 : 0)} ${units[i]}`;
}

function ms(x) {
  if (x === null || x === undefined) return "-";
  return x < 1 ? `${x.toFixed(3)} ms` : x < 100 ? `${x.toFixed(2)} ms` : `${x.toFixed(0)} ms`;
}

function seconds(x) {
  if (!x) return "-";
  return x < 1 ? ms(x * 1000) : `${x.toFixed(2)} s`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], {hour12: false});
}

function empty(text) { return h("div", {class: "empty"}, text); }

function table(headers, rows) {
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map(([name, cls]) => h("th", {class: cls}, name)))),
    h("tbody", {}, rows));
}

function replace(id, ...children) {
  const el = document.getElementById(id);
  el.replaceChildren(...children.flat(Infinity));
  return el;
}

// ----------------------------------------------------------------- topology

function layout(machines, width, height) {
  const pos = {};
  const n = machines.length;
  const cx = width / 2, cy = height / 2 - 4;
  const r = Math.min(width, height) / 2 - 85;
  machines.forEach((m, i) => {
    if (n === 1) { pos[m.node_id] = [cx, cy]; return; }
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / n;
    pos[m.node_id] = [cx + r * 1.35 * Math.cos(angle), cy + r * Math.sin(angle)];
  });
  return pos;
}

function drawTopology(snap) {
  const svg = document.getElementById("topology");
  const [w, h_] = [760, 420];
  const pos = layout(snap.machines, w, h_);
  const parts = [];
  for (const link of snap.links) {
    const a = pos[link.a], b = pos[link.b];
    if (!a || !b) continue;
    const g = s("g", {class: "link-group", "data-a": link.a, "data-b": link.b});
    g.append(s("line", {class: `link ${link.health}`, x1: a[0], y1: a[1], x2: b[0], y2: b[1]}));
    const label = [link.latency_ms !== null ? ms(link.latency_ms) : null,
                   link.bandwidth_bps ? rate(link.bandwidth_bps) : null]
      .filter(Boolean).join(" · ");
    if (label) {
      g.append(s("text", {class: "link-label", x: (a[0] + b[0]) / 2, y: (a[1] + b[1]) / 2 - 6,
                          "text-anchor": "middle"}, label));
    }
    parts.push(g);
  }
  for (const m of snap.machines) {
    const [x, y] = pos[m.node_id];
    const cls = ["machine", m.health, m.master ? "master" : "", m.self ? "self" : ""]
      .filter(Boolean).join(" ");
    const g = s("g", {class: cls, "data-node": m.node_id, "data-health": m.health,
                      transform: `translate(${x},${y})`});
    g.append(s("title", {}, `${m.node_id}\n${m.address}\nhealth: ${m.health}`));
    if (m.master) g.append(s("circle", {class: "crown", r: 42}));
    g.append(s("circle", {class: `body h-${m.health}`, r: 34}));
    g.append(s("text", {class: "inside", y: 4}, short(m.node_id)));
    g.append(s("text", {class: "sub", y: 52}, (m.address || "").replace("tcp://", "")));
    const sub = [m.self ? "this node" : m.health, m.rtt_ms !== null && m.rtt_ms !== undefined
      ? `rtt ${ms(m.rtt_ms)}` : null].filter(Boolean).join(" · ");
    g.append(s("text", {class: "sub", y: 66}, sub));
    if (m.master) g.append(s("text", {class: "master-label", y: -48}, "\u2605 master"));
    parts.push(g);
  }
  svg.replaceChildren(...parts);
}

// ----------------------------------------------------------------- machines

function machineCard(m, snap) {
  const p = m.profile || {};
  const used = p.memory_total ? p.memory_total - (p.memory_free || 0) : null;
  const res = Object.entries(m.resources || {}).map(([k, v]) => {
    const free = m.available && k in m.available ? m.available[k] : null;
    const fmt = (x) => (k === "memory" || k === "object_store_memory" ? bytes(x)
      : String(+Number(x).toFixed(2)));
    return `${k} ${free === null ? "" : `${fmt(free)}/`}${fmt(v)}`;
  }).join(", ");
  const rows = [
    ["address", (m.address || "").replace("tcp://", "")],
    ["health", m.self ? "this node" : m.health],
    ["round trip", m.self ? "-" : ms(m.rtt_ms)],
    ["chip", p.chip || "-"],
    ["cores", p.cores || "-"],
    ["memory", p.memory_total ? h("span", {}, `${bytes(used)} used of ${bytes(p.memory_total)}`,
      h("div", {class: "bar"}, h("span", {style: `width:${Math.round(100 * used / p.memory_total)}%`})))
      : "-"],
    ["resources", res ? `${res} (free/total)` : "-"],
    ["actors", m.actors === undefined || m.actors === null ? "-" : `${m.actors} alive` +
      (m.queued ? `, ${m.queued} queued` : "")],
  ];
  if (m.self) {
    rows.push(["workers", m.workers]);
    rows.push(["node process", bytes(m.node_rss) + " resident"]);
    for (const p of (snap.telemetry && snap.telemetry.processes) || []) {
      rows.push([`${p.role} workers`, `${p.processes} alive, ${bytes(p.resident_bytes)} ` +
        `resident, ${p.cpu_seconds.toFixed(1)} s CPU`]);
    }
  }
  const card = h("div", {class: `card ${m.health}`, dataset: {node: m.node_id, health: m.health}},
    h("h3", {}, h("code", {}, short(m.node_id)),
      h("span", {class: `badge ${m.health}`}, m.self ? "this node" : m.health),
      m.master ? h("span", {class: "badge master"}, "\u2605 master") : null),
    h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])));
  // What it hosts: this node's own, and what each member last answered.
  if (Array.isArray(m.actor_list)) {
    const actors = m.actor_list.filter((a) => a.state !== "dead");
    card.append(h("div", {class: "muted small"}, "actors here"),
      actors.length ? h("ul", {class: "hosted-actors"}, actors.map((a) => h("li",
        {dataset: {actor: a.actor_id, state: a.state}},
        `${a.name || a.class_name || short(a.actor_id)} `,
        h("span", {class: `badge ${a.state}`}, a.state),
        a.restarts ? h("span", {class: "muted small"}, ` restarted ${a.restarts}\u00d7`) : null)))
        : empty("no actor on this machine"));
  }
  if (Array.isArray(m.stages)) {
    card.append(h("div", {class: "muted small"}, "pipeline stages here"),
      m.stages.length ? h("ul", {}, m.stages.map((st) => h("li", {},
        `${st.pipeline}: stage ${st.index}` +
        (st.seconds_per_step ? ` (${seconds(st.seconds_per_step)} per step)` : ""))))
        : empty("no pipeline stage has run on this machine"));
  }
  return card;
}

// -------------------------------------------------------------------- views

function renderActors(snap) {
  if (!snap.actors.length) return replace("actor-table", empty("no actor has run on this node"));
  const order = {alive: 0, restarting: 1, pending: 2, dead: 3};
  const rows = [...snap.actors].sort((a, b) => (order[a.state] ?? 9) - (order[b.state] ?? 9))
    .map((a) => h("tr", {dataset: {actor: a.actor_id, state: a.state}},
      h("td", {}, a.name || a.class_name || "-"),
      h("td", {}, a.class_name || "-"),
      h("td", {}, h("code", {title: a.actor_id}, (a.actor_id || "").slice(-8))),
      h("td", {}, h("span", {class: `badge ${a.state}`}, a.state)),
      h("td", {class: "num"}, a.restarts),
      h("td", {class: "num"}, a.restarts_left < 0 ? "\u221e" : a.restarts_left),
      h("td", {class: "num"}, a.pid ?? "-"),
      h("td", {class: "error"}, a.last_error || "")));
  replace("actor-table", table([["name"], ["class"], ["id"], ["state"], ["restarts", "num"],
    ["restarts left", "num"], ["pid", "num"], ["last error"]], rows));
}

// Rates between two telemetry readings: per key, the last reading and the
// last rate, so a snapshot that brings no newer reading keeps the rate shown.
const readings = new Map();

function since(kind, key, value, at) {
  const id = `${kind}:${key}`;
  const last = readings.get(id);
  if (!last) {
    readings.set(id, {value, at, rate: null});
    return null;
  }
  if (at > last.at) {
    const rate = Math.max(0, value - last.value) / (at - last.at);
    readings.set(id, {value, at, rate});
    return rate;
  }
  return last.rate;
}

function renderPipelines(snap) {
  const tele = snap.telemetry;
  if (!tele) {
    return replace("pipeline-list", empty("no pipeline has run on this node (this node " +
      "records no pipeline statistics)"));
  }
  const list = tele.pipelines || [];
  if (!list.length) return replace("pipeline-list", empty("no pipeline has run on this node"));
  replace("pipeline-list", list.map((p) => {
    const live = since("tokens", p.name, p.tokens, tele.at);
    const avg = p.seconds ? p.tokens / p.seconds : null;
    const rows = p.stage_rows || [];
    const perStep = (x, n) => (n ? seconds(x / n) : "-");
    const stages = rows.map((st) => h("tr", {dataset: {stage: st.index}},
      h("td", {}, st.index), h("td", {class: "num"}, st.steps),
      h("td", {class: "num"}, seconds(st.seconds_per_step)),
      h("td", {class: "num"}, st.steps ? bytes(st.hop_bytes / st.steps) : "-"),
      h("td", {class: "num"}, perStep(st.hop_seconds || 0, st.steps))));
    // With every stage here, a step's round trip less the stages' compute is
    // what its hops cost (flight and hand-over together).
    const all = rows.length === p.stages && p.steps > 0;
    const hops = all ? (p.seconds - rows.reduce((t, st) => t + st.seconds, 0)) / p.steps : null;
    return h("div", {class: "pipeline", dataset: {pipeline: p.name}},
      h("h3", {}, p.name, " ", h("span", {class: "muted small"}, `${p.stages} stages`)),
      h("p", {class: "pipeline-summary"},
        `tokens ${p.tokens} · tokens/s now ${live === null ? "-" : live.toFixed(1)} · ` +
        `average ${avg === null ? "-" : avg.toFixed(1)} · time per step (round the ring) ` +
        `${seconds(p.seconds_per_step)}` +
        (hops !== null && hops > 0 ? ` · in hops ${seconds(hops)} per step` : "") +
        ` · sent ${bytes(p.bytes_sent)} · received ${bytes(p.bytes_received)}`),
      stages.length ? table([["stage here"], ["steps", "num"], ["compute per step", "num"],
        ["hop bytes per step", "num"], ["hop hand-over per step", "num"]], stages)
        : empty("no stage of it runs on this node"));
  }));
}

function renderCollectives(snap) {
  const tele = snap.telemetry;
  if (!tele) {
    return replace("collective-table", empty("no collective has run on this node (this node " +
      "records no collective statistics)"));
  }
  const list = tele.collectives || [];
  if (!list.length) return replace("collective-table", empty("no collective has run on this node"));
  replace("collective-table", table([["group"], ["strategy"], ["operations", "num"],
    ["bytes", "num"], ["throughput", "num"], ["now", "num"]], list.map((c) => h("tr",
    {dataset: {group: c.group}},
    h("td", {}, c.group), h("td", {}, c.strategy), h("td", {class: "num"}, c.operations),
    h("td", {class: "num"}, bytes(c.bytes)),
    h("td", {class: "num"}, c.seconds ? rate(c.bytes / c.seconds) : "-"),
    h("td", {class: "num"}, rate(since("bytes", `${c.group}/${c.strategy}`, c.bytes, tele.at)))))));
}

function renderEvents(snap) {
  if (!snap.events.length) return replace("event-log", empty("nothing has happened yet"));
  replace("event-log", table([["time"], ["event"], ["node"], ["detail"], ["times", "num"]],
    snap.events.map((e) => h("tr", {dataset: {kind: e.kind}},
      h("td", {}, clock(e.at)), h("td", {}, h("span", {class: `badge ${e.kind}`}, e.kind)),
      h("td", {}, e.node ? h("code", {}, short(e.node)) : "-"),
      h("td", {}, e.detail), h("td", {class: "num"}, e.count > 1 ? `\u00d7${e.count}` : "")))));
}

function render(snap) {
  lastUpdate = Date.now();
  document.getElementById("namespace").textContent = `namespace ${snap.namespace}`;
  const alive = snap.machines.filter((m) => m.health !== "dead" && m.health !== "left").length;
  document.getElementById("sum-machines").textContent =
    `${alive} alive` + (alive < snap.machines.length ? ` of ${snap.machines.length}` : "");
  document.getElementById("sum-master").textContent = snap.master ? short(snap.master) : "none";
  document.getElementById("sum-term").textContent = snap.term;
  document.getElementById("sum-epoch").textContent = snap.epoch;
  document.getElementById("sum-self").textContent = `${short(snap.node_id)} (${snap.role})`;
  document.getElementById("sum-updated").textContent = clock(snap.at);
  drawTopology(snap);
  replace("machine-cards", snap.machines.map((m) => machineCard(m, snap)));
  renderActors(snap);
  renderPipelines(snap);
  renderCollectives(snap);
  renderEvents(snap);
}

// ------------------------------------------------------------------ updates

function setMode(mode, text) {
  const el = document.getElementById("conn");
  el.dataset.mode = mode;
  el.textContent = text || mode;
}

function poll() {
  setMode("polling");
  const tick = async () => {
    try {
      const r = await fetch("/api/cluster", {credentials: "same-origin", cache: "no-store"});
      if (r.status === 401) { window.location.assign("/login"); return; }
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      render(await r.json());
      setMode("polling");
    } catch (err) {
      setMode("offline", `offline since ${new Date(lastUpdate || Date.now()).toLocaleTimeString()}`);
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}

function stream() {
  if (!window.EventSource) return poll();
  let failures = 0;
  const source = new EventSource("/api/events");
  source.addEventListener("snapshot", (ev) => {
    failures = 0;
    setMode("live");
    render(JSON.parse(ev.data));
  });
  source.onerror = () => {
    failures += 1;
    // CLOSED: the server answered without a stream (an old node, a proxy
    // that refuses it); EventSource will not retry, so poll at once.
    if (source.readyState === EventSource.CLOSED || failures >= SSE_FAILURES_BEFORE_POLLING) {
      source.close();
      poll();
    } else {
      setMode("offline", "reconnecting");
    }
  };
}

document.addEventListener("DOMContentLoaded", stream);
