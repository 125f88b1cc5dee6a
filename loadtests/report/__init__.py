"""``llmserve bench report``: the ablation study run on this host, written as one HTML file.

One module per claim. Each measured section has ``measure(params, log) -> dict`` (the raw JSON,
written beside the report before anything is drawn from it) and ``build(raw) -> Section`` (pure: the
tables, figures and one-line reading come only from that JSON, so every number in the report can be
traced to a file). Sections for what the engine does not have yet come from ``absent.py`` and say
so; they never show a number.

    model.py     Section / Figure / Table: what a section holds (pure)
    html.py      the HTML writer (pure but for writing the files)
    plots.py     a Figure drawn as inline SVG with matplotlib
    host.py      the host's description (CPU, ISA level, cores, memory, torch, load)
    plan.py      quick / full parameters and the expected duration (pure)
    ledger.py    the memory ledger against 2 x layers x kv_heads x head_dim x bytes (pure)
    mix.py       the mixed trace of bench_engine (b)/(c): measured once, read by the next two
    batching.py  continuous vs static batching
    paged_kv.py  paged KV vs contiguous reservation
    prefix.py    prefix caching on vs off
    quantization.py  bf16 / int8 weights and auto / int8 KV: speed, memory, perplexity
    serving.py   throughput and latency vs concurrency, with this host's ceiling
    disagg.py    prefill/decode disaggregation vs aggregated executors (two stacks)
    absent.py    speculative decoding
    runner.py    runs the sections, writes raw/*.json and index.html
"""
