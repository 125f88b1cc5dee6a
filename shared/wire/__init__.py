"""The wire layer: everything that crosses a process boundary, and nothing that needs torch.

Subjects (``subjects``), message structs and their codecs (``messages``; ``SamplingParams`` in
``sampling_params``, engine outputs in ``outputs``, KV cache events in ``kv_events``), the NATS
client (``bus``) and the chained block hashes that name prefixes (``block_hash``). The engine
package (``shared.engine``) imports these types; nothing here imports the engine or torch
(``tests/unit/test_import_rules.py`` enforces both).
"""
