import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main
from shared.engine.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_table(capsys):
    assert main(["plan", "--model", "llama-2-7b", "--memory", "80GiB", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "512 KiB" in out  # KV per token of Llama-2-7B in fp16
    assert "8,597" in out  # floor((80 GiB - 12.55 GiB weights - 287.5 MiB activations) / 8 MiB)
    assert "67  at context 2,048" in out  # 8,596 usable blocks // 128 blocks per request


def test_plan_json(capsys):
    argv = [
        "plan",
        "--model",
        "Llama-3-8B",
        "--memory",
        "24GB",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
        "--kv-dtype",
        "fp8",
        "--block-size",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "64",
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_budget_bytes"] == 24_000_000_000
    # the engine's fp8 rows: 2 x 32 layers x 8 KV heads x (128 e4m3 bytes + a 4-byte scale)
    assert data["kv_bytes_per_token"] == 67584 and data["kv_bytes_per_block"] == 32 * 67584
    assert data["weight_bytes"] == 2 * 8030261248
    assert (data["weight_dtype"], data["kv_dtype"], data["block_size"]) == ("bfloat16", "fp8", 32)
    assert data["num_usable_kv_blocks"] == data["num_kv_blocks"] - 1
    assert data["num_kv_tokens"] == data["num_usable_kv_blocks"] * 32
    assert data["max_concurrent_requests"] == data["num_usable_kv_blocks"] // 256
    assert 0 <= data["headroom_bytes"] < data["kv_bytes_per_block"]


def test_plan_with_int8_decoder_linears(capsys):
    argv = ["plan", "--model", "llama-2-7b", "--memory", "80GiB", "--context", "2048"]
    assert main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--quantization", "int8", "--json"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["quantization"] == "int8" and plain["quantization"] is None
    assert int8["weight_bytes"] == 7014686720  # see test_memory: 6.5 GiB, not 12.55
    assert int8["num_kv_blocks"] > plain["num_kv_blocks"]
    assert main([*argv, "--quantization", "int8"]) == 0
    assert "float16, int8 decoder linears]" in capsys.readouterr().out


def test_plan_with_gguf_decoder_linears(capsys):
    """The default file's Q4_1 blocks and Q8_0 head: the ledger holds the bytes the file's formats
    take (fewer than bf16's) and more KV blocks; a known name has no file to read formats from,
    and says so."""
    from shared.engine.memory import weight_bytes
    from shared.engine.models.known_configs import resolve_model

    argv = ["plan", "--memory", "1GiB", "--context", "2048"]
    assert main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--quantization", "gguf", "--json"]) == 0
    gguf = json.loads(capsys.readouterr().out)
    assert gguf["quantization"] == "gguf"
    model = resolve_model(None)
    assert gguf["weight_bytes"] == weight_bytes(
        model.config, "bfloat16", model.num_params, "gguf", model.gguf_formats, "q8_0"
    )
    assert gguf["weight_bytes"] < 0.6 * plain["weight_bytes"]
    assert gguf["num_kv_blocks"] > plain["num_kv_blocks"]
    assert main([*argv, "--quantization", "gguf"]) == 0
    assert "gguf decoder linears]" in capsys.readouterr().out
    assert (
        main(["plan", "--model", "llama-2-7b", "--memory", "80GiB", "--quantization", "gguf"]) != 0
    )
    assert "needs the block format of each decoder linear" in capsys.readouterr().err


def test_plan_with_the_int8_kv_cache(capsys):
    """int8 rows carry a 4-byte scale each: Llama-3-8B's 2 x 32 layers x 8 KV heads x (128 + 4)
    bytes."""
    argv = [
        "plan",
        "--model",
        "llama-3-8b",
        "--memory",
        "24GiB",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
        "--json",
    ]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--kv-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert (
        int8["kv_dtype"] == "int8"
        and int8["kv_bytes_per_token"] == 67584
        and plain["kv_bytes_per_token"] == 131072
    )
    remainder = plain["memory_budget_bytes"] - plain["weight_bytes"] - plain["activation_bytes"]
    assert int8["num_kv_blocks"] == remainder // (16 * 67584) and plain[
        "num_kv_blocks"
    ] == remainder // (16 * 131072)


def test_kv_dtype_auto_follows_dtype(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-3-70b",
                "--memory",
                "640GiB",
                "--dtype",
                "bfloat16",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["kv_dtype"] == "bfloat16" and data["kv_bytes_per_token"] == 327680
    assert data["context_len"] == 8192


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--model", "llama-3-70b", "--memory", "80GiB"], "below the minimum"),
        (["plan", "--model", "llama-2-7b", "--memory", "lots"], "cannot parse memory size"),
        (["plan", "--model", "llama-2-7b", "--memory", "80GiB", "--block-size", "0"], "block_size"),
    ],
)
def test_plan_user_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_no_command_prints_usage(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


def test_missing_model_path_subprocess(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "plan", "--model", str(missing), "--memory", "1GiB"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and str(missing) in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_plan_default_model_without_torch():
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    code = (
        "import sys; from services.cli import main; rc = main(['plan', '--memory', '2GiB', "
        "'--context', '2048', '--dtype', 'float32']); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "45 KiB" in proc.stdout  # 2 x 30 layers x 3 kv heads x 64 x 4 bytes = 46080
    assert "134,515,008 params" in proc.stdout
