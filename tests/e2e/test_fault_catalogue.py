"""The fault catalogue's quick subset (loadtests/faults.py) on a real stack: SIGKILL of the
executor, scheduler, tokenizer and prefix index while streams run, clients that drop mid-stream,
and hostile inputs. No request may hang, no KV block may leak, and the stack must come back from
every fault; the servers' kills run in the full catalogue and in test_e2e_supervision.py."""

from __future__ import annotations

from loadtests.faults import failures, print_table, run


def test_quick_fault_catalogue_leaves_nothing_hung_or_leaked():
    results = run(quick=True, num_requests=4)
    print_table(results)
    assert {r.case for r in results} >= {
        "kill executor-0",
        "kill scheduler-0",
        "kill tokenizer-0",
        "kill prefix_index-0",
        "drop clients mid-stream",
        "input: 100 MB body",
        "input: forged chat roles",
    }
    assert failures(results) == []
    assert all(r.sent == r.answered + r.errored + r.hung for r in results)
