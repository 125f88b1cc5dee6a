// The chat / completion playground over the real API: one request at a time, streamed or not,
// with the sampling parameters and a per-token logprobs view.

import { getJSON, postJSON, postStream } from "./api.js";
import { el, secs } from "./format.js";

const $ = (id) => document.getElementById(id);
let controller = null;

export async function loadModels() {
  const select = $("model");
  const { data } = await getJSON("/v1/models");
  const current = select.value;
  select.replaceChildren(...data.map((m) => el("option", { value: m.id }, m.id)));
  if (data.some((m) => m.id === current)) select.value = current;
}

function numberOrNull(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

export function buildBody() {
  const chat = $("api").value === "chat";
  const body = {
    model: $("model").value,
    temperature: numberOrNull("temperature"),
    top_p: numberOrNull("top_p"),
    top_k: numberOrNull("top_k"),
    max_tokens: numberOrNull("max_tokens"),
    seed: numberOrNull("seed"),
    stream: $("stream").checked,
  };
  const stops = $("stop").value.split("|").map((s) => s).filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const top = numberOrNull("top_logprobs") ?? 0;
  if (chat) {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    messages.push({ role: "user", content: $("prompt").value });
    body.messages = messages;
    if ($("logprobs").checked) { body.logprobs = true; body.top_logprobs = top; }
  } else {
    body.prompt = $("prompt").value;
    if ($("logprobs").checked) body.logprobs = top;
  }
  if (body.stream) body.stream_options = { include_usage: true };
  for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
  return body;
}

// Every token's {token, logprob, top: [[token, logprob], ...]} from a choice's logprobs, in
// either API's shape (chat: content entries; completions: parallel lists, or a list of them).
export function tokenLogprobs(logprobs) {
  if (!logprobs) return [];
  if (Array.isArray(logprobs)) return logprobs.flatMap(tokenLogprobs);
  if (logprobs.content) {
    return logprobs.content.map((e) => ({
      token: e.token, logprob: e.logprob,
      top: (e.top_logprobs ?? []).map((t) => [t.token, t.logprob]),
    }));
  }
  return (logprobs.tokens ?? []).map((token, i) => ({
    token, logprob: logprobs.token_logprobs[i],
    top: Object.entries(logprobs.top_logprobs?.[i] ?? {}).sort((a, b) => b[1] - a[1]),
  }));
}

function colour(logprob) {
  // Sure tokens stay dark; unlikely ones glow red: p = e^logprob.
  const p = Math.exp(logprob);
  return `background: rgba(255, 107, 107, ${(0.65 * (1 - p)).toFixed(2)})`;
}

function showAlternatives(entry, chip) {
  document.querySelectorAll(".tok.sel").forEach((n) => n.classList.remove("sel"));
  chip.classList.add("sel");
  const rows = [el("tr", {}, el("th", {}, "token"), el("th", { class: "num" }, "logprob"),
    el("th", { class: "num" }, "p"))];
  const seen = new Set();
  for (const [token, lp] of [[entry.token, entry.logprob], ...entry.top]) {
    if (seen.has(token)) continue;
    seen.add(token);
    rows.push(el("tr", { class: token === entry.token ? "state-streaming" : "" },
      el("td", {}, JSON.stringify(token)), el("td", { class: "num" }, lp.toFixed(3)),
      el("td", { class: "num" }, `${(100 * Math.exp(lp)).toFixed(1)}%`)));
  }
  $("alternatives").tBodies[0].replaceChildren(...rows);
}

function addTokens(entries) {
  const box = $("tokens");
  for (const entry of entries) {
    const chip = el("span", {
      class: "tok", style: colour(entry.logprob),
      title: `${entry.logprob.toFixed(3)}  |  ${entry.top.map(([t, p]) => `${JSON.stringify(t)} ${p.toFixed(2)}`).join("  ")}`,
    }, entry.token);
    chip.addEventListener("mouseenter", () => showAlternatives(entry, chip));
    chip.addEventListener("click", () => showAlternatives(entry, chip));
    box.append(chip);
  }
}

function textOf(choice, chat) {
  if (!choice) return "";
  if (!chat) return choice.text ?? "";
  return (choice.delta ?? choice.message)?.content ?? "";
}

async function send(event) {
  event.preventDefault();
  const chat = $("api").value === "chat";
  const path = chat ? "/v1/chat/completions" : "/v1/completions";
  const body = buildBody();
  $("output").textContent = "";
  $("gen-error").textContent = "";
  $("tokens").replaceChildren();
  $("alternatives").tBodies[0].replaceChildren();
  $("send").disabled = true;
  $("stop-gen").disabled = false;
  controller = new AbortController();
  const t0 = performance.now();
  let ttft = null, numChunks = 0, usage = null, finish = null;
  const stats = () => {
    const elapsed = (performance.now() - t0) / 1000;
    $("gen-stats").textContent = [
      `TTFT ${ttft === null ? "–" : secs(ttft)}`,
      `${usage?.completion_tokens ?? numChunks} tokens`,
      `${secs(elapsed)}`,
      finish ? `finish: ${finish}` : "",
    ].filter(Boolean).join(" · ");
  };
  try {
    if (body.stream) {
      await postStream(path, body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (!choice) return;
        const text = textOf(choice, chat);
        const entries = tokenLogprobs(choice.logprobs);
        if (text || entries.length) {
          if (ttft === null) ttft = (performance.now() - t0) / 1000;
          numChunks += Math.max(entries.length, 1);
        }
        $("output").textContent += text;
        addTokens(entries);
        if (choice.finish_reason) finish = choice.finish_reason;
        stats();
      }, controller.signal);
    } else {
      const resp = await postJSON(path, body, controller.signal);
      const choice = resp.choices[0];
      usage = resp.usage;
      finish = choice.finish_reason;
      $("output").textContent = textOf(choice, chat);
      addTokens(tokenLogprobs(choice.logprobs));
    }
  } catch (e) {
    if (e.name !== "AbortError") $("gen-error").textContent = e.message;
  } finally {
    stats();
    $("send").disabled = false;
    $("stop-gen").disabled = true;
    controller = null;
  }
}

export function initPlayground() {
  $("gen-form").addEventListener("submit", send);
  $("stop-gen").addEventListener("click", () => controller?.abort());
  const syncApi = () => { $("system-row").style.display = $("api").value === "chat" ? "" : "none"; };
  $("api").addEventListener("change", syncApi);
  syncApi();
}
