"""bench_engine's printed report of a run's results (the JSON it writes holds the same)."""

from __future__ import annotations

import os
from typing import Any

from loadtests.engine_mix import MIX_MODES


def print_ceiling(c: dict[str, Any], hf_runs: list[dict[str, Any]]) -> None:
    if "skipped" in c:
        print(f"    ceiling: not computed ({c['skipped']})")
        return
    f = c["flops"]
    peaks = f"bf16 {c['bf16_peak_gflops']:.0f} GFLOP/s" + (
        f", int8 {c['int8_peak_gops']:.0f} GOPS" if c["int8_peak_gops"] else ""
    )
    versus = "".join(
        f", {c['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x transformers {hf['dtype']}"
        for hf in hf_runs
    )
    print(
        f"    ceiling: the run's {sum(f.values()) / 1e12:.2f} TFLOP "
        f"(decoder linears {f['decoder_linears'] / 1e12:.2f}, "
        f"lm_head {f['lm_head'] / 1e12:.2f}, attention {f['attention'] / 1e12:.2f})\n"
        f"    take >= {c['seconds']:.2f} s at this host's measured peak "
        f"({peaks}; python -m loadtests.ceiling):\n"
        f"    at most {c['output_tokens_per_s']:.0f} output tok/s{versus}; "
        f"the best engine run reached {100 * c['best_fraction']:.0f}% of it"
    )


