// kneegate's live page. Once a second it reads /kneegate/status (the upstreams, their
// controllers' learned curves) and /kneegate/history (a ring of one point a second) and
// draws them as inline SVG: no library, no build step, nothing from outside this gateway.
// Every value drawn is also written to the DOM (data-* attributes), so a test can read what
// the page shows: article.upstream[data-upstream][data-limit][data-in-flight][data-knee],
// g.knee-marker[data-knee][data-x], line.limit-line[data-limit][data-x], rect.region[...],
// and where the engines serve different models (several pools) one row per pool:
// tr.pool[data-model][data-upstreams][data-limits][data-limit][data-in-flight][data-queue][data-ratio].
//
// The admin token, when the gateway has one, never goes into a URL the server sees: it is
// taken from the fragment (#token=..., never sent) or from the form, kept in this tab's
// sessionStorage and sent as `Authorization: Bearer` on each fetch.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const PERIOD_MS = 1000;
  const TOKEN_KEY = "kneegate-admin-token";
  const PALETTE = ["#1f6feb", "#1a7f37", "#bc4c00", "#8250df", "#d1242f", "#0a7d8c",
    "#bf3989", "#6e7781"];
  const REGIONS = { low: "#e4e7ec", linear: "#d8f0d8", plateau: "#fff2c0", decline: "#f8d0d0" };

  let token = takeToken();
  let points = []; // history, oldest first
  let ringSize = 600;
  let renders = 0;

  class Unauthorized extends Error {}

  // --- data --------------------------------------------------------------------------------

  function takeToken() {
    const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      window.history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function get(path) {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const r = await fetch(path, { headers: headers, cache: "no-store" });
    if (r.status === 401) throw new Unauthorized(path);
    if (!r.ok) throw new Error(path + " answered HTTP " + r.status);
    return r.json();
  }

  async function poll() {
    try {
      const last = points.length ? points[points.length - 1].t : null;
      const [status, hist] = await Promise.all([
        get("status"), get(last === null ? "history" : "history?since=" + last)]);
      ringSize = hist.size;
      if (last !== null && hist.now < last) {
        points = []; // another process answers now (a restart): start again
      } else {
        points = points.concat(hist.points).slice(-ringSize);
      }
      render(status, hist.now);
    } catch (e) {
      if (e instanceof Unauthorized) {
        askToken(token ? "the token was refused" : "this gateway has an admin_token");
        return; // polling resumes once a token is given
      }
      text(byId("summary"), "no answer from the gateway: " + e.message).className = "bad";
    }
    setTimeout(poll, PERIOD_MS);
  }

  function askToken(why) {
    const form = byId("login");
    form.hidden = false;
    text(byId("login-why"), why);
    byId("token").focus();
  }

  byId("login").addEventListener("submit", function (ev) {
    ev.preventDefault();
    token = byId("token").value;
    sessionStorage.setItem(TOKEN_KEY, token);
    byId("token").value = "";
    byId("login").hidden = true;
    poll();
  });

  // --- the page ----------------------------------------------------------------------------

  function render(status, now) {
    const ups = status.upstreams;
    const usable = ups.filter(u => u.usable).length;
    const s = text(byId("summary"), ups.length + " upstream" + (ups.length === 1 ? "" : "s") +
      " (" + usable + " usable) · queued " + status.queue_total + " · " +
      fmt(status.completion_rate) + " completions/s");
    s.className = usable ? "" : "bad";
    const pools = status.pools || [];
    const modelsOf = new Map();
    if (pools.length > 1) {
      s.append(" · " + pools.length + " pools by model");
      for (const p of pools) for (const n of p.upstreams) modelsOf.set(n, p.models);
    }
    renderPools(pools, ups);
    const section = byId("upstreams");
    const seen = new Set();
    for (const u of ups) {
      seen.add(u.name);
      renderUpstream(section, u, now, modelsOf.get(u.name));
    }
    for (const el of Array.from(section.children)) {
      if (!seen.has(el.dataset.upstream)) el.remove();
    }
    renderGateway(now);
    renders += 1;
    const upd = byId("updated");
    upd.dataset.renders = String(renders);
    text(upd, "updated " + new Date().toLocaleTimeString());
  }

  // Engines serving different models are pools, each admitted and queued on its own: one
  // row per pool (its models, upstreams and their limits, in flight, queued, demand ratio).
  // One pool, the usual case: the section stays hidden and the page is as it always was.
  function renderPools(pools, ups) {
    const sec = byId("pools");
    const body = sec.querySelector("tbody");
    body.replaceChildren();
    sec.hidden = pools.length < 2;
    if (sec.hidden) return;
    const byName = new Map(ups.map(u => [u.name, u]));
    for (const p of pools) {
      const members = p.upstreams.map(n => byName.get(n)).filter(Boolean);
      const limits = members.map(u => u.limit);
      const limit = limits.reduce((a, b) => a + b, 0);
      const inFlight = members.reduce((a, u) => a + u.in_flight, 0);
      const d = p.demand;
      const tr = el("tr", { class: "pool", "data-model": p.models.join(","),
        "data-upstreams": p.upstreams.join(","), "data-limits": limits.join(","),
        "data-limit": limit, "data-in-flight": inFlight,
        "data-queue": p.queue == null ? "" : p.queue,
        "data-ratio": d ? d.ratio : "" }, body, "html");
      const cell = (s, cls) => { const td = text(el("td", {}, tr, "html"), s);
        if (cls) td.className = cls; return td; };
      cell(p.models.length ? p.models.join(", ") : "models not read yet");
      const names = cell("");
      members.forEach((u, i) => {
        if (i) names.append(" · ");
        const span = text(el("span", {}, names, "html"), u.name);
        if (!u.usable) span.className = "bad";
      });
      cell(limits.length > 1 ? limit + " (" + limits.join(" + ") + ")" : String(limit), "num");
      cell(String(inFlight), "num");
      cell(p.queue == null ? "–" : String(p.queue), "num");
      cell(d ? fmt(d.ratio) + " → " + d.suggested_replicas + " engine" +
        (d.suggested_replicas === 1 ? "" : "s") : "not measured yet",
        d && d.ratio > 1 ? "num bad" : "num");
    }
  }

  function renderUpstream(section, u, now, models) {
    let art = section.querySelector('article[data-upstream="' + CSS.escape(u.name) + '"]');
    if (!art) {
      art = el("article", { class: "upstream", "data-upstream": u.name }, section, "html");
    }
    const ctl = u.controller;
    art.dataset.limit = String(u.limit);
    art.dataset.inFlight = String(u.in_flight);
    art.dataset.knee = ctl.knee_estimate == null ? "" : String(ctl.knee_estimate);
    art.dataset.controller = ctl.name;
    art.replaceChildren();
    const h = el("h2", {}, art, "html");
    h.append(u.name + " ");
    const state = [ctl.name, u.usable ? "usable" : "NOT usable", "scrape " + u.scrape];
    if (ctl.curve_of) state.push("curve of the " + ctl.curve_of);
    if (models) state.unshift(models.length ? models.join(", ") : "models not read yet");
    art.dataset.model = models ? models.join(",") : "";
    text(el("small", {}, h, "html"), state.join(" · ") + " · " + u.url);
    const body = el("div", { class: "body" }, art, "html");
    if (Array.isArray(ctl.curve)) {
      body.append(curveChart(u));
    } else {
      text(el("div", { class: "nocurve" }, body, "html"),
        "the " + ctl.name + " controller learns no throughput curve: nothing to draw here " +
        "(the knee controller does)");
    }
    const col = el("div", { class: "charts col" }, body, "html");
    col.style.flexDirection = "column";
    const mine = points.map(p => [p.t, p.upstreams[u.name]]);
    const pick = k => mine.map(([t, x]) => [t, x ? x[k] : null]);
    col.append(timeChart("limit · in flight · knee", now, [
      { name: "limit", data: pick("limit"), color: PALETTE[0] },
      { name: "in flight", data: pick("in_flight"), color: PALETTE[1] },
      { name: "knee", data: pick("knee"), color: PALETTE[2], dash: "5 3" },
    ], { height: 92 }));
    col.append(timeChart("engine: running · waiting", now, [
      { name: "running", data: pick("running"), color: PALETTE[0] },
      { name: "waiting", data: pick("waiting"), color: PALETTE[4] },
    ], { height: 92 }));
    col.append(timeChart("engine KV-cache use", now, [
      { name: "KV use", data: pick("kv"), color: PALETTE[3], percent: true },
    ], { height: 92, ymax: 1, percent: true }));
  }

  function renderGateway(now) {
    const sec = byId("gateway");
    sec.hidden = false;
    const box = sec.querySelector(".charts");
    box.replaceChildren();
    const classes = keys(points, "queue");
    box.append(timeChart("queue depth by class", now, classes.map((c, i) => ({
      name: c, data: points.map(p => [p.t, p.queue[c] ?? null]), color: PALETTE[i % 8],
    })), { width: 432, height: 160 }));
    const reasons = keys(points, "rejected").filter(
      r => points.some(p => (p.rejected[r] || 0) > 0));
    box.append(timeChart("rejections/s by reason", now, reasons.map((r, i) => ({
      name: r, data: points.map(p => [p.t, p.rejected[r] ?? null]), color: PALETTE[(i + 4) % 8],
    })), { width: 432, height: 160, empty: "no rejections in the window" }));
    const ttft = [];
    keys(points, "ttft").forEach((c, i) => {
      const q = k => points.map(p => [p.t, p.ttft[c] ? p.ttft[c][k] : null]);
      ttft.push({ name: c + " p50", data: q("p50"), color: PALETTE[i % 8], seconds: true });
      ttft.push({ name: c + " p99", data: q("p99"), color: PALETTE[i % 8], dash: "5 3",
        seconds: true });
    });
    box.append(timeChart("user TTFT", now, ttft,
      { width: 432, height: 160, empty: "no answers in the window" }));
  }

  // --- the learned curve -------------------------------------------------------------------

  function curveChart(u) {
    const W = 560, H = 360, m = { l: 56, r: 18, t: 30, b: 40 };
    const ctl = u.controller, fit = ctl.fit || {}, pts = ctl.curve;
    const knee = ctl.knee_estimate;
    const a = fit.intercept, b = fit.slope;
    const fitted = a != null && b != null;
    const curveAt = c => (fitted ? c / (a + b * c) : interpolate(pts, c));
    const xmax = niceMax(1.15 * Math.max(1, u.limit, u.in_flight, knee || 0,
      ...pts.map(p => p.concurrency)));
    const ymax = niceMax(1.15 * Math.max(1, ...pts.map(p => p.throughput),
      fitted ? curveAt(xmax) : 0));
    const x = v => m.l + (W - m.l - m.r) * v / xmax;
    const y = v => H - m.b - (H - m.t - m.b) * v / ymax;
    const svg = el("svg", { class: "chart curve", width: W, height: H,
      viewBox: "0 0 " + W + " " + H, "data-x-domain": "0," + xmax,
      "data-x-range": m.l + "," + (W - m.r) });
    const kept = new Set((fit.kept || []).map(String));
    const over = new Set((fit.over_objective || []).map(String));
    for (const [name, from, to] of regions(pts, fit, knee, xmax)) {
      el("rect", { class: "region", "data-region": name, "data-from": round(from),
        "data-to": round(to), x: x(from), y: m.t, width: Math.max(0, x(to) - x(from)),
        height: H - m.t - m.b, fill: REGIONS[name] }, svg);
      if (x(to) - x(from) > 44) {
        text(el("text", { x: (x(from) + x(to)) / 2, y: H - m.b - 6, "text-anchor": "middle",
          class: "tick" }, svg), name);
      }
    }
    axes(svg, W, H, m, xmax, ymax, x, y);
    text(el("text", { x: m.l, y: 16, class: "title" }, svg),
      "learned curve: output tokens/s against concurrency");
    text(el("text", { x: (m.l + W - m.r) / 2, y: H - 6, "text-anchor": "middle", class: "tick" },
      svg), ctl.curve_of === "engine" ? "requests in the engine (running + waiting)"
      : "requests in flight through this gateway");
    if (fitted) {
      const d = [];
      for (let i = 0; i <= 80; i++) {
        const c = xmax * i / 80;
        d.push((i ? "L" : "M") + x(c).toFixed(1) + "," + y(curveAt(c)).toFixed(1));
      }
      el("path", { class: "fit", d: d.join(""), fill: "none", stroke: "#6e7781",
        "stroke-width": 1.5, "data-intercept": a, "data-slope": b }, svg);
    }
    for (const p of pts) {
      const c = String(p.concurrency);
      el("circle", { class: "point", cx: x(p.concurrency), cy: y(p.throughput), r: 4,
        fill: kept.has(c) ? "#1d2330" : "#ffffff", stroke: over.has(c) ? "#d1242f" : "#1d2330",
        "stroke-width": over.has(c) ? 2.5 : 1.2, "data-concurrency": p.concurrency,
        "data-throughput": p.throughput }, svg);
    }
    if (!pts.length) {
      text(el("text", { x: (m.l + W - m.r) / 2, y: (m.t + H - m.b) / 2, "text-anchor": "middle",
        class: "tick" }, svg), "no level measured yet: the curve appears under load");
    }
    vline(svg, "inflight-line", u.in_flight, x, m, H, "in flight " + u.in_flight, 3,
      { stroke: PALETTE[1], "stroke-width": 1.5, "data-in-flight": u.in_flight });
    vline(svg, "limit-line", u.limit, x, m, H, "limit " + u.limit, 2,
      { stroke: PALETTE[0], "stroke-width": 2, "data-limit": u.limit });
    if (knee != null) {
      const g = el("g", { class: "knee-marker", "data-knee": knee, "data-x": x(knee) }, svg);
      vline(g, "knee-line", knee, x, m, H, "knee " + fmt(knee), 1,
        { stroke: PALETTE[2], "stroke-width": 1.5, "stroke-dasharray": "5 3" });
      const ky = pts.length ? y(curveAt(knee)) : H - m.b;
      el("path", { d: "M" + x(knee) + "," + (ky - 7) + "l7,7l-7,7l-7,-7z", fill: PALETTE[2],
        stroke: "#ffffff" }, g);
    } else {
      text(el("text", { x: W - m.r, y: 16, "text-anchor": "end", class: "tick" }, svg),
        "no knee yet");
    }
    return svg;
  }

  // The four regions along the concurrency axis: low, under a tenth of the curve's ceiling
  // (the fitted one, 1 / slope; else the best level measured, through the origin and the
  // lowest level); linear, up to the knee; plateau, from the knee to the decline; decline, from
  // the first level past it. Without a knee there is no plateau yet.
  function regions(pts, fit, knee, xmax) {
    if (!pts.length) return [];
    let lowEnd;
    if (fit.intercept != null && fit.slope != null) {
      lowEnd = fit.intercept / (9 * fit.slope);
    } else {
      const first = pts[0], top = Math.max(...pts.map(p => p.throughput));
      lowEnd = 0.1 * top * first.concurrency / first.throughput;
    }
    const decline = fit.decline_from == null ? xmax : fit.decline_from;
    const linearEnd = knee == null ? decline : Math.min(knee, decline);
    lowEnd = Math.min(lowEnd, linearEnd);
    const out = [["low", 0, lowEnd], ["linear", lowEnd, linearEnd]];
    if (knee != null) out.push(["plateau", linearEnd, decline]);
    if (fit.decline_from != null) out.push(["decline", decline, xmax]);
    return out.map(([n, f, t]) => [n, Math.max(0, Math.min(f, xmax)), Math.min(t, xmax)])
      .filter(([, f, t]) => t > f);
  }

  function interpolate(pts, c) {
    if (!pts.length) return 0;
    if (c <= pts[0].concurrency) return pts[0].throughput * c / pts[0].concurrency;
    for (let i = 1; i < pts.length; i++) {
      const p = pts[i - 1], q = pts[i];
      if (c <= q.concurrency) {
        return p.throughput + (q.throughput - p.throughput) *
          (c - p.concurrency) / (q.concurrency - p.concurrency);
      }
    }
    return pts[pts.length - 1].throughput;
  }

  function vline(parent, cls, v, x, m, H, label, row, attrs) {
    const X = x(v);
    el("line", Object.assign({ class: cls, x1: X, x2: X, y1: m.t, y2: H - m.b, "data-x": X },
      attrs), parent);
    const right = X > 380;
    text(el("text", { x: right ? X - 4 : X + 4, y: m.t + 12 * row,
      class: "label " + cls + "-label", "text-anchor": right ? "end" : "start",
      fill: attrs.stroke }, parent), label);
  }

  function axes(svg, W, H, m, xmax, ymax, x, y) {
    for (const v of ticks(ymax)) {
      el("line", { class: "grid", x1: m.l, x2: W - m.r, y1: y(v), y2: y(v) }, svg);
      text(el("text", { x: m.l - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, svg),
        fmt(v));
    }
    for (const v of ticks(xmax)) {
      text(el("text", { x: x(v), y: H - m.b + 14, "text-anchor": "middle", class: "tick" }, svg),
        fmt(v));
    }
    el("line", { class: "axis", x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b }, svg);
    el("line", { class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: H - m.b }, svg);
  }

  // --- over time ---------------------------------------------------------------------------

  function timeChart(title, now, series, opts) {
    const W = opts.width || 760, H = opts.height, m = { l: 46, r: 12, t: 8, b: 16 };
    const t0 = points.length ? points[0].t : now;
    const span = Math.min(600, Math.max(60, now - t0));
    let top = opts.ymax || 0;
    for (const s of series) for (const [, v] of s.data) if (v != null && v > top) top = v;
    const ymax = opts.ymax || niceMax(top || 1);
    const x = t => m.l + (W - m.l - m.r) * (1 - (now - t) / span);
    const y = v => H - m.b - (H - m.t - m.b) * Math.min(v, ymax) / ymax;
    const fig = el("figure", { class: "chart time", "data-title": title }, null, "html");
    const legend = el("figcaption", {}, fig, "html");
    text(el("b", {}, legend, "html"), title);
    const svg = el("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H }, fig);
    for (const v of ticks(ymax, 3)) {
      el("line", { class: "grid", x1: m.l, x2: W - m.r, y1: y(v), y2: y(v) }, svg);
      text(el("text", { x: m.l - 4, y: y(v) + 4, "text-anchor": "end", class: "tick" }, svg),
        opts.percent ? Math.round(v * 100) + "%" : fmt(v));
    }
    const step = span > 240 ? 120 : span > 90 ? 30 : 15;
    for (let ago = 0; ago <= span; ago += step) {
      text(el("text", { x: x(now - ago), y: H - 3, "text-anchor": ago ? "middle" : "end",
        class: "tick" }, svg), ago ? "−" + (ago >= 60 ? ago / 60 + "m" : ago + "s") : "now");
    }
    el("line", { class: "axis", x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b }, svg);
    series.forEach(s => {
      const latest = lastValue(s.data);
      const d = [];
      let pen = "M";
      for (const [t, v] of s.data) {
        if (v == null || now - t > span) { pen = "M"; continue; }
        d.push(pen + x(t).toFixed(1) + "," + y(v).toFixed(1));
        pen = "L";
      }
      el("path", { class: "series", d: d.join("") || "M0,0", fill: "none", stroke: s.color,
        "stroke-width": 1.6, "stroke-dasharray": s.dash || "none", "data-series": s.name,
        "data-latest": latest == null ? "" : latest }, svg);
      const item = el("span", { class: "key" }, legend, "html");
      item.style.color = s.color;
      item.textContent = (s.dash ? "┅ " : "━ ") + s.name + " " + (latest == null ? "–"
        : s.percent ? Math.round(latest * 100) + "%" : fmt(latest) + (s.seconds ? " s" : ""));
    });
    if (!series.length && opts.empty) {
      text(el("span", { class: "key" }, legend, "html"), opts.empty);
    }
    return fig;
  }

  function lastValue(data) {
    for (let i = data.length - 1; i >= 0; i--) if (data[i][1] != null) return data[i][1];
    return null;
  }

  function keys(pts, field) {
    const out = new Set();
    for (const p of pts) for (const k of Object.keys(p[field] || {})) out.add(k);
    return Array.from(out).sort();
  }

  // --- small helpers -----------------------------------------------------------------------

  function byId(id) { return document.getElementById(id); }

  function el(tag, attrs, parent, html) {
    const node = html ? document.createElement(tag) : document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (parent) parent.append(node);
    return node;
  }

  function text(node, s) { node.textContent = s; return node; }

  function step(max, n) {
    const raw = max / n, e = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const f of [1, 2, 2.5, 5, 10]) if (f * e >= raw) return f * e;
    return 10 * e;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const s = step(v, 5);
    return Math.ceil(v / s - 1e-9) * s;
  }

  function ticks(max, n) {
    const s = step(max, n || 5), out = [];
    for (let v = 0; v <= max + 1e-9; v += s) out.push(Math.round(v * 1e6) / 1e6);
    return out;
  }

  function round(v) { return Math.round(v * 100) / 100; }

  function fmt(v) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1000) return Math.round(v).toLocaleString("en");
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return (Math.round(v * 10) / 10).toString();
    if (a >= 1 || a === 0) return (Math.round(v * 100) / 100).toString();
    return v.toPrecision(2);
  }

  poll();
})();
