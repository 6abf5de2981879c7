"""Tuning-space bookkeeping: :class:`Symbol`, :class:`Space`, :class:`Database` (Slapo's ``slapo.tune``).

A :class:`Space` is built by a user function ``update_space(args, space)`` that calls
``space.create_symbol(name, candidates)``; symbols are fixed one at a time in creation order
(:meth:`Space.next` + :meth:`Symbol.fix_at`), and ``update_space`` runs again after each fix so
that later symbols' candidates may depend on earlier choices (``create_symbol`` re-creates an
unfixed symbol and leaves a fixed one alone). :meth:`Space.to_dict` gives the chosen configuration.
:class:`Database` keeps results keyed by :meth:`Space.cfg_dict_to_str`, in a JSON file.

Semantics follow Slapo's API reference (seed ``001``: ``Symbol(name, vals)`` with ``add`` /
``fix_at`` / ``is_fixed``; ``Space`` with ``create_symbol`` / ``next`` / ``reset`` / ``to_dict`` /
``clone`` / ``cfg_dict_to_str`` / ``log_space``; ``Database(db_file_name)`` with ``load`` /
``commit``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["Database", "Space", "Symbol"]

logger = logging.getLogger("slapo_lab.tune")


class Symbol:
    """A tunable symbol: a name and an ordered list of candidate values, at most one of them chosen.

    Attributes:
        name: the symbol's name (the key in :meth:`Space.to_dict`).
        vals: candidate values (a list; the caller's list is copied).
        fixed_idx: index of the chosen value, or -1 while unfixed.

    Comparisons (``<``, ``<=``, ``>``, ``>=``) compare the fixed value and are False while unfixed,
    so ``if sym > 1:`` in an ``update_space`` function is safe before the symbol is fixed.
    """

    def __init__(self, name: str, vals) -> None:
        self.name = name
        self.vals = list(vals)
        self.fixed_idx = -1

    @property
    def value(self) -> Any:
        """The fixed value.

        Raises:
            ValueError: if the symbol is not fixed yet.
        """
        if not self.is_fixed():
            raise ValueError(f"The value of symbol {self.name} has not been fixed.")
        return self.vals[self.fixed_idx]

    def add(self, val) -> None:
        """Add a candidate value; a value already present is not added twice."""
        if val not in self.vals:
            self.vals.append(val)

    def fix_at(self, idx: int) -> None:
        """Fix the symbol to ``vals[idx]``.

        Raises:
            ValueError: if ``idx`` is not a valid index (0 <= idx < len(vals)).
        """
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(self.vals):
            raise ValueError(f"Cannot fix {self.name} with {len(self.vals)} values at index {idx!r}.")
        self.fixed_idx = idx

    def is_fixed(self) -> bool:
        """Whether a value has been chosen."""
        return self.fixed_idx != -1

    def __len__(self) -> int:
        return len(self.vals)

    def _cmp(self, other, op) -> bool:
        return self.is_fixed() and op(self.value, other)

    def __gt__(self, other) -> bool:
        return self._cmp(other, lambda a, b: a > b)

    def __ge__(self, other) -> bool:
        return self._cmp(other, lambda a, b: a >= b)

    def __lt__(self, other) -> bool:
        return self._cmp(other, lambda a, b: a < b)

    def __le__(self, other) -> bool:
        return self._cmp(other, lambda a, b: a <= b)

    def __repr__(self) -> str:
        state = f"fixed={self.value!r}" if self.is_fixed() else f"vals={self.vals!r}"
        return f"Symbol({self.name!r}, {state})"


class Space:
    """The tuning space: symbols in creation order and a cursor over them.

    Attributes:
        space: name -> :class:`Symbol` (insertion-ordered).
        idx_to_name: symbol names in creation order.
        fixed_idx: index of the last symbol handed out by :meth:`next` (-1 before the first).
    """

    def __init__(self) -> None:
        self.space: dict[str, Symbol] = {}
        self.idx_to_name: list[str] = []
        self.fixed_idx = -1

    def create_symbol(self, name: str, vals) -> Symbol:
        """Create (or re-create) symbol ``name`` with candidates ``vals`` and return it.

        If the symbol exists and is fixed, it is returned unchanged (its candidates are ignored);
        if it exists unfixed, it is replaced by a new symbol with ``vals`` (candidates may depend on
        symbols fixed since), keeping its position in the order.
        """
        old = self.space.get(name)
        if old is not None and old.is_fixed():
            return old
        if old is None:
            self.idx_to_name.append(name)
        self.space[name] = Symbol(name, vals)
        return self.space[name]

    def next(self) -> Symbol | None:
        """The next symbol to fix (in creation order), or None when every symbol has been handed out."""
        if self.fixed_idx + 1 < len(self.idx_to_name):
            self.fixed_idx += 1
            return self.space[self.idx_to_name[self.fixed_idx]]
        return None

    def reset(self) -> None:
        """Unfix every symbol and rewind :meth:`next`."""
        self.fixed_idx = -1
        for sym in self.space.values():
            sym.fixed_idx = -1

    def to_dict(self) -> dict[str, Any]:
        """``{name: fixed value}`` for every symbol, in creation order.

        Raises:
            ValueError: naming the first symbol that is not fixed.
        """
        return {name: self.space[name].value for name in self.idx_to_name}

    def clone(self) -> Space:
        """A deep copy (symbols and cursor)."""
        return copy.deepcopy(self)

    @staticmethod
    def cfg_dict_to_str(cfg_dict: dict) -> str:
        """``{"a": 1, "b": 2}`` -> ``"(a: 1, b: 2)"`` (Slapo's format; the key of :class:`Database` records)."""
        return "(" + ", ".join(f"{k}: {v}" for k, v in cfg_dict.items()) + ")"

    def enumerate(self, training_script_args, update_space_fn: Callable[[Any, Space], Space]) -> list[dict]:
        """Every complete configuration reachable by fixing symbols in order, re-running
        ``update_space_fn(training_script_args, space)`` after each fix (depth first)."""
        out: list[dict] = []

        def run(space: Space) -> None:
            sym = space.next()
            if sym is None:
                out.append(space.to_dict())
                return
            for idx in range(len(sym.vals)):
                sym.fix_at(idx)
                updated = update_space_fn(training_script_args, space)
                run((updated if updated is not None else space).clone())

        run(self.clone())
        return out

    def log_space(self, training_script_args, update_space_fn: Callable[[Any, Space], Space]) -> int:
        """Log every configuration of the space (logger ``slapo_lab.tune``, INFO) and return their count."""
        cfgs = self.enumerate(training_script_args, update_space_fn)
        logger.info("Enumerating the search space:")
        for cfg in cfgs:
            logger.info("\t%s", self.cfg_dict_to_str(cfg))
        logger.info("Space size: %d", len(cfgs))
        return len(cfgs)

    def __len__(self) -> int:
        return len(self.space)

    def __repr__(self) -> str:
        body = ", ".join(
            f"{s.name}: {s.value!r} (fixed)" if s.is_fixed() else f"{s.name}: {s.vals!r}"
            for s in self.space.values()
        )
        return f"Space({body})"


class Database:
    """Tuning results in a dict, mirrored to a JSON file after every :meth:`commit`.

    Args:
        db_file_name: path of the JSON file, or None to keep records in memory only.

    Attributes:
        db: ``{key: data}`` (keys are strings, e.g. :meth:`Space.cfg_dict_to_str`; data JSON-able).
    """

    def __init__(self, db_file_name: str | os.PathLike | None = None) -> None:
        self.db_file_name = os.fspath(db_file_name) if db_file_name is not None else None
        self.db: dict[str, Any] = {}

    def load(self) -> dict[str, Any]:
        """Read the file into :attr:`db` if it exists (replacing what is there) and return :attr:`db`.

        Raises:
            ValueError: if the file is not a JSON object.
        """
        if self.db_file_name and os.path.exists(self.db_file_name):
            with open(self.db_file_name, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"{self.db_file_name} does not hold a JSON object of tuning records.")
            self.db = data
        return self.db

    def commit(self, key: str, data: Any) -> None:
        """Store ``data`` under ``key`` and rewrite the file (atomically: temp file + rename).

        Raises:
            TypeError: if ``data`` is not JSON-serialisable (nothing is stored then).
        """
        text = json.dumps({**self.db, key: data}, indent=2) if self.db_file_name else json.dumps(data)
        self.db[key] = data
        if self.db_file_name:
            tmp = self.db_file_name + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.db_file_name)

    def __len__(self) -> int:
        return len(self.db)

    def __contains__(self, key: str) -> bool:
        return key in self.db
