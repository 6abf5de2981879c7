"""The import contract: ``slapo_lab``'s layers import only downward.

Every ``import`` in the package is read with :mod:`ast` -- at module level and inside functions alike, since an
import inside a function hides a cycle but does not remove it -- and each module is placed in one layer
(``LAYERS``, the order ``docs/ARCHITECTURE.md`` gives). An import of a higher layer fails the test, unless it is
one of ``KNOWN_UPWARD``, each named with why it is there; a listed edge that is gone fails too, so the list only
shrinks. The same idea as import-linter's "layers" contract, without the extra dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import harness

ROOT = harness.REPO_ROOT / "slapo_lab"

#: Lowest first. A name is a module or a package (a package covers every module below it; the most specific
#: name wins, so ``utils.common`` sits above the rest of ``utils``).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation: graph, sharding and what they stand on",
        (
            "errors",
            "hardware",
            "utils",
            "random",
            "inputs",
            "multimodal_inputs",
            "parallel_dims",
            "module_state",
            "call_order",
            "blocks",
            "graph",
            "sharding",
        ),
    ),
    (
        "engine: the schedule, its record and primitives",
        (
            "schedule",
            "record",
            "primitives",
            "tracing",
            "pattern",
            "atomic",
            "op",
            "utils.common",
            "framework_dialect",
        ),
    ),
    (
        "analysis: checks and the memory plan",
        ("check", "numeric", "plan", "activations", "activation_cache", "verify", "tune"),
    ),
    ("presets and pipeline", ("presets", "preset_check", "pipeline", "build", "init", "spec", "planner")),
    ("export and train", ("export", "train")),
    ("editor and command line", ("editor", "cli", "tools", "labextension", "__init__")),
]

#: ``(importer, imported)`` edges that still go up, each with its reason (fix one: delete its line).
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("check", "presets"): "coverage_findings names what the preset's split inference keeps whole",
    (
        "numeric",
        "pipeline.partition",
    ): "the numeric check's pipeline part partitions the shrunk copy into stages",
    (
        "numeric",
        "pipeline.runtime",
    ): "the numeric check's pipeline part switches the stage graphs' dropout off",
}


#: The internal modules the editor imports beside the public API (``slapo_lab``'s own names): each is of a lower
#: layer, and ``docs/ARCHITECTURE.md`` points here. A new one must be added on purpose.
EDITOR_MAY_USE = frozenset(
    {
        "activation_cache",
        "call_order",
        "check",
        "errors",
        "export",
        "graph",
        "module_state",
        "numeric",
        "parallel_dims",
        "pipeline",
        "plan",
        "planner",
        "preset_check",
        "presets",
        "record",
        "spec",
        "train.config",
        "train.phases",
        "train.preflight",
        "utils",
    }
)


def _layer(module: str) -> int | None:
    best, index = -1, None
    for i, (_name, members) in enumerate(LAYERS):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > best:
                best, index = len(m), i
    return index


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """``(imported slapo_lab module, line)`` for every import in ``path`` (relative ones resolved)."""
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" and me != "__init__" else me.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                head = [*base, *(node.module.split(".") if node.module else [])]
                names = [".".join(head)] if node.module else [".".join([*head, a.name]) for a in node.names]
                names = ["slapo_lab." + n if n else "slapo_lab" for n in names]
            else:
                names = [node.module or ""]
        else:
            continue
        for n in names:
            if n.startswith("slapo_lab.") and n != "slapo_lab.__version__":
                out.append((n[len("slapo_lab.") :], node.lineno))
    return out


def _edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        me = _module_name(path)
        for target, line in _imports(path):
            a, b = _layer(me), _layer(target)
            if a is None or b is None or b <= a:
                continue
            key = next(
                (k for k in KNOWN_UPWARD if (me == k[0] or me.startswith(k[0] + ".")) and target == k[1]),
                (me, target),
            )
            found.setdefault(key, []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return found


def test_every_module_has_a_layer():
    missing = [_module_name(p) for p in sorted(ROOT.rglob("*.py")) if _layer(_module_name(p)) is None]
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_layers_import_only_downward():
    up = {k: v for k, v in _edges().items() if k not in KNOWN_UPWARD}
    assert not up, "imports of a higher layer: " + "; ".join(
        f"{a} -> {b} ({', '.join(where)})" for (a, b), where in sorted(up.items())
    )


def test_each_known_upward_import_is_still_there():
    gone = set(KNOWN_UPWARD) - set(_edges())
    assert not gone, f"fixed: remove these from KNOWN_UPWARD: {sorted(gone)}"


def test_the_reader_sees_imports_inside_functions(tmp_path):
    """The contract's own reader: an import inside a function is an edge too (the kind that hid cycles)."""
    assert ("check", "presets") in _edges()  # check.coverage_findings imports presets inside the function
    assert any(t == "atomic" for t, _ in _imports(ROOT / "check.py"))


