"""When a feature runs: `freq`, `start_step`, `end_step` and `start_end_list` (TE's semantics).

A feature runs at `iteration` when `iteration % freq == 0` and the iteration lies in a window:
[start_step, end_step] (both inclusive; end_step None or -1 = no end), or, when `start_end_list`
is given, in one of its [start, end] pairs (inclusive; end -1 = no end) and start/end_step are
ignored. The routing calls return (run now, next iteration it runs or None).
"""
from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["windows", "enabled_at"]

_INF = float("inf")


def windows(config) -> list:
    sel = config.get("start_end_list")
    if sel:
        return sorted((int(s), _INF if int(e) == -1 else int(e)) for s, e in sel)
    start = config.get("start_step")
    end = config.get("end_step")
    start = 0 if start is None else int(start)
    end = _INF if end is None or int(end) == -1 else int(end)
    return [(start, end)]


def enabled_at(config, iteration: int) -> Tuple[bool, Optional[int]]:
    freq = int(config.get("freq", 1) or 1)
    run = False
    nxt = None
    for s, e in windows(config):
        if s <= iteration <= e and iteration % freq == 0:
            run = True
        first = max(iteration + 1, s)
        cand = first + (-first) % freq
        if cand <= e and (nxt is None or cand < nxt):
            nxt = int(cand)
    return run, nxt
