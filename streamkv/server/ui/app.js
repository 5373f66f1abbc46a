// streamkv live session page: plain JS, no build step, no CDN. Everything shown comes from the
// public HTTP API (/v1/sessions, /flash, /query, /events); data is written with textContent only.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = { current: null, events: null, refreshTimer: null, flash: new Map() };

// ------------------------------------------------------------------ HTTP
function headers(json) {
  const h = {};
  const key = localStorage.getItem("streamkv.key");
  if (key) h.Authorization = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  const res = await fetch(path, { method, headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const msg = (data.error && data.error.message) || res.statusText;
    throw new Error(`${method} ${path}: ${res.status} ${msg}`);
  }
  return data;
}

function showError(err) {
  const box = $("error");
  box.textContent = String(err.message || err);
  box.hidden = false;
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => { box.hidden = true; }, 8000);
}

const guard = (fn) => (...args) => fn(...args).catch(showError);

// ------------------------------------------------------------------ SSE over fetch
// EventSource cannot send an Authorization header, so the stream is read with fetch.
async function subscribe(id, onEvent, signal) {
  const res = await fetch(`/v1/sessions/${id}/events`, { headers: headers(false), signal });
  if (!res.ok) throw new Error(`events: ${res.status}`);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// ------------------------------------------------------------------ sessions list
async function loadSessions() {
  const { data } = await api("GET", "/v1/sessions");
  const list = $("session-list");
  list.replaceChildren(...data.map((s) => {
    const li = document.createElement("li");
    li.dataset.id = s.id;
    li.className = s.id === ui.current ? "active" : "";
    li.textContent = s.id;
    const meta = document.createElement("span");
    meta.className = "muted";
    meta.textContent = ` v${s.data_version} · ${s.tokens.total} tok`;
    li.append(meta);
    li.onclick = () => select(s.id);
    return li;
  }));
  if (ui.current && !data.some((s) => s.id === ui.current)) clearSelection();
}

async function createSession() {
  const body = { system: $("new-system").value, retention_tokens: Number($("new-retention").value),
    evict: $("new-evict").value };
  const s = await api("POST", "/v1/sessions", body);
  await loadSessions();
  await select(s.id);
}

function clearSelection() {
  if (ui.events) ui.events.abort();
  ui.current = null;
  ui.events = null;
  $("session").hidden = true;
  $("empty").hidden = false;
}

async function select(id) {
  clearSelection();
  ui.current = id;
  ui.flash = new Map();
  $("session-id").textContent = id;
  $("events").replaceChildren();
  $("answer-box").hidden = true;
  $("session").hidden = false;
  $("empty").hidden = true;
  document.querySelectorAll("#session-list li").forEach((li) => li.classList.toggle("active", li.dataset.id === id));
  const ctl = new AbortController();
  ui.events = ctl;
  subscribe(id, onEvent, ctl.signal).catch((e) => { if (!ctl.signal.aborted) showError(e); });
  await Promise.all([refresh(), loadFlash()]);
}

// ------------------------------------------------------------------ one session
function onEvent(ev) {
  if (ev.session_id !== ui.current) return;
  const li = document.createElement("li");
  const { event, id, session_id, ...rest } = ev;
  li.textContent = `#${id} ${event} ${JSON.stringify(rest)}`;
  $("events").prepend(li);
  while ($("events").children.length > 50) $("events").lastChild.remove();
  if (event === "flash_ready") setFlashAnswer(ev.question_id, ev);
  if (event === "deleted") { clearSelection(); loadSessions().catch(showError); return; }
  clearTimeout(ui.refreshTimer);
  ui.refreshTimer = setTimeout(() => refresh().catch(showError), 100);
}

async function refresh() {
  const id = ui.current;
  if (!id) return;
  const s = await api("GET", `/v1/sessions/${id}?include_text=true`);
  if (id !== ui.current) return;
  $("version").textContent = s.data_version;
  $("stream-state").textContent = s.kv.where;
  drawLayout(s);
  drawWindow(s.layout.records);
  drawStats(s);
}

const fmtBytes = (n) => n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`;
const hue = (version) => (version * 47) % 360;

function part(cls, tokens, scale, title, color) {
  const el = document.createElement("div");
  el.className = "part " + cls;
  el.style.width = `${(100 * tokens) / scale}%`;
  if (color) el.style.background = color;
  el.title = title;
  return el;
}

// [frozen | memory | record record ... | free up to the retention limit]
function drawLayout(s) {
  const t = s.tokens, recs = s.layout.records;
  const capacity = t.frozen + s.spec.retention_tokens;
  const scale = Math.max(capacity, t.total);
  const used = recs.reduce((n, r) => n + r.end - r.start, 0);
  const parts = [part("frozen", t.frozen, scale, `frozen prefix: ${t.frozen} tokens`)];
  if (s.memory_tokens) parts.push(part("memory", s.memory_tokens, scale, `snapkv memory: ${s.memory_tokens} tokens`));
  recs.forEach((r, i) => {
    parts.push(part("record", r.end - r.start, scale, `record v${r.version}: ${r.end - r.start} tokens`,
      `hsl(${hue(r.version)} 60% ${i % 2 ? 56 : 66}%)`));
  });
  parts.push(part("free", Math.max(0, capacity - t.frozen - (s.memory_tokens || 0) - used), scale, "free"));
  $("layout").replaceChildren(...parts);
  $("layout-caption").textContent = `${t.total} of ${capacity} tokens in the stream · ${fmtBytes(s.kv.bytes)} KV`;
  const legend = [["frozen", `frozen ${t.frozen}`], ["memory", `memory ${s.memory_tokens || 0}`],
    ["record", `records ${used} (${recs.length})`], ["free", `free ${Math.max(0, capacity - t.total)}`]];
  $("layout-legend").replaceChildren(...legend.map(([cls, text]) => {
    const el = document.createElement("span");
    el.className = "key-" + cls;
    el.textContent = text;
    return el;
  }));
}

function drawWindow(records) {
  $("window-caption").textContent = `(${records.length} records, oldest first)`;
  $("window").replaceChildren(...records.map((r) => {
    const li = document.createElement("li");
    li.style.borderLeftColor = `hsl(${hue(r.version)} 60% 52%)`;
    const v = document.createElement("span");
    v.className = "muted";
    v.textContent = `v${r.version} · ${r.end - r.start} tok  `;
    li.append(v, document.createTextNode(r.text === null ? "(offloaded)" : r.text));
    return li;
  }));
}

function drawStats(s) {
  const rows = [
    ["tokens", `frozen ${s.tokens.frozen} · sliding ${s.tokens.sliding} · total ${s.tokens.total} · computed ${s.tokens.computed}`],
    ["records", `pushed ${s.records.pushed} · ingested ${s.records.ingested} · in window ${s.records.in_window} · queued ${s.records.queued}`],
    ["dropped / evicted", `${s.records.dropped} / ${s.records.evicted} records`],
    ["evictions", `${s.evictions} (${s.tokens_evicted} tokens${s.spec.evict === "snapkv" ? `, memory ${s.memory_tokens}` : ""})`],
    ["eviction mode", s.spec.evict],
    ["KV", `${s.kv.where} · ${fmtBytes(s.kv.bytes)} · ${s.kv.blocks} blocks`],
    ["queue", `${s.queue.tokens} / ${s.queue.capacity_tokens} tokens`],
    ["queries", String(s.queries)],
    ["flash", Object.entries(s.flash).map(([k, v]) => `${k.replaceAll("_", " ")} ${v ?? "-"}`).join(" · ")],
  ];
  $("stats").tBodies[0].replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    const td = document.createElement("td");
    th.textContent = k;
    td.textContent = v;
    td.dataset.stat = k;
    tr.append(th, td);
    return tr;
  }));
}

// ------------------------------------------------------------------ push, ask, flash
async function push() {
  const records = $("push-text").value.split("\n").map((l) => l.trim()).filter(Boolean);
  if (!records.length) throw new Error("type at least one record");
  const ack = await api("POST", `/v1/sessions/${ui.current}/data`, { records });
  $("push-ack").textContent = `accepted ${ack.accepted}, dropped ${ack.dropped} · version ${ack.data_version}` +
    ` · queued ${ack.queued_records} records (${ack.queued_tokens} tokens)`;
  $("push-text").value = "";
}

async function ask() {
  const body = { question: $("ask-question").value, max_tokens: Number($("ask-max").value) };
  const r = await api("POST", `/v1/sessions/${ui.current}/query`, body);
  $("answer").textContent = r.answer;
  $("answer-source").textContent = r.source;
  $("answer-latency").textContent = `${r.latency_ms.toFixed(1)} ms`;
  $("answer-version").textContent = r.data_version;
  $("answer-usage").textContent = `${r.usage.computed_prompt_tokens} prompt tokens computed, ${r.usage.completion_tokens} generated`;
  $("answer-box").hidden = false;
}

function flashRow(q) {
  let tr = ui.flash.get(q.id);
  if (tr) return tr;
  tr = document.createElement("tr");
  tr.dataset.id = q.id;
  for (let i = 0; i < 4; i++) tr.append(document.createElement("td"));
  tr.cells[0].textContent = q.question;
  const del = document.createElement("button");
  del.textContent = "✕";
  del.title = "unregister";
  del.onclick = guard(async () => {
    await api("DELETE", `/v1/sessions/${ui.current}/flash/${q.id}`);
    tr.remove();
    ui.flash.delete(q.id);
  });
  const cell = document.createElement("td");
  cell.append(del);
  tr.append(cell);
  ui.flash.set(q.id, tr);
  $("flash-table").tBodies[0].append(tr);
  return tr;
}

function setFlashAnswer(qid, ans) {
  const tr = ui.flash.get(qid);
  if (!tr || !ans) return;
  tr.cells[1].textContent = ans.answer;
  tr.cells[2].textContent = ans.data_version;
  const c = ans.confidence || {};
  tr.cells[3].textContent = c.min === undefined || c.min === null ? "" : Number(c.min).toFixed(2);
  tr.classList.remove("flash");
  void tr.offsetWidth;  // restart the highlight animation
  tr.classList.add("flash");
}

async function loadFlash() {
  const id = ui.current;
  const { data } = await api("GET", `/v1/sessions/${id}/flash`);
  if (id !== ui.current) return;
  $("flash-table").tBodies[0].replaceChildren();
  for (const q of data) {
    flashRow(q);
    setFlashAnswer(q.id, q.latest);
  }
}

async function registerFlash() {
  const q = await api("POST", `/v1/sessions/${ui.current}/flash`, { question: $("flash-question").value });
  flashRow(q);
  $("flash-question").value = "";
}

async function deleteSession() {
  await api("DELETE", `/v1/sessions/${ui.current}`);
  clearSelection();
  await loadSessions();
}

// ------------------------------------------------------------------ start
async function start() {
  $("api-key").value = localStorage.getItem("streamkv.key") || "";
  $("api-key").onchange = guard(async () => {
    localStorage.setItem("streamkv.key", $("api-key").value);
    await connect();
  });
  $("refresh").onclick = guard(loadSessions);
  $("create").onclick = guard(createSession);
  $("push").onclick = guard(push);
  $("ask").onclick = guard(ask);
  $("flash-register").onclick = guard(registerFlash);
  $("delete").onclick = guard(deleteSession);
  setInterval(() => loadSessions().catch(() => {}), 3000);
  await connect();  // with a wrong or missing key this shows the 401; entering the key retries
}

async function connect() {
  const models = await api("GET", "/v1/models");
  $("error").hidden = true;
  $("model").textContent = models.data.map((m) => m.id).join(", ");
  await loadSessions();
}

start().catch(showError);
