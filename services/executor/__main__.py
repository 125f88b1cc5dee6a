"""``python -m services.executor``: one engine (role 'both') serving ExecuteRequests over NATS."""

from __future__ import annotations

import gc
import logging
import os
import sys

from services.executor.config import parse_config
from services.runtime import run_service, setup_logging
from shared.engine.quantization import kv_dtype_name
from shared.tracing import tracing_configured

log = logging.getLogger("llmserve.executor")


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    engine_config = config.engine
    if config.cpus:
        # Before torch starts its threads: they inherit the mask, so a prefill and a decode
        # executor pinned to different cores never compete for one.
        os.sched_setaffinity(0, config.cpus)
    if engine_config.num_threads:
        # Before torch is imported: OpenMP reads it once, for every thread it creates.
        os.environ["OMP_NUM_THREADS"] = str(engine_config.num_threads)
    setup_logging("executor")
    from services.executor.memory_status import memory_status
    from services.executor.service import ExecutorService, ExecutorServiceConfig
    from services.executor.worker import EngineWorker, build_on_passing_thread
    from shared.wire.bus import Bus

    record_steps = tracing_configured()  # the engine's step records become spans
    memory = None
    if config.mock_step_ms is not None:
        from shared.engine.mock import MockEngine

        model_name = config.model_name or "mock"
        mock = MockEngine(
            model_name=model_name,
            step_ms=config.mock_step_ms,
            max_num_seqs=engine_config.max_num_seqs,
            max_model_len=engine_config.max_model_len or 2048,
            block_size=engine_config.block_size,
            num_blocks=engine_config.num_kv_blocks or 1024,
        )
        worker = EngineWorker(mock, kv_events=config.kv_events)
        max_model_len = mock.max_model_len
        log.info("%s: a mock engine, %g ms a step, no model", config.executor_id, mock.step_ms)
    else:
        from shared.engine.engine import Engine

        log.info(
            "%s: role %s, loading the model%s...",
            config.executor_id,
            config.role,
            f" (pinned to cores {list(config.cpus)})" if config.cpus else "",
        )
        engine = build_on_passing_thread(lambda: Engine(engine_config))
        # What loading made (the GGUF reader's fields, the tokenizer's tables: hundreds of
        # thousands of objects) lives as long as the process. Frozen, it is out of the cyclic
        # collector's reach: a full collection while serving walks only what serving made, instead
        # of all of it with the GIL held, a stall of every stream's next token.
        gc.freeze()
        memory = memory_status(engine)
        max_model_len = engine.max_model_len
        model_name = config.model_name or engine.model_name
        worker = EngineWorker(
            engine,
            num_threads=engine_config.num_threads,
            kv_events=config.kv_events,
            record_steps=record_steps,
        )
        log.info(
            "%s: %s loaded, %d KV blocks of %d tokens (%s), max_model_len %d",
            config.executor_id,
            engine.model_name,
            engine.stats().num_total_blocks,
            engine_config.block_size,
            kv_dtype_name(engine_config.kv_cache_dtype, engine_config.dtype),
            max_model_len,
        )
    service_config = ExecutorServiceConfig(
        executor_id=config.executor_id,
        model_name=model_name,
        max_model_len=max_model_len,
        block_size=engine_config.block_size,
        max_num_seqs=engine_config.max_num_seqs,
        max_queued=config.max_queued,
        heartbeat_interval_s=config.heartbeat_interval_s,
        drain_timeout_s=config.drain_timeout_s,
        role=config.role,
        kv_transfer_timeout_s=config.kv_transfer_timeout_s,
    )

    async def serve(stop) -> None:
        bus = await Bus.connect(config.nats_url, config.executor_id, auth=config.bus_auth)
        service = ExecutorService(bus, worker, service_config, memory=memory)
        await service.start()
        log.info("%s ready (epoch %s)", config.executor_id, service.epoch)
        await stop.wait()
        await service.drain()
        await bus.drain()

    return run_service("executor", serve)


if __name__ == "__main__":
    sys.exit(main())
