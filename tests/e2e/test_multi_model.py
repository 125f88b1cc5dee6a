"""Two models served at once by one stack: the real SmolLM2 (GGUF) and a tiny random Llama saved as
a Hugging Face directory (its own byte-level vocabulary, chat template and 256-token context).

Through real HTTP, /v1/models lists both, each request is answered by its own model with exactly
the offline engine's greedy output for it (same settings: fp32, one thread, the same KV budget),
and each model's prompts are checked against its own context length. Requests to the two models
run concurrently; each model's run one at a time, so no fp32 batch effect can enter the
comparison."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from e2e_harness import Expected, Reference, scheduler_status

from helpers.tiny_llama import TINY_CONTEXT, save_tiny_llama
from services.served_models import ServedModel
from shared.engine.default_model import default_model_path

SMOL, TINY = "SmolLM2-135M-Instruct", "tiny-llama"
ENGINE = dict(dtype="float32", num_kv_blocks=96, max_num_seqs=4, num_threads=1)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 12


def ask(client: httpx.Client, model: str, **body: Any) -> dict[str, Any]:
    api = "chat/completions" if "messages" in body else "completions"
    r = client.post(
        f"/v1/{api}", json={"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def check(response: dict[str, Any], want: Expected, num_prompt_tokens: int) -> None:
    choice = response["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert (text, choice["finish_reason"]) == (want.text, want.finish_reason)
    assert response["usage"]["completion_tokens"] == want.num_tokens
    assert response["usage"]["prompt_tokens"] == num_prompt_tokens


@pytest.mark.timeout(420)
def test_two_models_each_answer_with_their_own_greedy_output(stack, tmp_path):
    smol_path, tiny_path = default_model_path(), save_tiny_llama(tmp_path / TINY, seed=3)
    # The references first, one model at a time, before the stack takes the cores.
    expected: dict[str, dict[str, tuple[Expected, int]]] = {}
    for name, path in ((SMOL, smol_path), (TINY, tiny_path)):
        ref = Reference(path, **ENGINE)
        expected[name] = {
            "prompt": (ref.greedy(MAX_TOKENS, prompt=PROMPT), len(ref.prompt_ids(prompt=PROMPT))),
            "chat": (ref.greedy(MAX_TOKENS, messages=CHAT), len(ref.prompt_ids(messages=CHAT))),
        }
        del ref
    # The models really differ, so a request that reached the other model's executor would show.
    assert expected[SMOL]["prompt"][0].text != expected[TINY]["prompt"][0].text

    s = stack(models=(ServedModel(SMOL, smol_path), ServedModel(TINY, tiny_path)), **ENGINE)
    assert sorted((e.executor_id, e.model) for e in scheduler_status(s).executors) == [
        ("executor-0", SMOL),
        ("executor-1", TINY),
    ]
    with httpx.Client(base_url=s.base_url, timeout=120) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [SMOL, TINY]
        for name in (SMOL, TINY):
            assert client.get(f"/v1/models/{name}").json()["id"] == name
        r = client.get("/v1/models/gpt-5")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        health = client.get("/health").json()
        assert health["models"] == {
            SMOL: {"num_executors": 1, "max_model_len": 8192},
            TINY: {"num_executors": 1, "max_model_len": TINY_CONTEXT},
        }

        def serve(name: str) -> None:
            want, num_prompt = expected[name]["prompt"]
            check(ask(client, name, prompt=PROMPT), want, num_prompt)
            want, num_prompt = expected[name]["chat"]
            check(ask(client, name, messages=CHAT), want, num_prompt)

        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(serve, name) for name in (SMOL, TINY)]:
                done.result()

        # Each model's own context: 300 byte tokens overflow the tiny model's 256, not SmolLM2's.
        long_prompt = "a " * 150
        assert ask(client, SMOL, prompt=long_prompt, max_tokens=1)["usage"]["prompt_tokens"] < 256
        r = client.post(
            "/v1/completions", json={"model": TINY, "prompt": long_prompt, "max_tokens": 1}
        )
        assert r.status_code == 400, r.text
        assert f"maximum context length is {TINY_CONTEXT} tokens" in r.json()["error"]["message"]
