"""Render recorded calls as the body of ``def schedule(sch):``, folding repeats over layers into loops.

A *run* is ``r >= 2`` consecutive blocks of ``L`` calls where block ``m`` repeats block 0 exactly
except that every path has one numeric component (the layer index) equal to ``v0 + m``::

    sch["encoder.layer.0.attention.self.query"].shard("weight", axis=0)   # block 0
    sch["encoder.layer.0"].checkpoint()
    sch["encoder.layer.1.attention.self.query"].shard("weight", axis=0)   # block 1
    sch["encoder.layer.1"].checkpoint()

becomes::

    for i in range(2):
        sch[f"encoder.layer.{i}.attention.self.query"].shard("weight", axis=0)
        sch[f"encoder.layer.{i}"].checkpoint()

Safety: a path is written as an f-string only when the text around the index consists of
``[A-Za-z0-9_.]``; any other path (a ModuleDict key such as ``a"b`` or ``__import__('os')``) is never
folded and is written as a ``repr``'d literal by :func:`slapo_lab.record.format_call`, so no module
name can inject code. Arguments are always ``repr``'d literals.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import NamedTuple

from ..record import Call, format_call, pystr

_INDEX = re.compile(r"(0|[1-9][0-9]*)\Z")  # canonical: f"{i}" writes it back identically
_SAFE = re.compile(r"[A-Za-z0-9_.]*\Z")
# Bounds on the search for runs, so that a long record that repeats the same calls (``annotate``
# overwriting a tag thousands of times) folds in linear time: at most _MAX_TRIES block lengths are tried
# per position (the shortest; a layered schedule has one or two), and at most _BUDGET_PER_CALL call pairs
# are compared per call of the record (a layered schedule needs about one), after which the rest is
# written one call per line (it replays the same).
_MAX_TRIES = 8
_BUDGET_PER_CALL = 2


def _tail(call: Call, var: str) -> str:
    """The rendered call after ``sch[<path>]``: ``.shard("weight", axis=0)``."""
    return format_call(call, var)[len(f"{var}[{pystr(call.path)}]") :]


def _step(a: Call, b: Call) -> tuple[int, int, int] | None:
    """``(position, index in a, index in b)`` when the paths differ in exactly one safe index component."""
    pa, pb = a.path.split("."), b.path.split(".")
    if len(pa) != len(pb):
        return None
    diff = [k for k, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y]
    if len(diff) != 1:
        return None
    k = diff[0]
    if not (_INDEX.match(pa[k]) and _INDEX.match(pb[k])):
        return None
    if not _SAFE.match(".".join(pa[:k] + pa[k + 1 :])):
        return None
    return k, int(pa[k]), int(pb[k])


class Run(NamedTuple):
    """``count`` repeats of ``calls[start:start + length]`` with layer index ``first`` + m."""

    start: int
    length: int
    count: int
    first: int
    positions: tuple[int, ...]  # the index component of each call of the block


def _run_at(calls: list[Call], tails: list[str], s: int, length: int, budget: list[int]) -> Run | None:
    """The run of blocks of ``length`` calls at ``s``, or None; ``budget[0]`` is lowered by the pairs compared."""
    n = len(calls)
    if s + 2 * length > n:
        return None
    positions, first = [], None
    for j in range(length):
        budget[0] -= 1
        a, b = calls[s + j], calls[s + length + j]
        if tails[s + j] != tails[s + length + j]:
            return None
        st = _step(a, b)
        if st is None or st[2] != st[1] + 1 or (first is not None and st[1] != first):
            return None
        first = st[1]
        positions.append(st[0])
    count = 2
    while s + (count + 1) * length <= n:
        base = s + count * length
        ok = True
        budget[0] -= length
        for j in range(length):
            st = _step(calls[s + j], calls[base + j])
            if (
                tails[s + j] != tails[base + j]
                or st is None
                or st[0] != positions[j]
                or st[2] != first + count
            ):
                ok = False
                break
        if not ok:
            break
        count += 1
    return Run(s, length, count, first, tuple(positions))


def find_runs(calls: list[Call], var: str = "sch") -> list[Call | Run]:
    """Split ``calls`` into single calls and :class:`Run` s, greedily from the front.

    At each position the run covering the most calls wins (ties: the shorter block).
    """
    tails = [_tail(c, var) for c in calls]
    at: dict[tuple[str, str], list[int]] = {}  # (path, rendered call after it) -> positions, ascending
    for k, c in enumerate(calls):
        at.setdefault((c.path, tails[k]), []).append(k)
    out: list[Call | Run] = []
    s, n = 0, len(calls)
    budget = [_BUDGET_PER_CALL * n + 10_000]
    while s < n:
        best: Run | None = None
        parts = calls[s].path.split(".")
        # a block of length L can start here only if call s + L is call s one layer on (one index + 1, the
        # same arguments): trying just those lengths keeps a long unfoldable record linear, not quadratic
        lengths = set()
        for k, part in enumerate(parts):
            if budget[0] > 0 and _INDEX.match(part):
                nxt = ".".join(parts[:k] + [str(int(part) + 1)] + parts[k + 1 :])
                qs = at.get((nxt, tails[s]), ())
                lo = bisect_right(qs, s)
                lengths.update(q - s for q in qs[lo : lo + _MAX_TRIES] if q <= s + (n - s) // 2)
        if lengths:
            for length in sorted(lengths)[:_MAX_TRIES]:
                if budget[0] <= 0:
                    break
                run = _run_at(calls, tails, s, length, budget)
                if run is not None and (best is None or run.length * run.count > best.length * best.count):
                    best = run
        if best is None:
            out.append(calls[s])
            s += 1
        else:
            out.append(best)
            s += best.length * best.count
    return out


def schedule_lines(calls: list[Call], var: str = "sch", loop_var: str = "i") -> list[str]:
    """The lines (unindented; loop bodies indented by 4) that replay ``calls`` on ``var``.

    Calls must already be validated (:func:`slapo_lab.spec.validate_calls`).
    """
    lines: list[str] = []
    for item in find_runs(calls, var):
        if isinstance(item, Call):
            lines.append(format_call(item, var))
            continue
        rng = f"range({item.count})" if item.first == 0 else f"range({item.first}, {item.first + item.count})"
        lines.append(f"for {loop_var} in {rng}:")
        for j in range(item.length):
            call = calls[item.start + j]
            parts = call.path.split(".")
            k = item.positions[j]
            head = ".".join(parts[:k]) + ("." if k else "")
            rest = ("." if k + 1 < len(parts) else "") + ".".join(parts[k + 1 :])
            lines.append(f'    {var}[f"{head}{{{loop_var}}}{rest}"]{_tail(call, var)}')
    return lines
