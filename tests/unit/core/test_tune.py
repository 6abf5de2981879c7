"""Symbol / Space / Database: Slapo's tuning-space semantics."""

import json
import logging

import pytest

import slapo_lab as sl
from slapo_lab.tune import Database, Space, Symbol


def test_symbol():
    vals = [1, 2]
    s = Symbol("bs", vals)
    s.add(2)
    s.add(4)
    assert s.vals == [1, 2, 4] and vals == [1, 2] and len(s) == 3
    assert not s.is_fixed() and not (s > 0) and not (s <= 100)  # comparisons are False while unfixed
    with pytest.raises(ValueError):
        _ = s.value
    s.fix_at(2)
    assert s.is_fixed() and s.value == 4 and s > 3 and s >= 4 and s < 5 and s <= 4
    for bad in (3, -1, "0", True):
        with pytest.raises(ValueError):
            s.fix_at(bad)


def _update_space(args, space):
    # the candidates of "ckpt_ratio" depend on the fixed value of "batch_size"
    bs = space.create_symbol("batch_size", [8, 16])
    if bs > 8:
        space.create_symbol("ckpt_ratio", [0.5, 1.0])
    else:
        space.create_symbol("ckpt_ratio", [0.0, 0.5, 1.0])
    return space


def test_space_recreate_next_reset_to_dict():
    space = Space()
    a = space.create_symbol("a", [1, 2])
    b = space.create_symbol("b", ["x"])
    assert len(space) == 2 and space.idx_to_name == ["a", "b"]
    b2 = space.create_symbol("b", ["y", "z"])  # unfixed: re-created with new candidates
    assert b2 is not b and space.space["b"].vals == ["y", "z"] and space.idx_to_name == ["a", "b"]
    a.fix_at(1)
    assert space.create_symbol("a", [7]) is a and a.vals == [1, 2]  # fixed: kept as is
    with pytest.raises(ValueError, match="b"):
        space.to_dict()
    space.reset()
    assert not a.is_fixed() and space.fixed_idx == -1
    assert space.next() is a and space.next() is space.space["b"] and space.next() is None
    a.fix_at(0)
    space.space["b"].fix_at(1)
    assert space.to_dict() == {"a": 1, "b": "z"}
    clone = space.clone()
    clone.space["a"].fix_at(1)
    assert space.to_dict()["a"] == 1 and clone.to_dict()["a"] == 2
    assert Space.cfg_dict_to_str({"a": 1, "b": "z"}) == "(a: 1, b: z)"
    assert "fixed" in repr(space)


def test_log_space_enumerates_dependent_candidates(caplog):
    space = _update_space({}, Space())
    assert space.enumerate({}, _update_space) == [
        {"batch_size": 8, "ckpt_ratio": 0.0},
        {"batch_size": 8, "ckpt_ratio": 0.5},
        {"batch_size": 8, "ckpt_ratio": 1.0},
        {"batch_size": 16, "ckpt_ratio": 0.5},
        {"batch_size": 16, "ckpt_ratio": 1.0},
    ]
    with caplog.at_level(logging.INFO, logger="slapo_lab.tune"):
        assert space.log_space({}, _update_space) == 5
    assert "(batch_size: 16, ckpt_ratio: 1.0)" in caplog.text and "Space size: 5" in caplog.text
    assert not space.space["batch_size"].is_fixed()  # enumeration works on clones


def test_database(tmp_path):
    path = tmp_path / "db.json"
    db = Database(path)
    assert db.load() == {}
    db.commit("(a: 1)", {"thrpt": 10.5, "error_code": 0})
    db.commit("(a: 2)", {"thrpt": 0, "error_code": 1})
    assert json.loads(path.read_text()) == db.db and len(db) == 2 and "(a: 1)" in db
    db2 = Database(str(path))
    db2.load()
    assert db2.db == db.db
    with pytest.raises(TypeError):
        db2.commit("bad", object())
    assert "bad" not in db2 and json.loads(path.read_text()) == db.db  # nothing half-written
    mem = Database()
    mem.commit("k", [1])
    assert mem.load() == {"k": [1]}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError):
        Database(path).load()


def test_public_names():
    assert sl.Space is Space and sl.Symbol is Symbol and sl.Database is Database
