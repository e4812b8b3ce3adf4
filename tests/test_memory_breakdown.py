"""benchmarks/memory_breakdown.py's replay of allocator events (the part that runs without CUDA)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import memory_breakdown as mb  # noqa: E402


def test_peak_is_the_largest_live_total_and_lists_what_was_alive():
    model = [{"filename": "/env/torch/nn/functional.py", "line": 1, "name": "linear"},
             {"filename": "/repo/model.py", "line": 5, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 10, "frames": model},
             {"action": "alloc", "addr": 2, "size": 20, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 10},  # not yet free
             {"action": "alloc", "addr": 4, "size": 1, "frames": []},
             {"action": "free_completed", "addr": 1, "size": 10},
             {"action": "alloc", "addr": 3, "size": 5, "frames": []},
             {"action": "free_completed", "addr": 2, "size": 20}]
    peak, alive, at = mb.peak_blocks(trace)
    assert peak == 31 and {a: s for a, (s, _) in alive.items()} == {1: 10, 2: 20, 4: 1}
    assert at == []  # the frames of the allocation that reached the peak (addr 4)
    assert mb._where(model) == "model.py:5 forward"  # torch's own frames are skipped
    here = [{"filename": __file__, "line": 1, "name": "m"}]  # a readable file: its line's text
    assert mb._where(here).startswith(f"{os.path.basename(__file__)}:1 m `\"\"\"benchmarks/memory_breakdown")
