// The live ledgers: /console/api/state polled every POLL_MS (at least once a second), drawn as
// one card per executor (KV blocks, memory planned vs actual, the batch, the prefix cache), the
// scheduler's queue, the prefix index, and the table of recent requests.

import { getJSON } from "./api.js";
import { el, formatBytes, num, pct, secs } from "./format.js";

export const POLL_MS = 500;
const $ = (id) => document.getElementById(id);

const stat = (label, value) => el("div", { class: "stat" }, el("span", {}, label), el("b", {}, value));

function kvGauge(kv) {
  const total = Math.max(kv.num_total_blocks, 1);
  const used = (100 * kv.num_used_blocks) / total;
  const cached = (100 * Math.min(kv.num_cached_blocks, total)) / total;
  return el("div", {},
    el("div", { class: "gauge", title: "KV blocks in use", "data-testid": "kv-gauge", "data-used": kv.num_used_blocks },
      el("div", { class: "used", style: `width: ${used}%` })),
    el("div", { class: "gauge", style: "height: 6px", title: "blocks holding a reusable prefix (in use or free)" },
      el("div", { class: "cached", style: `width: ${cached}%` })),
    el("div", { class: "kv-legend" },
      el("span", { class: "used" }, `used ${num(kv.num_used_blocks)}`),
      el("span", { class: "free" }, `free ${num(kv.num_free_blocks)}`),
      el("span", { class: "cached" }, `cached ${num(kv.num_cached_blocks)}`),
      el("span", {}, `of ${num(kv.num_total_blocks)} · ${pct(kv.usage)}`)));
}

function memoryTable(m) {
  if (!m) return el("p", { class: "muted" }, "this executor does not report its memory ledger");
  const rows = m.rows.map((r) => el("tr", {}, el("td", {}, r.item),
    el("td", { class: "num" }, r.planned ? formatBytes(r.planned) : "–"),
    el("td", { class: "num" }, r.actual === null ? "transient" : formatBytes(r.actual))));
  return el("table", { class: "compact" },
    el("tr", {}, el("th", {}, "memory"), el("th", { class: "num" }, "planned"), el("th", { class: "num" }, "actual")),
    ...rows,
    el("tr", {}, el("td", {}, "budget / process RSS"),
      el("td", { class: "num" }, m.budget_bytes ? formatBytes(m.budget_bytes) : "by block count"),
      el("td", { class: "num" }, m.process_rss_bytes ? formatBytes(m.process_rss_bytes) : "–")),
    el("tr", {}, el("td", {}, "KV blocks"), el("td", { class: "num" }, num(m.planned_num_kv_blocks) || "–"),
      el("td", { class: "num" }, `${num(m.num_kv_blocks)} × ${formatBytes(m.kv_bytes_per_block)}`)));
}

function executorCard(e) {
  const b = e.batch, pc = e.prefix_cache;
  return el("div", { class: "panel", "data-executor": e.executor_id },
    el("h2", {}, `${e.executor_id} `, el("span", { class: "muted" },
      `${e.model} · ${e.role}${e.draining ? " · draining" : ""} · heartbeat ${secs(e.heartbeat_age_s)} ago`)),
    el("div", { class: "executor" },
      el("div", {}, el("h3", {}, "KV cache"), kvGauge(e.kv),
        el("h3", {}, "Prefix cache"),
        stat("hit rate", pct(pc.hit_rate)),
        stat("hits / queries (tokens)", `${num(pc.hits_tokens)} / ${num(pc.queries_tokens)}`)),
      el("div", {}, el("h3", {}, "Batch"),
        stat("running", num(b.num_running)), stat("waiting", num(b.num_waiting)),
        stat("preemptions", num(b.num_preemptions)),
        stat("tokens in last step", `${num(b.last_step_num_tokens)} (${num(b.last_step_num_seqs)} seqs)`),
        stat("tokens per step", num(b.tokens_per_step, 1)),
        stat("generated tokens/s", num(b.generated_tokens_per_s, 1)),
        stat("steps", num(b.num_steps)),
        stat("in flight (scheduler)", e.scheduler_view ? num(e.scheduler_view.num_in_flight) : "–")),
      el("div", {}, el("h3", {}, "Memory"), memoryTable(e.memory))));
}

function summary(state) {
  const s = state.scheduler, ix = state.prefix_index, g = state.gateway;
  const service = (name, st, text) => stat(name, st.available ? text : `down: ${st.error}`);
  return [
    el("h2", {}, "Stack"),
    el("div", { class: "executor" },
      el("div", {}, stat("gateway", `${g.instance}${g.draining ? " (draining)" : ""}`),
        stat("requests in flight here", num(g.num_in_flight)),
        stat("executors live", num(state.executors.length))),
      el("div", {}, service("scheduler queue", s, `${num(s.num_queued)} / ${num(s.max_queue_len)}`),
        service("routing", s, `${s.routing}${s.index_available ? "" : " (index unavailable)"}`),
        service("drain rate", s, `${num(s.drain_rate_per_s, 1)}/s`)),
      el("div", {}, service("prefix index entries", ix, num(ix.num_block_entries)),
        service("executors indexed", ix, num(ix.num_executors)),
        service("apply lag", ix, secs(ix.last_apply_lag_s)))),
  ];
}

function requestRow(r) {
  const short = r.request_id.replace(/^(chatcmpl|cmpl)-/, "").slice(0, 10);
  return el("tr", { "data-request": r.request_id },
    el("td", { title: r.request_id }, short), el("td", {}, r.endpoint),
    el("td", { class: `state-${r.state}` }, r.state), el("td", {}, r.holder),
    el("td", { class: "num" }, secs(r.ttft_s)),
    el("td", { class: "num" }, `${num(r.num_tokens)}${r.max_tokens ? ` / ${r.max_tokens}` : ""}`),
    el("td", { class: "num" }, secs(r.e2e_s ?? r.age_s)),
    el("td", {}, r.status === null ? "" : `${r.status}${r.finish_reason ? ` ${r.finish_reason}` : ""}`));
}

export function render(state) {
  $("stack-summary").replaceChildren(...summary(state));
  $("executors").replaceChildren(...state.executors.map(executorCard));
  if (!state.executors.length) $("executors").append(el("p", { class: "panel muted" }, "no executor heartbeat heard"));
  $("requests").tBodies[0].replaceChildren(...state.requests.map(requestRow));
}

export function startPolling(onState, onError) {
  let stopped = false;
  const tick = async () => {
    if (stopped) return;
    try { const state = await getJSON("/console/api/state"); render(state); onState(state); }
    catch (e) { onError(e); }
    setTimeout(tick, POLL_MS);
  };
  tick();
  return () => { stopped = true; };
}
