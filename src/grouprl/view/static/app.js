// grouprl view: the page's logic. Every text from a run goes in through textContent (never as
// HTML), and into plotly (whose titles and names read a little HTML) through plain(); styles
// are set through the CSSOM (the page's Content-Security-Policy allows no style attribute
// written as text); the data come from the JSON API beside this file (see app.py).
"use strict";

const state = {
  runs: [],            // /api/runs
  metrics: {},         // run name -> {generation, rows}
  step: {},            // the step shown: {run, step, groups}
  evals: {},           // "run|folder" -> answers
  evalPage: 0,
};
const TIME_PARTS = ["time/generate", "time/reward", "time/old_ref_log_probs", "time/update",
  "time/weight_push", "time/weight_sync", "time/wait_batch", "time/wait_weights", "time/eval"];
const POLL_MS = 5000;
const ROWS_PER_PAGE = 100;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}
const $ = (id) => document.getElementById(id);
const fmt = (x) => (x === null || x === undefined) ? "–" : (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toPrecision(4)) : String(x));
async function api(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}
const runPath = (name) => `api/runs/${encodeURIComponent(name)}`;
// plotly reads <a href>, <b>, <br> and entities in titles, names and hover text: a metric key or
// run name is shown as the text it is
const plain = (text) => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
const lines = (n) => `${n} line${n === 1 ? "" : "s"} unreadable`;
function unreadableNote(counts) {  // {file: lines skipped} -> "3 lines unreadable (rollouts.jsonl 2, judge.jsonl 1)"
  const entries = Object.entries(counts || {});
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  return total ? `${lines(total)} (${entries.map(([file, n]) => `${file} ${n}`).join(", ")}), skipped` : "";
}

// ---------------------------------------------------------------- curves
function smooth(ys, weight) {
  if (!weight) return ys;
  let last = null;
  return ys.map((y) => {
    if (y === null || y === undefined) return null;
    last = last === null ? y : last * weight + (1 - weight) * y;
    return last;
  });
}

function series(rows, key) {
  const xs = [], ys = [];
  for (const row of rows) {
    if (key in row && typeof row[key] === "number") { xs.push(row.step); ys.push(row[key]); }
  }
  return [xs, ys];
}

function allKeys() {
  const keys = new Set();
  for (const m of Object.values(state.metrics)) for (const row of m.rows) for (const k of Object.keys(row)) if (k !== "step") keys.add(k);
  return [...keys].sort();
}

function linePlot(container, key, title) {
  const weight = Number($("smoothing").value);
  const traces = [];
  for (const run of state.runs) {
    const rows = (state.metrics[run.name] || {rows: []}).rows;
    const [xs, ys] = series(rows, key);
    if (xs.length) traces.push({x: xs, y: smooth(ys, weight), name: plain(run.name), mode: xs.length > 1 ? "lines+markers" : "markers", type: "scatter"});
  }
  if (!traces.length) return false;
  const id = `plot-${key}`;
  let div = document.getElementById(id);
  if (!div) { div = el("div", {id, class: "plot"}); container.append(div); }
  const layout = {title: {text: plain(title || key), font: {size: 13}}, margin: {l: 45, r: 10, t: 30, b: 30}, height: 240,
    showlegend: state.runs.length > 1, xaxis: {title: {text: "step"}}};
  Plotly.react(div, traces, layout, {displaylogo: false, responsive: true});
  return true;
}

function timeBars(container) {
  for (const run of state.runs) {
    const rows = (state.metrics[run.name] || {rows: []}).rows;
    const traces = [];
    for (const key of TIME_PARTS) {
      const [xs, ys] = series(rows, key);
      if (xs.length) traces.push({x: xs, y: ys, name: plain(key.slice(5)), type: "bar"});
    }
    if (!traces.length) continue;
    const id = `plot-time-${run.name}`;
    let div = document.getElementById(id);
    if (!div) { div = el("div", {id, class: "plot wide"}); container.append(div); }
    Plotly.react(div, traces, {barmode: "stack", title: {text: plain(`${run.name}: seconds per step`), font: {size: 13}},
      height: 260, margin: {l: 45, r: 10, t: 30, b: 30}}, {displaylogo: false, responsive: true});
  }
}

