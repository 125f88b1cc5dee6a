// The capacity planner: `llmserve plan` as a form, computed by the gateway with the very function
// the command uses (shared/engine/plan_report.py), drawn as a bar and a table.

import { getJSON } from "./api.js";
import { el, formatBytes, num } from "./format.js";

const $ = (id) => document.getElementById(id);

function fill(select, values, chosen) {
  select.replaceChildren(...values.map((v) => el("option", { value: v }, v || "none")));
  if (chosen !== undefined) select.value = chosen;
}

export async function loadPlanOptions() {
  const o = await getJSON("/console/api/plan/options");
  fill($("plan-model"), o.models, "default");
  fill($("plan-dtype"), o.dtypes, "float16");
  fill($("plan-kv-dtype"), o.kv_dtypes, "auto");
  fill($("plan-quantization"), o.quantizations, "");
}

// Prefill the form from a live executor's settings, once, so the first plan is the stack's own.
let prefilled = false;
export function prefillFrom(state) {
  const e = state.executors.find((x) => x.memory?.budget_bytes);
  if (prefilled || !e) return false;
  prefilled = true;
  const m = e.memory;
  const choose = (id, value) => {
    if ([...$(id).options].some((o) => o.value === value)) $(id).value = value;
  };
  $("plan-memory").value = String(m.budget_bytes);
  choose("plan-dtype", m.weight_dtype);
  choose("plan-kv-dtype", m.kv_dtype === m.weight_dtype ? "auto" : m.kv_dtype);
  $("plan-block-size").value = String(e.block_size);
  $("plan-context").value = String(e.max_model_len);
  if (e.max_num_seqs) $("plan-seqs").value = String(e.max_num_seqs);
  if (m.max_num_batched_tokens) $("plan-batched").value = String(m.max_num_batched_tokens);
  return true;
}

function query() {
  const q = new URLSearchParams({
    model: $("plan-model").value, memory: $("plan-memory").value, dtype: $("plan-dtype").value,
    kv_dtype: $("plan-kv-dtype").value, quantization: $("plan-quantization").value,
    block_size: $("plan-block-size").value, max_num_batched_tokens: $("plan-batched").value,
    max_num_seqs: $("plan-seqs").value,
  });
  if ($("plan-context").value) q.set("context", $("plan-context").value);
  return q;
}

function bar(p) {
  const total = Math.max(p.memory_budget_bytes, 1);
  const seg = (cls, label, bytes) => el("div", {
    class: cls, style: `width: ${(100 * bytes) / total}%`, title: `${label}: ${formatBytes(bytes)}`,
  }, label);
  return [seg("seg-weights", "weights", p.weight_bytes), seg("seg-activations", "activations", p.activation_bytes),
    seg("seg-kv", "kv cache", p.kv_cache_bytes), seg("seg-headroom", "", p.headroom_bytes)];
}

// Plans may be asked for faster than they come back (the first with the form's defaults, the next
// once a live executor prefills it): only the latest one asked for is drawn.
let latest = 0;

export async function plan(event) {
  event?.preventDefault();
  const asked = ++latest;
  $("plan-error").textContent = "";
  try {
    const p = await getJSON(`/console/api/plan?${query()}`);
    if (asked !== latest) return;
    const share = (b) => `${formatBytes(b)} (${((100 * b) / Math.max(p.memory_budget_bytes, 1)).toFixed(1)}%)`;
    const rows = [
      ["model", `${p.model} — ${p.shape.num_layers} layers, hidden ${p.shape.hidden_size}, ${p.shape.num_heads} heads, ${p.shape.num_kv_heads} kv heads × ${p.shape.head_dim}`],
      ["budget", formatBytes(p.memory_budget_bytes)],
      ["weights", `${share(p.weight_bytes)} [${num(p.num_params)} params, ${p.weight_dtype}${p.quantization ? `, ${p.quantization}` : ""}]`],
      ["activations", `${share(p.activation_bytes)} [${p.max_num_batched_tokens} batched tokens, ${p.max_num_seqs} seqs]`],
      ["kv cache", `${share(p.kv_cache_bytes)} [${p.kv_dtype}]`],
      ["kv per token", formatBytes(p.kv_bytes_per_token)],
      ["kv per block", `${formatBytes(p.kv_bytes_per_block)} [${p.block_size} tokens]`],
      ["kv blocks", `${num(p.num_kv_blocks)} (block 0 is padding: ${num(p.num_usable_kv_blocks)} usable)`],
      ["kv tokens", num(p.num_kv_tokens)],
      ["concurrent requests", `${num(p.max_concurrent_requests)} at context ${num(p.context_len)}`],
      ["headroom", formatBytes(p.headroom_bytes)],
      ...p.notes.map((n) => ["note", n]),
    ];
    $("plan-bar").replaceChildren(...bar(p));
    $("plan-table").tBodies[0].replaceChildren(...rows.map(([k, v]) =>
      el("tr", { "data-row": k }, el("th", {}, k), el("td", {}, v))));
  } catch (e) {
    if (asked === latest) $("plan-error").textContent = e.message;
  }
}

export function initPlanner() {
  $("plan-form").addEventListener("submit", plan);
}
