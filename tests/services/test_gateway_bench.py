"""loadtests/bench_serving.py against the real gateway process and the fake backend: every request
completes with exactly --output-len tokens, and the report has every metric."""

from __future__ import annotations

import json

from helpers.gateway_harness import FAKE_MODEL, FakeBackend, GatewayProcess
from loadtests import bench_serving


def test_bench_serving_against_the_gateway(nats_server, tmp_path, capsys):
    backend = FakeBackend(nats_server.url).start()
    gw = GatewayProcess(nats_server.url, api_key="bench-key")
    try:
        out = tmp_path / "serving.json"
        for extra in (["--concurrency", "4"], ["--request-rate", "50", "--endpoint", "chat"]):
            rc = bench_serving.main(
                [
                    "--base-url",
                    gw.base_url,
                    "--api-key",
                    "bench-key",
                    "--num-prompts",
                    "12",
                    "--input-len",
                    "16",
                    "--output-len",
                    "5",
                    "--out",
                    str(out),
                    "--save-requests",
                    *extra,
                ]
            )
            assert rc == 0
            s = json.loads(out.read_text())
            assert s["model"] == FAKE_MODEL and s["num_completed"] == 12 and s["num_failed"] == 0
            assert s["total_output_tokens"] == 12 * 5
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                assert set(s[key]) == {"mean", "median", "p99"} and s[key]["mean"] > 0
            assert all(len(r["itl_s"]) == 4 for r in s["requests"])
            assert s["request_throughput_rps"] > 0 and s["output_throughput_tps"] > 0
        assert "TTFT" in capsys.readouterr().out
        sent = list(backend.requests.values())[-1]
        assert sent.params.ignore_eos and sent.params.max_tokens == 5 and sent.messages
    finally:
        gw.stop()
        backend.stop()


def test_percentile_matches_numpy_definition():
    assert bench_serving.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench_serving.percentile([5], 99) == 5
    assert abs(bench_serving.percentile(list(range(101)), 99) - 99) < 1e-9