function drawCurves() {
  const keys = allKeys();
  const shown = new Set();
  const section = (id, match) => {
    const box = $(id);
    for (const key of keys.filter(match)) { if (linePlot(box, key)) shown.add(key); }
  };
  section("curves-reward", (k) => k.startsWith("reward/") || k === "response/length_mean");
  timeBars($("curves-time"));
  keys.filter((k) => k.startsWith("time/")).forEach((k) => shown.add(k));
  section("curves-mismatch", (k) => /^rollout\/(mismatch|is_|kl_|staleness|policy_version)/.test(k));
  section("curves-val", (k) => k.startsWith("val/"));
  const filter = $("metric-filter").value.trim();
  const other = keys.filter((k) => !shown.has(k) && (!filter || k.includes(filter)));
  const box = $("curves-other");
  const limit = 40;
  for (const div of [...box.children]) if (!other.slice(0, limit).includes(div.id.slice(5))) { Plotly.purge(div); div.remove(); }
  other.slice(0, limit).forEach((k) => linePlot(box, k));
  $("other-note").textContent = other.length > limit ? `${other.length} metrics match; the first ${limit} are drawn (narrow the filter)` : `${other.length} metrics`;
}

async function pollMetrics() {
  let changed = false;
  for (const run of state.runs) {
    const m = state.metrics[run.name] || {generation: -1, rows: []};
    const got = await api(`${runPath(run.name)}/metrics?since=${m.rows.length}&generation=${m.generation}`);
    if (got.generation !== m.generation || got.start === 0) { m.rows = got.rows; changed = changed || got.rows.length > 0 || m.generation !== -1; }
    else if (got.rows.length) { m.rows = m.rows.concat(got.rows); changed = true; }
    m.generation = got.generation;
    state.metrics[run.name] = m;
  }
  return changed;
}

// ---------------------------------------------------------------- trajectories
function passes(sample) {
  const lo = $("reward-min").value, hi = $("reward-max").value;
  if (lo !== "" && !(sample.reward >= Number(lo))) return false;
  if (hi !== "" && !(sample.reward <= Number(hi))) return false;
  if ($("only-truncated").checked && !sample.truncated) return false;
  if ($("only-judge-failed").checked && !sample.judge_failed) return false;
  return true;
}

function drawGroups() {
  const box = $("groups");
  box.replaceChildren();
  const {groups} = state.step;
  if (!groups) return;
  let shown = 0;
  for (const g of groups) {
    if ($("only-zero-variance").checked && !g.zero_variance) continue;
    const samples = g.samples.filter(passes);
    if (!samples.length) continue;
    shown += 1;
    const head = el("div", {class: "group-head"},
      el("a", {href: "#", class: "uid", onclick: (e) => { e.preventDefault(); followUid(g.uid); }}, g.uid),
      ` mean reward ${fmt(g.reward_mean)}`, g.zero_variance ? el("span", {class: "badge"}, "zero variance") : null);
    const rows = samples.map((s) => el("tr", {class: "sample-row", "data-sample": s.sample, onclick: () => openSample(g.uid, s.sample)},
      el("td", {}, s.sample), el("td", {}, fmt(s.reward)),
      el("td", {}, Object.entries(s.rewards).map(([k, v]) => `${k} ${fmt(v)}`).join(", ")),
      el("td", {}, fmt(s.advantage)), el("td", {}, fmt(s.response_tokens)),
      el("td", {}, s.truncated ? "truncated" : s.finish_reason || ""), el("td", {}, fmt(s.version)),
      el("td", {}, s.actions.map((a) => a || "none").join(" → ")),
      el("td", {class: s.judge_failed ? "bad" : ""}, s.judge_calls ? (s.judge_failed ? "failed" : "ok") : "")));
    box.append(el("div", {class: "group"}, head, el("div", {class: "prompt"}, g.prompt),
      el("table", {class: "samples"}, el("tr", {}, ...["#", "reward", "components", "advantage", "tokens", "finish", "version", "actions", "judge"].map((h) => el("th", {}, h))), rows)));
  }
  if (!shown) box.append(el("p", {class: "note"}, "No group passes the filters."));
  if (state.step.unreadable) box.prepend(el("p", {class: "note bad unreadable"}, `${lines(state.step.unreadable)} in this step, skipped`));
}

async function loadStep() {
  const run = $("traj-run").value, step = $("traj-step").value;
  if (!run || step === "") return;
  state.step = await api(`${runPath(run)}/steps/${step}`);
  state.step.run = run;
  drawGroups();
}

