"""Every public function of the engine's packages is fully annotated.

"Public" is read from the names, as a reader of the API would: a function or method whose name has no leading
underscore (``__init__`` counts, other dunders do not), defined at module level or in a class without a leading
underscore, in a module without one. "Fully annotated" means every parameter but ``self``/``cls`` has an annotation,
``*args``/``**kwargs`` included, and so does the return (``__init__`` excepted). Nested functions are private to
their parent and are skipped. Each package's coverage is printed; ``pytest -s`` shows the figures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import harness
import pytest

ROOT = harness.REPO_ROOT / "slapo_lab"

#: The engine packages whose public functions must be fully annotated (issue 25's list).
ENGINE = ("schedule.py", "record.py", "primitives", "sharding", "export", "train")


def _modules(name: str) -> list[Path]:
    path = ROOT / name
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if not f.name.startswith("_") or f.name == "__init__.py"]


def _public_functions(tree: ast.Module):
    def visit(body, in_class: bool):
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from visit(node.body, True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
                if name == "__init__" or not name.startswith("_"):
                    yield node, in_class

    yield from visit(tree.body, False)


def _missing(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> list[str]:
    args = node.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if in_class and params and not is_static:
        params = params[1:]  # self / cls
    if args.vararg is not None:
        params.append(args.vararg)
    if args.kwarg is not None:
        params.append(args.kwarg)
    missing = [p.arg for p in params if p.annotation is None]
    if node.returns is None and node.name != "__init__":
        missing.append("return")
    return missing


def coverage(name: str) -> tuple[int, list[str]]:
    """Count the public functions under ``slapo_lab/<name>`` and list those not fully annotated.

    Returns:
        ``(count, ["path:line name(missing, ...)", ...])``.
    """
    count, bad = 0, []
    for path in _modules(name):
        for node, in_class in _public_functions(ast.parse(path.read_text())):
            count += 1
            missing = _missing(node, in_class)
            if missing:
                rel = path.relative_to(ROOT.parent)
                bad.append(f"{rel}:{node.lineno} {node.name}({', '.join(missing)})")
    return count, bad


@pytest.mark.parametrize("name", ENGINE)
def test_public_functions_are_annotated(name):
    count, bad = coverage(name)
    print(f"{name}: {count - len(bad)}/{count} public functions fully annotated")
    assert count > 0, f"no public function found under slapo_lab/{name}: is the ENGINE list stale?"
    assert not bad, f"{len(bad)} public functions of slapo_lab/{name} lack annotations:\n" + "\n".join(bad)