def test_the_editor_uses_only_the_modules_it_is_allowed():
    import slapo_lab

    # ``from .. import create_schedule``: a public name that is no module of its own
    public = {n for n in slapo_lab.__all__ if not (ROOT / n).is_dir() and not (ROOT / f"{n}.py").exists()}
    used = set()
    for path in sorted((ROOT / "editor").rglob("*.py")):
        used |= {t for t, _ in _imports(path) if not t.startswith("editor") and t not in public}
    allowed = {t for t in used if any(t == m or t.startswith(m + ".") for m in EDITOR_MAY_USE)}
    assert used - allowed == set(), f"the editor imports {sorted(used - allowed)}: not in EDITOR_MAY_USE"
    unused = {m for m in EDITOR_MAY_USE if not any(t == m or t.startswith(m + ".") for t in used)}
    assert not unused, f"EDITOR_MAY_USE names modules the editor no longer imports: {sorted(unused)}"


def test_export_and_train_form_no_folder_cycle():
    """Exported scripts are rendered by ``export`` and run by ``train``: ``export`` may import ``train`` (the options
    it renders), never the other way round; both read the model and input spec from ``slapo_lab.spec`` below them."""
    back = [
        f"{_module_name(p)} -> {t} (line {line})"
        for p in sorted((ROOT / "train").rglob("*.py"))
        for t, line in _imports(p)
        if t == "export" or t.startswith("export.")
    ]
    assert not back, f"train imports export: {back}"


#: Import cycles between the modules of ``train/`` that are allowed, each with why (an import inside a function,
#: marked with a noqa for PLC0415 and the reason on its line).
TRAIN_CYCLES: dict[tuple[str, str], str] = {
    (
        "train.config",
        "train.args",
    ): "TrainConfig.from_args parses with the parser args builds from TrainConfig",
}


def _runtime_imports(path: Path) -> list[tuple[str, int]]:
    """:func:`_imports` without those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        node.lineno
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    return [(t, line) for t, line in _imports(path) if line not in typing_only]


def test_train_modules_form_no_import_cycle():
    """``train/deepspeed.py`` and ``train/loop.py`` imported each other inside functions (issue 25); the losses and
    batch helpers both need now live in ``train/losses.py`` below them. No module of ``train/`` reaches itself again
    through the imports it runs (at the top or inside a function), but for :data:`TRAIN_CYCLES`."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in sorted((ROOT / "train").rglob("*.py")):
        me = _module_name(path)
        for target, _line in _runtime_imports(path):
            if target.startswith("train.") and target != me and (me, target) not in TRAIN_CYCLES:
                graph.add_edge(me, target)
    cycles = sorted(nx.simple_cycles(graph))
    assert not cycles, f"import cycles in train/: {cycles}"
    assert graph.has_edge("train.deepspeed", "train.losses") and graph.has_edge(
        "train.run", "train.deepspeed"
    )
    assert not graph.has_edge("train.deepspeed", "train.loop")


def test_record_and_primitives_form_no_import_cycle():
    """``record.py`` and ``primitives/`` imported each other inside functions (issue 25: ``replay`` needs the
    registry, ``own_copy`` needed ``take_fresh``); the registry of fresh copies now lives in ``primitives.base``, so
    the record sits above the primitives. Neither ``schedule``, ``record`` nor a module of ``primitives/`` reaches
    itself again through the imports it runs (``TYPE_CHECKING`` imports, for annotations only, aside)."""
    import networkx as nx

    engine = ("schedule", "record", "primitives")
    paths = [ROOT / "schedule.py", ROOT / "record.py", *sorted((ROOT / "primitives").rglob("*.py"))]
    graph = nx.DiGraph()
    for path in paths:
        me = _module_name(path)
        for target, _line in _runtime_imports(path):
            if target != me and any(target == m or target.startswith(m + ".") for m in engine):
                graph.add_edge(me, target)
    cycles = sorted(nx.simple_cycles(graph))
    assert not cycles, f"import cycles between schedule, record and primitives/: {cycles}"
    assert graph.has_edge("record", "primitives.base") and graph.has_edge("schedule", "record")
    back = [(a, b) for a, b in graph.edges if a.startswith("primitives") and b == "record"]
    assert not back, f"primitives import the record again: {back}"
