"""GET /health from what the gateway learnt: per dependency and per model. Pure module: no I/O.

Dependencies, each "ok" or what is wrong with it: ``nats`` (the gateway's own connection),
``tokenizer`` and ``scheduler`` (they answer their status request), ``executors`` (the scheduler
sees a live one), ``prefix_index`` ("none": no replica runs) and ``redis`` (as the index sees it).
The first four are needed to serve: any of them down is a 503 naming it, with Retry-After. The
index and Redis only make routing smarter: without them the stack serves (routing by load), so
/health stays 200 and says so.

A stack may serve several models; /health is 200 once any executor is live (a load balancer's
question: can this gateway serve at all?), so it also says, for each model, whether requests for it
can be served now: how many live executors serve it (from the scheduler) and the context length
the tokenizer checks its prompts against (from the tokenizer; null when no tokenizer serves it, so
its requests would end with 404). It also names every live executor, prefill ones included
(``executor_ids``): ``llmserve up`` is ready once each executor it started is among them and
every model it serves has a context length.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from shared.wire.messages import (
    ExecutorStatus,
    PrefixIndexStatus,
    SchedulerStatus,
    TokenizerStatus,
)

OK = "ok"
DOWN = "down"


def _serving(scheduler: SchedulerStatus) -> list[ExecutorStatus]:
    """The executors a whole request may go to: prefill ones alone serve nothing."""
    return [e for e in scheduler.executors if e.role != "prefill"]


def model_health(
    configured: Sequence[str], scheduler: SchedulerStatus, tokenizer: TokenizerStatus
) -> dict[str, dict[str, Any]]:
    """name → {"num_executors", "max_model_len"} for every model configured at the gateway, served
    by a live executor or known to the tokenizer, in name order."""
    num_executors = Counter(e.model for e in _serving(scheduler))
    context = {m.name: m.max_model_len for m in tokenizer.models}
    names = sorted({*configured, *num_executors, *context})
    return {
        name: {"num_executors": num_executors.get(name, 0), "max_model_len": context.get(name)}
        for name in names
    }


def health_report(
    configured: Sequence[str],
    scheduler: SchedulerStatus | BaseException,
    tokenizer: TokenizerStatus | BaseException,
    index: PrefixIndexStatus | BaseException | None,
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) once NATS is up. Each answer is the service's status or the error that
    asking it raised (its message becomes the reason); ``index`` None: no index replica runs. The
    scheduler's failure is the reason given when several fail."""
    deps: dict[str, str] = {
        "nats": OK,
        "scheduler": OK if isinstance(scheduler, SchedulerStatus) else DOWN,
        "tokenizer": OK if isinstance(tokenizer, TokenizerStatus) else DOWN,
        "executors": DOWN,
        "prefix_index": "none"
        if index is None
        else OK
        if isinstance(index, PrefixIndexStatus)
        else DOWN,
        "redis": "unknown",
    }
    if isinstance(index, PrefixIndexStatus):
        deps["redis"] = OK if index.redis_ok else DOWN
    for answer in (scheduler, tokenizer):
        if isinstance(answer, BaseException):
            return 503, {
                "status": "unavailable",
                "reason": str(_message(answer)),
                "dependencies": deps,
            }
    assert isinstance(scheduler, SchedulerStatus) and isinstance(tokenizer, TokenizerStatus)
    if not _serving(scheduler):
        return 503, {"status": "unavailable", "reason": "no live executor", "dependencies": deps}
    deps["executors"] = OK
    return 200, {
        "status": "ok",
        "num_executors": len(_serving(scheduler)),
        "num_prefill_executors": len(scheduler.executors) - len(_serving(scheduler)),
        "executor_ids": sorted(e.executor_id for e in scheduler.executors),
        "num_queued": scheduler.num_queued,
        "dependencies": deps,
        "models": model_health(configured, scheduler, tokenizer),
    }


def nats_down_report(detail: str) -> dict[str, Any]:
    """The body of the 503 while the gateway has no NATS connection: nothing else can be asked."""
    return {
        "status": "unavailable",
        "reason": f"NATS is unreachable from the gateway ({detail})",
        "dependencies": {"nats": DOWN},
    }


def _message(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error)
