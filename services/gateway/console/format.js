// Display helpers. formatBytes is shared/engine/memory.py's format_bytes: binary units, at most
// two decimals, trailing zeros dropped.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const sign = n < 0 ? "-" : "";
  let value = Math.abs(n), unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) { value /= 1024; unit += 1; }
  const text = value.toFixed(2).replace(/0+$/, "").replace(/\.$/, "");
  return `${sign}${text} ${UNITS[unit]}`;
}

export const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
export const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? `${Math.round(1000 * s)} ms` : `${s.toFixed(2)} s`);
export const num = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US", { maximumFractionDigits: digits }));

// An element: el("td", {class: "num"}, "text", child, ...). Text is set as text, never as HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}