function cropOf(turn) {
  // a <bbox> turn: its box (pixels of the page as shown) as fractions of the page
  if (turn.action !== "bbox" || !turn.page_size) return null;
  const nums = (turn.argument || "").replace(/[\[\]]/g, " ").split(/[\s,]+/).filter(Boolean).map(Number);
  if (nums.length !== 4 || nums.some((n) => !Number.isFinite(n))) return null;
  const [w, h] = turn.page_size;
  const c = (v) => Math.min(Math.max(v, 0), 1);
  return {x1: c(nums[0] / w), y1: c(nums[1] / h), x2: c(nums[2] / w), y2: c(nums[3] / h)};
}

function pageFigure(turn) {
  const img = el("img", {class: "page", src: turn.page_url, alt: turn.page});
  const frame = el("div", {class: "page-frame"}, img);
  const fig = el("figure", {}, frame, el("figcaption", {}, `${turn.page} (shown ${turn.page_size.join("x")})`));
  const crop = cropOf(turn);
  if (crop) {
    frame.append(el("div", {class: "crop-box", style: {left: `${crop.x1 * 100}%`, top: `${crop.y1 * 100}%`,
      width: `${(crop.x2 - crop.x1) * 100}%`, height: `${(crop.y2 - crop.y1) * 100}%`}}));
    const canvas = el("canvas", {class: "crop"});
    const draw = () => {  // the crop the policy saw, cut from the page
      const sx = crop.x1 * img.naturalWidth, sy = crop.y1 * img.naturalHeight;
      const sw = Math.max(1, (crop.x2 - crop.x1) * img.naturalWidth), sh = Math.max(1, (crop.y2 - crop.y1) * img.naturalHeight);
      const scale = Math.min(4, 160 / Math.max(sw, sh));
      canvas.width = Math.round(sw * scale); canvas.height = Math.round(sh * scale);
      const ctx = canvas.getContext("2d"); ctx.imageSmoothingEnabled = false;
      ctx.drawImage(img, sx, sy, sw, sh, 0, 0, canvas.width, canvas.height);
    };
    if (img.complete && img.naturalWidth) draw(); else img.addEventListener("load", draw);
    fig.append(el("div", {class: "crop-wrap"}, "crop: ", canvas));
  }
  return fig;
}

function drawTurn(turn) {
  const meta = [`turn ${turn.turn}`, turn.action || "no action", turn.version !== undefined ? `policy v${turn.version}` : null,
    `${fmt(turn.tokens)} tokens`, turn.unfinished ? `unfinished: ${turn.unfinished}` : null].filter(Boolean).join(" · ");
  const box = el("div", {class: "turn"}, el("div", {class: "turn-meta"}, meta));
  box.append(el("div", {class: "bubble policy"}, el("pre", {}, turn.text !== undefined ? turn.text : `<${turn.action}>${turn.argument || ""}`)));
  if (turn.page_url) box.append(pageFigure(turn));
  if (turn.observation || turn.error) {
    box.append(el("div", {class: "bubble observation" + (turn.error ? " bad" : "")}, el("pre", {}, turn.observation || ""),
      turn.error ? el("div", {class: "bad"}, `error: ${turn.error}`) : null));
  }
  return box;
}

function drawJudge(call) {
  const prompt = call.prompt || {};
  return el("div", {class: "judge"},
    el("div", {}, el("strong", {}, call.judge), ` (${call.model}) aggregate ${fmt(call.aggregate)}`,
      call.scores ? ` scores ${JSON.stringify(call.scores)}` : "", call.cached ? " · cached" : "",
      ` · ${fmt(call.attempts)} attempt(s) · ${fmt(call.latency_s)} s`),
    call.error ? el("div", {class: "bad judge-error"}, `error: ${call.error}`) : null,
    el("details", {}, el("summary", {}, `rendered prompt (${fmt(prompt.images)} image(s))`),
      el("pre", {class: "judge-prompt"}, `[system]\n${prompt.system || ""}\n\n[user]\n${prompt.user || ""}`)),
    el("div", {}, "raw reply:"), el("pre", {class: "judge-raw"}, call.raw === null || call.raw === undefined ? "" : String(call.raw)));
}

