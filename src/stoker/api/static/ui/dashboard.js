// The stoker dashboard: polls the server's own API with the admin token this tab holds.
// No framework, no build step, no request to anywhere but this server.
"use strict";

(function () {
  const TOKEN_KEY = "stoker.token";
  const params = new URLSearchParams(location.search);
  const POLL_MS = Math.max(500, Number(params.get("interval_ms")) || 2000);
  const HOUR_S = 3600;
  const SERIES = [
    ["desired_warm", "--target"],
    ["warm", "--warm"],
    ["demand", "--demand"],
    ["hot", "--hot"],
  ];
  // One color per revision of a rollout, in the order the samples name them.
  const REVISION_COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#be123c"];

  const $ = (id) => document.getElementById(id);
  let history = {};        // pool -> samples, oldest first
  let lastSampleAt = 0;    // newest sample's `at`, for ?since=
  let livePools = [];      // the last GET /v1/pools
  let serverSkewS = 0;     // server clock - this browser's clock, seconds
  let timer = null;

  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

  class ApiError extends Error {
    constructor(status, detail) { super(detail); this.status = status; }
  }

  async function api(path) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    const response = await fetch(path, { headers, cache: "no-store" });
    const date = response.headers.get("date");
    if (date) serverSkewS = (Date.parse(date) - Date.now()) / 1000;
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      throw new ApiError(response.status, (body && body.detail) || response.statusText);
    }
    return body;
  }

  function nowS() { return Date.now() / 1000 + serverSkewS; }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  function fill(tableId, items, render) {
    const body = $(tableId).querySelector("tbody");
    const rows = items.map((item) => {
      const tr = document.createElement("tr");
      render(tr, item);
      return tr;
    });
    body.replaceChildren(...rows);
  }

  function age(iso) {
    if (!iso) return "";
    return duration(nowS() - Date.parse(iso) / 1000);
  }

  function duration(s) {
    if (!isFinite(s)) return "";
    const sign = s < 0 ? "-" : "";
    s = Math.abs(Math.round(s));
    if (s < 60) return sign + s + "s";
    if (s < 3600) return sign + Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    return sign + Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }

  function short(id) { return id && id.length > 14 ? id.slice(0, 14) + "…" : id; }

  function renderPools(pools) {
    fill("pools", pools, (tr, p) => {
      tr.dataset.pool = p.name;
      const c = p.counts || {};
      cell(tr, p.name);
      cell(tr, p.revision);
      for (const v of [p.warm_target, p.desired_warm, p.demand, p.cap, c.spawning, c.warm,
        c.reserved, c.activating, c.hot, c.hot_idle, c.draining]) {
        cell(tr, v === undefined ? 0 : v, "num");
      }
      if (p.sizing_stale) {
        // No replica has sized the pool for three janitor intervals: the last figures.
        const desired = tr.children[3];
        desired.textContent += " (stale " + duration(p.sizing_age_s) + ")";
        desired.title = "as " + p.sized_by + " last sized it; no replica sizes the pool now";
      }
      const spawns = p.spawn_failing
        ? "failing ×" + p.spawn_failures + (p.last_spawn_error ? ": " + p.last_spawn_error : "")
        : "ok";
      cell(tr, spawns, p.spawn_failing ? "failing detail" : "");
    });
    const select = $("chart-pool");
    const names = pools.map((p) => p.name);
    const current = [...select.options].map((o) => o.value);
    if (names.join("\n") !== current.join("\n")) {
      const chosen = select.value;
      select.replaceChildren(...names.map((n) => new Option(n, n)));
      if (names.includes(chosen)) select.value = chosen;
    }
  }

  function renderWorkers(workers) {
    $("workers-count").textContent = "(" + workers.length + ")";
    fill("workers", workers, (tr, w) => {
      tr.dataset.worker = w.id;
      tr.dataset.state = w.state;
      cell(tr, w.id);
      cell(tr, w.pool);
      cell(tr, w.state, "state-" + w.state);
      cell(tr, w.org);
      cell(tr, age(w.created_at), "num");
      cell(tr, w.revision);
      cell(tr, short(w.claim_id));
      cell(tr, w.endpoint);
    });
  }

  function renderClaims(claims) {
    $("claims-count").textContent = "(" + claims.length + ")";
    fill("claims", claims, (tr, c) => {
      tr.dataset.claim = c.id;
      cell(tr, short(c.id)).title = c.id;
      cell(tr, c.pool);
      cell(tr, c.org);
      cell(tr, c.worker.id);
      cell(tr, c.source);
      cell(tr, age(c.created_at), "num");
      cell(tr, duration(Date.parse(c.expires_at) / 1000 - nowS()), "num");
    });
  }

  function renderEvents(events) {
    fill("events", events, (tr, e) => {
      tr.dataset.kind = e.kind;
      if (e.kind.endsWith("_failed")) tr.className = "failure";
      cell(tr, new Date(e.at).toLocaleTimeString());
      cell(tr, e.kind);
      cell(tr, e.pool);
      cell(tr, e.worker);
      cell(tr, e.reason);
      cell(tr, e.detail, "detail");
    });
  }

  function mergeHistory(answer) {
    const horizon = answer.now - HOUR_S;
    for (const [pool, samples] of Object.entries(answer.pools)) {
      const kept = (history[pool] || []).concat(samples).filter((s) => s.at >= horizon);
      history[pool] = kept;
      for (const s of samples) lastSampleAt = Math.max(lastSampleAt, s.at);
    }
  }

  // A chart of the last hour on `canvas`: each series is [value of a sample, color,
  // dashed]; `max` fixes the scale (else the largest value), `label` formats its ticks,
  // `shaded` marks the stretches from the samples it holds true of (to the next sample).
  function plot(canvas, points, series, opts) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 900;
    const height = canvas.clientHeight || 240;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const end = nowS();
    const left = 36, right = 8, top = 8, bottom = 22;
    const plotW = width - left - right, plotH = height - top - bottom;
    let max = opts.max || 1;
    if (!opts.max) {
      for (const s of points) for (const [value] of series) max = Math.max(max, value(s));
      max = Math.ceil(max * 1.15);
    }
    const label = opts.label || String;
    const x = (at) => left + ((at - (end - HOUR_S)) / HOUR_S) * plotW;
    const y = (v) => top + plotH - (v / max) * plotH;
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = style.getPropertyValue("--muted");
    g.strokeStyle = style.getPropertyValue("--line");
    g.lineWidth = 1;
    const step = opts.step || Math.max(1, Math.ceil(max / 5));
    g.textAlign = "left";
    for (let v = 0; v <= max + 1e-9; v += step) {
      g.beginPath(); g.moveTo(left, y(v)); g.lineTo(width - right, y(v)); g.stroke();
      g.fillText(label(v), 4, y(v) + 4);
    }
    for (let m = 60; m >= 0; m -= 10) {
      const at = end - m * 60;
      g.textAlign = m === 60 ? "left" : m === 0 ? "right" : "center";
      g.fillText(m === 0 ? "now" : "-" + m + "m", x(at), height - 6);
    }
    let shadedN = 0;
    if (opts.shaded) {
      g.fillStyle = style.getPropertyValue("--line");
      points.forEach((s, i) => {
        if (!opts.shaded(s)) return;
        const from = x(Math.max(s.at, end - HOUR_S));
        const to = i + 1 < points.length ? x(points[i + 1].at) : width - right;
        g.fillRect(from, top, Math.max(1, to - from), plotH);
        shadedN += 1;
      });
    }
    canvas.dataset.shaded = String(shadedN);
    for (const [value, color, dashed] of series) {
      g.strokeStyle = color.startsWith("--") ? style.getPropertyValue(color) : color;
      g.lineWidth = 2;
      g.setLineDash(dashed ? [5, 4] : []);
      g.beginPath();
      points.forEach((s, i) => {
        const px = x(Math.max(s.at, end - HOUR_S)), py = y(value(s));
        if (i === 0) g.moveTo(px, py);
        else { g.lineTo(px, y(value(points[i - 1]))); g.lineTo(px, py); }
      });
      g.stroke();
    }
    g.setLineDash([]);
    canvas.dataset.points = String(points.length);
  }

  function drawChart() {
    const pool = $("chart-pool").value;
    const points = (history[pool] || []).slice();
    const live = livePools.find((p) => p.name === pool);
    if (live) {
      const c = live.counts || {};
      const revisions = (live.revisions || []).map((r) => ({ revision: r.revision,
        share: r.share / 100, warm: (r.counts || {}).warm || 0, busy: busy(r.counts || {}) }));
      points.push({ at: nowS(), desired_warm: live.desired_warm, demand: live.demand,
        warm: c.warm || 0, hot: c.hot || 0, revisions, sizing_stale: !!live.sizing_stale });
    }
    // A stale sizing (no replica has sized the pool lately) is shaded: its desired warm
    // and demand are the last ones published, not decided now.
    $("chart-note").textContent = points.length <= 1 ? "(collecting samples)"
      : live && live.sizing_stale ? "(shaded: desired and demand stale, no replica sizes "
        + "this pool)" : points.some((s) => s.sizing_stale) ? "(shaded: sizing was stale)" : "";
    plot($("chart"), points, SERIES.map(([key, color]) => [(s) => s[key] || 0, color]),
      { shaded: (s) => s.sizing_stale });
    drawRollout(pool, live, points);
  }

  // The ledger (docs/warmth.md): worker-hours per hour of the chosen pool as stacked bars,
  // and a row per hour with what it cost and bought. Read at most every LEDGER_MS.
  const LEDGER_MS = 15000;
  const LEDGER_STATES = [
    ["warm_s", "--warm"], ["hot_s", "--hot"], ["hot_idle_s", "#d97706"],
    ["starting_s", "#9ca3af"], ["draining_s", "#4b5563"], ["placeholder_s", "#9333ea"],
  ];
  let ledger = null;       // the last GET /v1/pools/{name}/ledger
  let ledgerAt = 0;        // when it was read (this browser's ms)

  async function refreshLedger() {
    const pool = $("chart-pool").value;
    if (!pool) return;
    if (ledger && ledger.pool === pool && Date.now() - ledgerAt < LEDGER_MS) return;
    ledger = await api("/v1/pools/" + encodeURIComponent(pool) + "/ledger?since=24h");
    ledgerAt = Date.now();
    drawLedger();
  }

  function money(v) {
    return v === null || v === undefined ? "-" : v.toFixed(Math.abs(v) >= 10 ? 2 : 4);
  }
  function hours(s) { return (s / HOUR_S).toFixed(2); }

  function drawLedger() {
    if (!ledger) return;
    $("ledger-pool").textContent = "(" + ledger.pool + ")";
    const rows = ledger.rows.slice();
    $("ledger-note").textContent = rows.length ? "" : "(nothing counted yet)";
    fill("ledger", rows.concat([Object.assign({ total: true }, ledger.total)]), (tr, r) => {
      cell(tr, r.total ? "total" : new Date(r.hour * 1000).toISOString().slice(0, 13) + ":00Z");
      cell(tr, hours(r.warm_s)); cell(tr, hours(r.hot_s)); cell(tr, hours(r.hot_idle_s));
      cell(tr, hours(r.placeholder_s));
      cell(tr, r.claims_reuse + " / " + r.claims_warm + " / " + r.claims_cold);
      cell(tr, r.failed); cell(tr, money(r.mean_ready_s));
      cell(tr, money(r.idle_warm_cost)); cell(tr, money(r.idle_parked_cost));
      cell(tr, money(r.headroom_cost)); cell(tr, money(r.cold_start_s_avoided));
    });
    const canvas = $("ledger-chart");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 900, height = canvas.clientHeight || 160;
    canvas.width = width * ratio; canvas.height = height * ratio;
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const color = (c) => c.startsWith("--") ? style.getPropertyValue(c) : c;
    const left = 36, bottom = 18, top = 6, plotH = height - top - bottom;
    // The window touches 25 hours (24 when it ends on the hour): the first and the last in
    // part, each a bar of its own.
    const first = Math.floor(ledger.since / HOUR_S) * HOUR_S;
    const slots = Math.max(1, Math.ceil(ledger.until / HOUR_S) - first / HOUR_S);
    const barW = (width - left - 8) / slots;
    let max = 1;
    for (const r of rows) {
      max = Math.max(max, LEDGER_STATES.reduce((n, [k]) => n + (r[k] || 0), 0) / HOUR_S);
    }
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = style.getPropertyValue("--muted");
    g.fillText(max.toFixed(1) + " h", 2, top + 10);
    g.fillText("-24h", left, height - 4);
    g.textAlign = "right"; g.fillText("now", width - 8, height - 4); g.textAlign = "left";
    for (const r of rows) {
      const i = Math.round((r.hour - first) / HOUR_S);
      let y = top + plotH;
      for (const [key, c] of LEDGER_STATES) {
        const h = ((r[key] || 0) / HOUR_S / max) * plotH;
        g.fillStyle = color(c);
        g.fillRect(left + Math.max(0, i) * barW + 1, y - h, barW - 2, h);
        y -= h;
      }
    }
    canvas.dataset.bars = String(rows.length);
  }

  function busy(counts) {
    return ["reserved", "activating", "hot", "hot_idle"].reduce((n, k) => n + (counts[k] || 0), 0);
  }

  // The rollout view: the pool's rollout (its step and why it waits), and each revision's
  // share and workers over the last hour. Shown while a rollout is under way or the hour
  // saw more than one revision.
  function drawRollout(pool, live, points) {
    const rollout = live && live.rollout;
    const names = [];
    for (const s of points) {
      for (const r of s.revisions || []) if (!names.includes(r.revision)) names.push(r.revision);
    }
    const section = $("rollout");
    section.hidden = !rollout && names.length < 2;
    if (section.hidden) return;
    $("rollout-pool").textContent = "(" + pool + ")";
    $("rollout-line").textContent = rollout ? describeRollout(rollout) : "none under way";
    $("rollout-waits").textContent = rollout && live.rollout_waits
      ? "waits: " + live.rollout_waits : "";
    const color = (name) => REVISION_COLORS[names.indexOf(name) % REVISION_COLORS.length];
    const of = (name, key) => (s) => {
      const r = (s.revisions || []).find((x) => x.revision === name);
      return r ? r[key] : 0;
    };
    plot($("share-chart"), points, names.map((n) => [of(n, "share"), color(n)]),
      { max: 1, step: 0.25, label: (v) => Math.round(v * 100) + "%" });
    const workers = [];
    for (const n of names) {
      workers.push([of(n, "warm"), color(n)]);
      workers.push([of(n, "busy"), color(n), true]);
    }
    plot($("revision-chart"), points, workers, {});
    const legend = $("rollout-legend");
    legend.replaceChildren(...names.map((n) => {
      const span = document.createElement("span");
      const key = document.createElement("span");
      key.className = "key";
      key.style.background = color(n);
      span.append(key, n + (live && n === live.revision ? " (stable)" : ""));
      return span;
    }));
  }

  function describeRollout(r) {
    const steps = (r.strategy && r.strategy.steps) || [];
    let where = steps.length ? "step " + (r.step + 1) + " of " + steps.length + ", " : "";
    if (steps.length && r.share === 0) where = "preparing step 1 (" + steps[0] + " %), ";
    const reason = r.reason ? " (" + r.reason + ")" : "";
    return "rollout " + r.id + ": " + r.state + reason + ", " + where + r.share +
      " % of new claims to " + r.revision + " (from " + r.base_revision + ")";
  }

  function setStatus(text, error) {
    const el = $("status");
    el.textContent = text;
    el.classList.toggle("error", !!error);
  }

  async function poll() {
    try {
      const [pools, workers, claims, events, hist] = await Promise.all([
        api("/v1/pools"),
        api("/v1/workers?limit=500"),
        api("/v1/claims?limit=500"),
        api("/v1/events?limit=100"),
        api("/v1/history" + (lastSampleAt ? "?since=" + lastSampleAt : "")),
      ]);
      livePools = pools.pools;
      renderPools(livePools);
      renderWorkers(workers.workers);
      renderClaims(claims.claims);
      renderEvents(events.events);
      mergeHistory(hist);
      drawChart();
      await refreshLedger();
      document.body.dataset.loaded = "true";
      setStatus("updated " + new Date().toLocaleTimeString() + " · replica " + events.replica);
    } catch (e) {
      if (e.status === 401) {
        setStatus("this server needs an admin token: enter it above", true);
        $("token").focus();
      } else if (e.status === 403) {
        setStatus("refused: " + e.message, true);
      } else {
        setStatus("cannot reach the server: " + e.message + " (retrying)", true);
      }
    }
  }

  function restart() {
    if (timer) clearInterval(timer);
    history = {}; lastSampleAt = 0;
    poll();
    timer = setInterval(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("token").value = "";
      restart();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      restart();
    });
    $("chart-pool").addEventListener("change", () => {
      drawChart();
      ledger = null;
      refreshLedger().catch(() => {});
    });
    window.addEventListener("resize", drawChart);
    restart();
  });
})();
