// The console's entry: tabs, the API key, and who loads what when.

import { ApiError, setKey } from "./api.js";
import { startPolling } from "./ledgers.js";
import { initPlanner, loadPlanOptions, plan, prefillFrom } from "./planner.js";
import { initPlayground, loadModels } from "./playground.js";

const $ = (id) => document.getElementById(id);

function connection(ok, text) {
  $("conn").textContent = text;
  $("conn").className = `pill ${ok ? "ok" : "bad"}`;
}

async function loadAll() {
  try {
    await Promise.all([loadModels(), loadPlanOptions()]);
  } catch (e) {
    connection(false, e instanceof ApiError && e.status === 401 ? "API key needed" : e.message);
    if (e.status === 401) $("api-key").focus();
    return;
  }
  plan();
}

function init() {
  for (const button of document.querySelectorAll("nav button")) {
    button.addEventListener("click", () => {
      document.querySelectorAll("nav button, .tab").forEach((n) => n.classList.remove("active"));
      button.classList.add("active");
      $(button.dataset.tab).classList.add("active");
    });
  }
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setKey($("api-key").value.trim());
    $("api-key").value = "";
    loadAll();
  });
  initPlayground();
  initPlanner();
  loadAll();
  startPolling(
    (state) => { connection(true, `${state.executors.length} executor(s) live`); if (prefillFrom(state)) plan(); },
    (e) => connection(false, e instanceof ApiError && e.status === 401 ? "API key needed" : `state: ${e.message}`),
  );
}

init();