async function openSample(uid, sample) {
  const {run, step} = state.step;
  const r = await api(`${runPath(run)}/sample?step=${step}&uid=${encodeURIComponent(uid)}&sample=${sample}`);
  const box = $("sample");
  box.replaceChildren(
    el("h3", {}, `step ${r.step} · ${r.uid} · sample ${r.sample}`),
    el("div", {class: "figures"}, `reward ${fmt(r.reward)} · `, Object.entries(r.rewards || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", "),
      ` · advantage ${fmt(r.advantage)} · ${fmt(r.response_tokens)} tokens · ${r.truncated ? "truncated" : r.finish_reason}`,
      r.version !== null && r.version !== undefined ? ` · policy v${r.version}` : ""),
    el("details", {}, el("summary", {}, "prompt"), el("pre", {}, r.prompt || "")),
    el("div", {class: "note"}, `ground truth: ${JSON.stringify(r.ground_truth)}`),
    el("div", {id: "turns"}, (r.turns || []).map(drawTurn)),
    el("div", {}, (r.turns || []).length ? null : el("pre", {class: "bubble policy"}, r.response || "")),
    el("details", {}, el("summary", {}, "whole response"), el("pre", {}, r.response || "")),
    el("div", {}, Object.entries(r.image_urls || {}).map(([model, url]) => el("figure", {}, el("img", {class: "artifact", src: url}), el("figcaption", {}, model)))),
    el("h4", {}, `judge calls (${r.judge.length})`), el("div", {id: "judge-calls"}, r.judge.map(drawJudge)),
    ...(r.unreadable ? [el("p", {class: "note bad unreadable"}, `${lines(r.unreadable)} of this step or its judge calls, skipped`)] : []));
  for (const row of document.querySelectorAll(".sample-row")) row.classList.remove("chosen");
}

async function followUid(uid) {
  const history = await api(`${runPath(state.step.run)}/uid?uid=${encodeURIComponent(uid)}`);
  const box = $("uid-history");
  box.classList.remove("hidden");
  box.replaceChildren(el("h3", {}, `prompt ${uid} across steps`, " ", el("button", {onclick: () => box.classList.add("hidden")}, "close")),
    el("table", {class: "samples"}, el("tr", {}, el("th", {}, "step"), el("th", {}, "rewards"), el("th", {}, "answers")),
      history.map((h) => el("tr", {}, el("td", {}, h.step, h.unreadable ? el("div", {class: "note bad"}, lines(h.unreadable)) : null),
        el("td", {}, h.samples.map((s) => fmt(s.reward)).join(" ")),
        el("td", {}, h.samples.map((s) => el("div", {class: "answer"}, `#${s.sample}: ${s.answer}`)))))));
}

function fillSteps(keep) {
  const run = state.runs.find((r) => r.name === $("traj-run").value);
  const select = $("traj-step");
  const before = select.value;
  select.replaceChildren(...(run ? run.steps : []).map((s) => el("option", {value: s}, s)));
  if (keep && before !== "" && [...select.options].some((o) => o.value === before)) select.value = before;
}

// ---------------------------------------------------------------- held-out answers
async function answersOf(key) {
  if (!key) return null;
  if (!state.evals[key]) {
    const [run, folder] = key.split("|");
    state.evals[key] = await api(`${runPath(run)}/answers?folder=${encodeURIComponent(folder)}`);
  }
  return state.evals[key];
}

function answerCell(row) {
  if (!row) return el("td", {class: "note"}, "–");
  return el("td", {}, el("div", {class: row.accuracy > 0 ? "good" : "bad"}, `accuracy ${fmt(row.accuracy)} · reward ${fmt(row.reward)}`),
    el("pre", {class: "answer"}, row.skipped ? "(skipped: prompt too long)" : row.response || ""));
}

