"""Gates applied after a row-parallel reduce: a linear whose output multiplies a row-parallel layer's output.

RWKV's channel mixing (``transformers/models/rwkv/modeling_rwkv.py``, ``RwkvFeedForward.forward``) returns
``sigmoid(receptance(x)) * value(square(relu(key(x))))``: ``key`` / ``value`` are Megatron's column / row pair
(split by the MLP rule of :mod:`slapo_lab.sharding.infer`), and ``receptance`` gates ``value``'s output, which
exists whole only after the row-parallel all-reduce. Every feature of the gate meets every rank's reduced output,
so the gate stays whole (replicated, its input taken whole): a column split of it would need ``value``'s partial
sums reduce-scattered instead of all-reduced and the gated result gathered again before the residual, which is
no longer the Megatron pair of one all-reduce per region. The inference keeps such a linear whole with that
sentence instead of the generic "reaches no attention head" (:func:`resolve`).

:class:`slapo_lab.sharding.infer._Recorder` calls :func:`note_meet` on every op with several mapped operands;
products (``mul``) of linear outputs are remembered per analysed block.
"""

from __future__ import annotations

__all__ = ["note_meet", "resolve"]

_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__", "multiply", "mul_", "__imul__"})
_NOT_LINEAR = ("param:", "input:", "@", "cols:")


def note_meet(rec, name: str, ins: list) -> None:
    """Remember, for a product of two or more mapped values, the linears each operand's features come from."""
    if name not in _PRODUCTS:
        return
    sides = [frozenset(p for p in i.maps if not p.startswith(_NOT_LINEAR)) for _, i in ins]
    if sum(1 for s in sides if s) >= 2:
        rec.__dict__.setdefault("gate_meets", []).append(sides)  # reset per block, kept by _Snapshot


def resolve(split, rec, dense: dict) -> None:
    """Keep whole, with the reason, every linear of ``dense`` with no role that multiplies the output of a linear
    the split makes row parallel (``"mlp_out"`` or ``"o"``)."""
    rows = {p for p, r in split.roles.items() if r in ("mlp_out", "o")}
    for sides in getattr(rec, "gate_meets", ()):
        for a in sides:
            row = next((p for p in sorted(a) if p in rows), None)
            if row is None:
                continue
            for b in sides:
                for p in sorted(b - a):
                    if p in dense and p not in split.roles and p not in split.whole:
                        split.whole[p] = (
                            f"a gate on {row}'s output, which is whole only after {row}'s row-parallel "
                            "all-reduce: every feature of it meets every rank's reduced output, so it stays whole"
                        )
