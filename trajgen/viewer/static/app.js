// The trajectory viewer. Everything from the run is model output: it reaches the page only as
// textContent (never as markup); the summary's HTML is escaped by the server.
"use strict";

const PAGE = 100;
const FOLD_LINES = 20;
const FOLD_CHARS = 3000;
const FILTERS = ["status", "tool", "toolset", "hallucinated", "partial", "failed_class"];
const state = { start: 0, matched: 0, entries: [], selected: -1, timer: null };

const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

async function get(path, params) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params || {})) if (v !== "") url.searchParams.set(k, v);
  const response = await fetch(url);
  return response.json();
}

function showTab(name) {
  for (const pane of ["summary", "list"]) {
    $(pane).hidden = pane !== name;
    $("tab-" + pane).classList.toggle("active", pane === name);
  }
}

function fillSelect(select, values) {
  const chosen = select.value;
  while (select.options.length > 1) select.remove(1);
  for (const v of values) select.add(new Option(v, v));
  select.value = values.includes(chosen) ? chosen : "";
}

async function loadSummary() {
  const summary = await get("/api/summary");
  $("summary").innerHTML = summary.html;  // escaped by the server (render.py)
  $("title").textContent = "run " + summary.title + (summary.live ? " (live)" : "");
  document.title = summary.title + " · trajectory viewer";
  for (const name of ["status", "tool", "toolset", "failed_class"]) fillSelect($("f-" + name), summary.facets[name]);
  return summary;
}

function filters() {
  const params = { q: $("q").value.trim() };
  for (const name of FILTERS) params[name] = $("f-" + name).value;
  return params;
}

async function loadPage(start, pick) {
  const shown = state.entries[state.selected];
  const page = await get("/api/entries", { ...filters(), start: Math.max(0, start), limit: PAGE });
  state.start = page.start;
  state.matched = page.matched;
  state.entries = page.entries;
  const end = page.start + page.entries.length;
  $("range").textContent = page.matched ? `${page.start + 1}–${end} of ${page.matched} (${page.total} prompts)`
                                        : `no match (${page.total} prompts)`;
  $("prev").disabled = page.start === 0;
  $("next").disabled = end >= page.matched;
  const body = $("rows");
  body.replaceChildren();
  page.entries.forEach((entry, i) => {
    const tr = el("tr");
    tr.dataset.key = entry.key;
    tr.append(el("td", "num", entry.prompt_index), statusCell(entry), promptCell(entry),
              el("td", "tools", entry.tools.join(", ")), el("td", "num", entry.turns), el("td", "num", entry.tokens));
    tr.addEventListener("click", () => selectRow(i));
    body.append(tr);
  });
  if (!page.entries.length) $("detail").replaceChildren(el("p", "empty", "No prompt matches."));
  if (pick === "first") selectRow(0);
  else if (pick === "last") selectRow(page.entries.length - 1);
  else {  // the same page again: keep the row that is open
    state.selected = shown ? page.entries.findIndex((entry) => entry.key === shown.key) : -1;
    if (state.selected >= 0) body.children[state.selected].classList.add("selected");
  }
}

function statusCell(entry) {
  const td = el("td");
  td.append(el("span", "badge " + entry.status, entry.status));
  if (entry.reason) td.append(el("span", "reason", entry.reason));
  if (entry.partial) td.append(el("span", "badge flag", "partial"));
  if (entry.hallucinated) td.append(el("span", "badge flag", "hallucinated"));
  return td;
}

function promptCell(entry) {
  const td = el("td", "prompt");
  if (entry.id !== null) td.append(el("span", "id", entry.id));
  td.append(document.createTextNode(entry.preview || `(prompt ${entry.prompt_index}: no row was written)`));
  return td;
}

async function selectRow(i) {
  if (i < 0 || i >= state.entries.length) return;
  state.selected = i;
  const rows = $("rows").children;
  for (let r = 0; r < rows.length; r++) rows[r].classList.toggle("selected", r === i);
  rows[i].scrollIntoView({ block: "nearest" });
  const key = state.entries[i].key;
  const found = await get("/api/entry", { key });
  if (state.entries[state.selected] && state.entries[state.selected].key === key) renderEntry(found);
}

async function move(step) {
  const next = state.selected + step;
  if (next >= 0 && next < state.entries.length) return selectRow(next);
  if (step > 0 && state.start + state.entries.length < state.matched) return loadPage(state.start + PAGE, "first");
  if (step < 0 && state.start > 0) return loadPage(state.start - PAGE, "last");
}

function pre(text, cls) { return el("pre", cls, text); }

function folded(text) {
  const lines = text.split("\n");
  if (lines.length <= FOLD_LINES && text.length <= FOLD_CHARS) return pre(text);
  const box = el("div", "folded");
  box.append(pre(lines.slice(0, FOLD_LINES).join("\n").slice(0, FOLD_CHARS)));
  const details = el("details");
  details.append(el("summary", null, `show all ${lines.length} lines, ${text.length} characters`), pre(text));
  box.append(details);
  return box;
}

function json(value) { return JSON.stringify(value, null, 2); }