def print_report(res: dict[str, Any]) -> None:
    line = "-" * 96
    print(line)
    print(
        f"bench_engine  model={os.path.basename(res['config']['model'])}  "
        f"dtype={res['config']['dtype']}  "
        f"quantization={res['config'].get('quantization')}  "
        f"kv_cache_dtype={res['config'].get('kv_cache_dtype', 'auto')}  "
        f"threads={res['config']['threads']}\n"
        f"  OMP_WAIT_POLICY={res['env']['omp_wait_policy']}  "
        f"malloc_tuned={res['env']['malloc_tuned']}  "
        f"repeats={res['config']['repeats']} (best kept)  "
        f"load avg start/end={res['env']['load_avg_start']}"
        f"/{res['env']['load_avg_end']}  total {res['env']['total_s']:.0f}s\n  engine at commit "
        f"{res['env']['commit']}"
        + (
            f" + uncommitted changes to {res['env']['engine_modified_files']}"
            if res["env"]["engine_modified_files"]
            else ""
        )
    )
    a = res.get("offline")
    if a:
        print(line)
        print(
            f"(a) offline throughput: {a['num_prompts']} prompts, {a['prompt_len_range'][0]}-"
            f"{a['prompt_len_range'][1]} tokens ({a['num_prompt_tokens']} total), "
            f"{a['output_len']} greedy output tokens each"
        )
        print(
            f"    {'system':<44}{'output tok/s':>13}{'elapsed s':>10}{'steps':>7}{'prefill s':>10}"
            f"{'decode tok/s':>13}{'tok/CPU-s':>11}"
        )
        for r in a["engine"]["runs"]:
            name = (
                f"llmserve LLM.generate mbt={r['max_num_batched_tokens']} seqs={r['max_num_seqs']}"
            )
            if (
                len(
                    [
                        x
                        for x in a["engine"]["runs"]
                        if x["max_num_batched_tokens"] == r["max_num_batched_tokens"]
                    ]
                )
                > 1
            ):
                name += f" #{r['repeat'] + 1}"
            print(
                f"    {name:<44}{r['output_tokens_per_s']:>13.1f}{r['elapsed_s']:>10.1f}"
                f"{r['num_steps']:>7}"
                f"{r['prefill_phase_s']:>10.1f}{r['decode_phase_tokens_per_s']:>13.1f}"
                f"{r['output_tokens_per_cpu_s']:>11.1f}"
            )
        hf_runs = a.get("hf_runs")
        if hf_runs:
            for hf in hf_runs:
                dec = hf["decode_phase_tokens_per_s"]
                name = f"transformers generate {hf['dtype']} (batched)"
                print(
                    f"    {name:<44}{hf['output_tokens_per_s']:>13.1f}"
                    f"{hf['elapsed_s']:>10.1f}{hf['new_tokens_per_prompt']:>7}"
                    f"{hf['prefill_phase_s']:>10.1f}"
                    f"{dec if dec is None else format(dec, '.1f'):>13}"
                    f"{hf['output_tokens_per_cpu_s']:>11.1f}"
                )
            print(
                "    (prefill s: until every prompt is computed; "
                "decode tok/s: output tokens after that / time;\n"
                "     tok/CPU-s: output tokens per second of this process's CPU time, "
                "less sensitive to neighbours)"
            )
            engine = res["config"]["dtype"] + (" int8" if res["config"].get("quantization") else "")
            kv = res["config"].get("kv_cache_dtype", "auto")
            engine += f", {kv} KV" if kv != "auto" else ""
            for hf in hf_runs:
                print(f"    transformers {hf['dtype']} measured: {hf['measured']}")
                print(
                    "    ratio best engine "
                    f"(mbt={a['engine']['best']['max_num_batched_tokens']}, {engine}) / "
                    f"transformers {hf['dtype']} = {hf['ratio']:.2f}x wall, "
                    f"{hf['cpu_ratio']:.2f}x per CPU-second   (target >= 8x)"
                )
            ag = a["agreement"]
            print(
                f"    greedy agreement with transformers {hf_runs[0]['dtype']} over "
                f"{ag['tokens_compared']} tokens: {ag['identical_prompts']}/"
                f"{ag['num_prompts']} identical, median common prefix {ag['median_common_prefix']}"
            )
        else:
            print("    transformers baseline skipped")
        print_ceiling(a["ceiling"], hf_runs or [])
    b = res.get("mix")
    if b:
        t = b["trace"]
        print(line)
        print(
            f"(b) continuous vs static batching: {t['num_requests']} requests ({t['num_long']} x "
            f"{t['long_tokens']} + {t['num_requests'] - t['num_long']} x {t['short_tokens']} "
            f"output tokens), prompts {t['prompt_len_range'][0]}-{t['prompt_len_range'][1]}, "
            f"B=max_num_seqs={t['batch_size']}"
        )
        print(
            f"    {'mode':<14}{'output tok/s':>14}{'elapsed s':>12}{'steps':>8}{'mean E2E s':>12}"
            f"{'short E2E':>11}{'long E2E':>10}{'tok/CPU-s':>11}"
        )
        for mode in MIX_MODES:
            r = b[mode]
            print(
                f"    {mode:<14}{r['output_tokens_per_s']:>14.1f}{r['elapsed_s']:>12.1f}"
                f"{r['num_steps']:>8}"
                f"{r['mean_e2e_s']:>12.1f}{r['mean_e2e_short_s']:>11.1f}{r['mean_e2e_long_s']:>10.1f}"
                f"{r['output_tokens_per_cpu_s']:>11.1f}"
            )
        for key, name in (("", "static"), ("padded_", "static_padded")):
            print(
                f"    ratio continuous / {name} = {b[key + 'throughput_ratio']:.2f}x wall, "
                f"{b[key + 'cpu_throughput_ratio']:.2f}x per CPU-second   (target >= 2x)"
            )
        if len(b["continuous"]["all_output_tokens_per_s"]) > 1:
            print(
                "    all runs tok/s: "
                + ", ".join(
                    f"{mode} {[round(x, 1) for x in b[mode]['all_output_tokens_per_s']]}"
                    for mode in MIX_MODES
                )
            )
        print(
            "    per step: "
            + ", ".join(
                f"{mode} {1000 * r['elapsed_s'] / r['num_steps']:.0f} ms"
                + (
                    f" ({r['num_steps'] / b['continuous']['num_steps']:.2f}x the steps)"
                    if mode != "continuous"
                    else ""
                )
                for mode in MIX_MODES
                for r in [b[mode]]
            )
        )
        print(line)
        kv = b["continuous"]["kv"]
        print(
            "(c) KV utilization, live tokens / reserved slots, continuous run of (b), "
            f"{kv['num_steps']} steps "
            f"(block_size={t['block_size']}, max_model_len={t['max_model_len']})"
        )
        print(
            f"    {'scheme':<34}{'step mean':>10}{'weighted':>10}{'min':>8}{'@peak':>8}"
            f"{'peak slots':>12}{'x paged':>9}"
        )
        rows = [("paged (block manager)", kv["paged"])] + [
            (f"contiguous: {name}", s) for name, s in kv["contiguous"].items()
        ]
        for name, s in rows:
            print(
                f"    {name:<34}{100 * s['util_step_mean']:>9.1f}%"
                f"{100 * s['util_slot_weighted']:>9.1f}%"
                f"{100 * s['util_min']:>7.1f}%{100 * s['util_at_peak_reserved']:>7.1f}%"
                f"{s['peak_reserved_slots']:>12}{s.get('mean_reserved_vs_paged', 1.0):>8.2f}x"
            )
        print(
            f"    peak live tokens {kv['peak_live_tokens']}; paged target >= 90% "
            "(static run: paged step mean "
            f"{100 * b['static']['kv']['paged']['util_step_mean']:.1f}%)"
        )
    pr = res.get("profile")
    if pr:
        print(line)
        for phase in ("prefill", "decode"):
            ph = pr[phase]
            print(
                f"profile {phase}: {ph['ms_per_step']:.0f} ms/step, "
                f"tokens/step {ph['tokens_per_step']}, "
                f"cProfile step {ph['cprofile_step_ms']:.0f} ms"
            )
            print(
                "    step breakdown (cProfile cumulative, ms): "
                + ", ".join(f"{k}={v:.0f}" for k, v in ph["breakdown_ms"].items())
            )
            for op in ph["top_ops"][:10]:
                print(
                    f"    {op['op']:<44}{op['calls']:>7}{op['self_ms_per_step']:>10.1f} ms/step"
                    f"{op['self_pct']:>7.1f}%"
                )
        if pr.get("decode_scaling"):
            print(
                "decode-only scaling (ms/step -> output tok/s): "
                + ", ".join(
                    f"B={r['batch']}: {r['ms_per_step']:.0f} -> {r['output_tokens_per_s']:.0f}"
                    for r in pr["decode_scaling"]
                )
                + f" (context {pr['decode_scaling'][0]['context']})"
            )
    print(line)
