"""The browser console, served by the gateway:

    GET /console/                   the page (console/: plain HTML, CSS and JS modules, no build)
    GET /console/api/state          the live ledgers and recent requests (console_state.py)
    GET /console/api/plan/options   the planner form's choices
    GET /console/api/plan?memory=…  ``llmserve plan`` as JSON (shared/engine/plan_report.py)

The static files are public; the data endpoints need the API key when one is configured (the page
asks for it and sends ``Authorization: Bearer``), like /v1/*. The page itself talks to the real
API: /v1/chat/completions and /v1/completions, streamed.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles

from shared.engine.plan_report import KNOWN_MODEL_NAMES, KV_DTYPES, WEIGHT_DTYPES, plan_report
from shared.engine.quantization import QUANTIZATIONS
from shared.wire.messages import PrefixIndexStatus, SchedulerStatus

from .console_state import console_state
from .errors import APIError, bad_request
from .generation import Gateway

STATIC_DIR = Path(__file__).with_name("console")
DEFAULT_MODEL = "default"  # the planner's name for the bundled model (resolve_model(None))
_INT_FIELDS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "context")
# A number in a query string is bounded before it is parsed.
_MAX_DIGITS = 12


def register_console(app: FastAPI, gw: Gateway) -> None:
    # Routes before the mount: the mount would otherwise answer /console/api/* with 404.
    @app.get("/console/api/state")
    async def state(request: Request) -> dict[str, Any]:
        gw.authenticate(request.headers.get("authorization"))
        scheduler, index = await asyncio.gather(
            gw.scheduler_status(), gw.prefix_index_probe(), return_exceptions=True
        )
        return console_state(
            now=time.monotonic(),
            wall_time=time.time(),
            gateway={
                "instance": gw.metrics.instance,
                "num_in_flight": len(gw.streams),
                "draining": gw.draining.is_set(),
                "auth": len(gw.keys) > 0,
                "models": list(gw.config.model_names),
            },
            executors=gw.executors.live(time.monotonic()),
            scheduler=_answer(scheduler, SchedulerStatus),
            prefix_index=_answer(index, PrefixIndexStatus),
            requests=gw.request_log.newest_first(),
        )

    @app.get("/console/api/plan/options")
    async def plan_options(request: Request) -> dict[str, Any]:
        gw.authenticate(request.headers.get("authorization"))
        return {
            "models": [DEFAULT_MODEL, *KNOWN_MODEL_NAMES],
            "dtypes": list(WEIGHT_DTYPES),
            "kv_dtypes": list(KV_DTYPES),
            "quantizations": ["", *QUANTIZATIONS],
        }

    @app.get("/console/api/plan")
    async def plan(request: Request) -> dict[str, Any]:
        gw.authenticate(request.headers.get("authorization"))
        args = _plan_args(dict(request.query_params))
        try:
            # A GGUF header read for the default model: off the event loop.
            return await anyio.to_thread.run_sync(partial(plan_report, **args))
        except (ValueError, FileNotFoundError) as e:
            raise bad_request(str(e)) from None

    app.mount("/console", StaticFiles(directory=STATIC_DIR, html=True), name="console")


def _answer(answer: object, kind: type) -> Any:
    """A status for the state: itself, the error asking it met (as text), or None (none runs)."""
    if answer is None or isinstance(answer, kind):
        return answer
    if isinstance(answer, APIError):
        return answer.message
    if isinstance(answer, BaseException):
        raise answer
    return str(answer)


def _plan_args(query: dict[str, str]) -> dict[str, Any]:
    """The planner's arguments from a query string: a known model name only (never a path: the
    gateway opens no file a client names), bounded integers."""
    model = query.get("model", DEFAULT_MODEL) or DEFAULT_MODEL
    if model != DEFAULT_MODEL and model not in KNOWN_MODEL_NAMES:
        raise bad_request(
            f"unknown model {model!r}; choose one of {DEFAULT_MODEL}, "
            + ", ".join(KNOWN_MODEL_NAMES),
            "model",
        )
    memory = query.get("memory", "")
    if not memory or len(memory) > 32:
        raise bad_request("memory is required, e.g. 80GiB, 24GB, 512MiB", "memory")
    args: dict[str, Any] = {
        "model": None if model == DEFAULT_MODEL else model,
        "memory": memory,
        "dtype": query.get("dtype", "float16"),
        "kv_dtype": query.get("kv_dtype", "auto"),
        "quantization": query.get("quantization") or None,
    }
    if args["quantization"] not in (None, *QUANTIZATIONS):
        raise bad_request(f"unknown quantization {args['quantization']!r}", "quantization")
    for name in _INT_FIELDS:
        text = query.get(name, "")
        if not text:
            continue
        if len(text) > _MAX_DIGITS or not text.isdigit() or int(text) <= 0:
            raise bad_request(f"{name} must be a positive integer, got {text[:20]!r}", name)
        args[name] = int(text)
    return args
