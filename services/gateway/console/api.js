// The gateway's API as the console uses it: the key (kept for this tab only), JSON calls, and
// SSE streams read from fetch (EventSource cannot POST nor send an Authorization header).

const KEY = "llmserve.apiKey";

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function failure(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try { message = (await resp.json()).error?.message ?? message; } catch { /* not JSON */ }
  return new ApiError(resp.status, message);
}

export async function getJSON(path) {
  const resp = await fetch(path, { headers: headers() });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

export async function postJSON(path, body, signal) {
  const resp = await fetch(path, {
    method: "POST", signal, body: JSON.stringify(body),
    headers: headers({ "Content-Type": "application/json" }),
  });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

// POST ``body`` and call onChunk(object) for each `data:` event until [DONE]. An error event
// (the server's, after the first byte) is thrown as an ApiError.
export async function postStream(path, body, onChunk, signal) {
  const resp = await fetch(path, {
    method: "POST", signal, body: JSON.stringify(body),
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
  });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(obj.error.code ?? 500, obj.error.message);
        onChunk(obj);
      }
    }
  }
}