async function drawAnswers() {
  const left = await answersOf($("eval-a").value), right = await answersOf($("eval-b").value);
  const table = $("eval-table");
  if (!left) { table.replaceChildren(); return; }
  const a = left.rows, b = right && right.rows;
  const byUid = new Map((b || []).map((r) => [r.uid, r]));
  const text = $("eval-filter").value.trim().toLowerCase();
  let rows = a.map((r) => [r, byUid.get(r.uid)]);
  if (b && $("only-differ").checked) rows = rows.filter(([x, y]) => !y || x.accuracy !== y.accuracy || x.response !== y.response);
  if (text) rows = rows.filter(([x]) => `${x.uid} ${x.prompt} ${x.response}`.toLowerCase().includes(text));
  const mean = (rs) => { const v = rs.map((r) => r.accuracy).filter((x) => typeof x === "number"); return v.length ? v.reduce((s, x) => s + x, 0) / v.length : null; };
  let summary = `${a.length} answers, accuracy ${fmt(mean(a))}`;
  if (b) {
    const both = a.filter((r) => byUid.has(r.uid));
    const better = both.filter((r) => r.accuracy > byUid.get(r.uid).accuracy).length;
    const worse = both.filter((r) => r.accuracy < byUid.get(r.uid).accuracy).length;
    summary += ` · beside: ${b.length} answers, accuracy ${fmt(mean(b))} · ${both.length} paired by uid: left better on ${better}, right better on ${worse}`;
  }
  const skipped = [left, right].filter((x) => x && x.unreadable).map((x) => x.unreadable).reduce((s, n) => s + n, 0);
  $("eval-summary").textContent = skipped ? `${summary} · ${lines(skipped)}, skipped` : summary;
  const pages = Math.max(1, Math.ceil(rows.length / ROWS_PER_PAGE));
  state.evalPage = Math.min(state.evalPage, pages - 1);
  $("eval-page").textContent = `page ${state.evalPage + 1} of ${pages} (${rows.length} rows)`;
  const page = rows.slice(state.evalPage * ROWS_PER_PAGE, (state.evalPage + 1) * ROWS_PER_PAGE);
  table.replaceChildren(el("tr", {}, ...["uid", "prompt", "ground truth", $("eval-a").value, b ? $("eval-b").value : ""].map((h) => el("th", {}, h))),
    ...page.map(([x, y]) => el("tr", {class: "answer-row"}, el("td", {}, x.uid), el("td", {}, el("pre", {class: "answer"}, x.prompt || "")),
      el("td", {}, JSON.stringify(x.ground_truth)), answerCell(x), b ? answerCell(y) : null)));
}

function fillEvals() {
  const options = [];
  for (const run of state.runs) for (const folder of run.evals) options.push(`${run.name}|${folder}`);
  for (const [id, none] of [["eval-a", false], ["eval-b", true]]) {
    const select = $(id), before = select.value;
    select.replaceChildren(...(none ? [el("option", {value: ""}, "(none)")] : []), ...options.map((o) => el("option", {value: o}, o.replace("|", " / "))));
    if ([...select.options].some((o) => o.value === before)) select.value = before;
  }
}

// ---------------------------------------------------------------- wiring
function show(view) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.view === view);
  for (const s of document.querySelectorAll(".view")) s.classList.toggle("hidden", s.id !== `view-${view}`);
  if (view === "curves") drawCurves();
  if (view === "heldout") drawAnswers();
}

async function refreshRuns() {
  state.runs = await api("api/runs");
  $("runs").textContent = state.runs.map((r) => `${r.name}: ${r.steps.length} steps, ${r.trajectories} trajectories`).join(" | ");
  const notes = state.runs.map((r) => [r.name, unreadableNote(r.unreadable)]).filter(([, note]) => note);
  $("unreadable").textContent = notes.map(([name, note]) => `${name}: ${note}`).join(" | ");
  const select = $("traj-run"), before = select.value;
  select.replaceChildren(...state.runs.map((r) => el("option", {value: r.name}, r.name)));
  if (before) select.value = before;
  fillSteps(true);
  fillEvals();
}

async function tick() {
  try {
    await refreshRuns();
    if (await pollMetrics() && !$("view-curves").classList.contains("hidden")) drawCurves();
    $("live").textContent = `read ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("live").textContent = `not reachable (${e.message})`;
  }
}

async function start() {
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
  $("smoothing").addEventListener("input", () => { $("smoothing-value").textContent = $("smoothing").value; drawCurves(); });
  $("metric-filter").addEventListener("input", drawCurves);
  $("traj-run").addEventListener("change", () => { fillSteps(false); loadStep(); });
  $("traj-step").addEventListener("change", loadStep);
  const move = (d) => { const s = $("traj-step"); const i = s.selectedIndex + d; if (i >= 0 && i < s.options.length) { s.selectedIndex = i; loadStep(); } };
  $("step-prev").addEventListener("click", () => move(-1));
  $("step-next").addEventListener("click", () => move(1));
  for (const id of ["reward-min", "reward-max", "only-zero-variance", "only-truncated", "only-judge-failed"]) $(id).addEventListener("input", drawGroups);
  for (const id of ["eval-a", "eval-b", "only-differ", "eval-filter"]) $(id).addEventListener("input", () => { state.evalPage = 0; drawAnswers(); });
  $("eval-prev").addEventListener("click", () => { state.evalPage = Math.max(0, state.evalPage - 1); drawAnswers(); });
  $("eval-next").addEventListener("click", () => { state.evalPage += 1; drawAnswers(); });
  await refreshRuns();
  await pollMetrics();
  drawCurves();
  await loadStep();
  document.body.dataset.ready = "1";
  setInterval(tick, POLL_MS);
}

start();