function resultView(content) {
  if (content === null || typeof content !== "object" || Array.isArray(content)) return folded(json(content));
  const box = el("dl", "result");
  for (const [k, v] of Object.entries(content)) {
    box.append(el("dt", null, k));
    const dd = el("dd");
    dd.append(typeof v === "string" ? folded(v) : folded(json(v)));
    box.append(dd);
  }
  return box;
}

const ROLES = { system: "system", human: "user", gpt: "assistant", tool: "tool" };

function turnView(turn) {
  const box = el("article", "turn " + turn.role + (turn.simulated ? " simulated" : ""));
  box.append(el("header", "role", turn.simulated ? "simulated user" : ROLES[turn.role] || turn.role));
  if (turn.role === "system") {
    const details = el("details");
    details.append(el("summary", null, (turn.text || "").split("\n")[0].slice(0, 120)), pre(turn.text, "text"));
    box.append(details);
    return box;
  }
  if (turn.reasoning) {
    const details = el("details", "reasoning");
    details.append(el("summary", null, `reasoning (${turn.reasoning.length} characters)`), pre(turn.reasoning));
    box.append(details);
  }
  if (turn.text) box.append(folded(turn.text));
  for (const call of turn.calls || []) {
    const c = el("div", "call");
    c.append(el("div", "call-head", `→ ${call.name}`), el("span", "call-id", call.id));
    c.append(folded(json(call.arguments)));
    box.append(c);
  }
  if (turn.role === "tool" && "content" in turn) {
    box.querySelector(".role").textContent = `tool result: ${turn.name}`;
    box.append(el("span", "call-id", turn.call_id), resultView(turn.content));
  }
  return box;
}

function facts(pairs) {
  const dl = el("dl", "facts");
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    dl.append(el("dt", null, k), el("dd", null, typeof v === "object" ? json(v) : v));
  }
  return dl;
}

function renderEntry(found) {
  const chat = el("div", "chat");
  const side = el("aside", "meta");
  if (found.status === "failed") {
    chat.append(el("p", "banner failed", `failed: ${found.reason}`), pre(found.record.message || "", "error"),
                el("p", "empty", "No conversation was written: the prompt failed (resume retries it)." +
                   (found.turns.length ? " Its prompt, from the dataset file:" : "")));
  } else if (found.status === "discarded") {
    chat.append(el("p", "banner discarded", `discarded: ${found.reason}`));
  } else if (found.status === "filtered") {
    chat.append(el("p", "banner filtered", `filtered: ${found.reason}`));
  }
  for (const turn of found.turns) chat.append(turnView(turn));
  side.append(el("h4", null, "prompt"), facts([
    ["status", found.status], ["reason", found.reason], ["prompt index", found.prompt_index], ["key", found.key],
    ["file", `${found.source.file}:${found.source.line}`], ...Object.entries(found.row),
    ...Object.entries(found.record).filter(([k]) => k !== "message")]));
  if (Object.keys(found.tool_stats).length) {
    side.append(el("h4", null, "tool calls"));
    side.append(facts(Object.entries(found.tool_stats).map(([n, s]) => [n, `${s.count} (${s.success} ok, ${s.failure} failed)`])));
  }
  if (Array.isArray(found.tools)) {
    side.append(el("h4", null, `tools offered (${found.tools.length})`));
    for (const tool of found.tools) {
      const fn = (tool && tool.function) || tool || {};
      const details = el("details", "schema");
      details.append(el("summary", null, fn.name || "?"), pre(json(tool)));
      side.append(details);
    }
  }
  if (found.metadata) side.append(el("h4", null, "metadata"), pre(json(found.metadata), "json"));
  $("detail").replaceChildren(chat, side);
  $("detail").scrollTop = 0;
}

function refilter() {
  clearTimeout(state.timer);
  state.timer = setTimeout(() => loadPage(0, "first"), 150);
}

function onKey(event) {
  const typing = ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName);
  if (event.key === "Escape") return document.activeElement.blur();
  if (typing || event.ctrlKey || event.metaKey || event.altKey) return;
  const actions = {
    j: () => move(1), ArrowDown: () => move(1), k: () => move(-1), ArrowUp: () => move(-1),
    n: () => !$("next").disabled && loadPage(state.start + PAGE, "first"),
    p: () => !$("prev").disabled && loadPage(state.start - PAGE, "first"),
    "/": () => { showTab("list"); $("q").focus(); }, s: () => showTab("summary"), t: () => showTab("list"),
  };
  if (actions[event.key]) { event.preventDefault(); actions[event.key](); }
}

function start() {
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showTab(tab.dataset.tab));
  $("q").addEventListener("input", refilter);
  for (const name of FILTERS) $("f-" + name).addEventListener("change", () => loadPage(0, "first"));
  $("prev").addEventListener("click", () => loadPage(state.start - PAGE, "first"));
  $("next").addEventListener("click", () => loadPage(state.start + PAGE, "first"));
  document.addEventListener("keydown", onKey);
  showTab("summary");
  loadSummary().then(() => loadPage(0, "first"));
  setInterval(async () => {  // a run still going: the numbers, the facets and the list follow it
    if ((await loadSummary()).live) loadPage(state.start, "keep");
  }, 10000);
}

start();
