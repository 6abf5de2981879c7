"""Consent before code (issue 18): a schedule file is data, so the factory its ``meta.model`` names is never
imported or called without consent (``--trust-factory`` / ``trust_factory=True``), and even with consent
only from the user's project folder, never from the standard library, site-packages or the interpreter.

The command line runs in a subprocess with stdin closed and a timeout, so a regression that calls
``os:abort``, ``os:fork`` or ``code:interact`` fails the test instead of killing or hanging pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import slapo_lab as sl
from slapo_lab.export import (
    ExportError,
    build_from_spec,
    check_factory_in_project,
    load_schedule,
    save_schedule,
)

HOSTILE = ["os:abort", "os:fork", "code:interact"]
MODULE = "consent_proj_models"  # the user's own factory module, written into a temporary project
FACTORY = f"{MODULE}:build"
CONSENT = "--trust-factory (trust_factory=True in Python)"


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


@pytest.fixture
def project(tmp_path):
    """A project folder with ``consent_proj_models.build()``, which leaves ``ran.marker`` beside itself."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / f"{MODULE}.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path

            import torch


            def build():
                Path(__file__).with_name("ran.marker").write_text("ran")
                return torch.nn.Sequential(torch.nn.Linear(8, 8))
            """
        )
    )
    sys.modules.pop(MODULE, None)
    yield proj
    sys.modules.pop(MODULE, None)


def _schedule(folder: Path, factory: str, name: str = "s.schedule.json") -> Path:
    """A valid schedule file (saved with save_schedule on a tiny model) whose meta.model names ``factory``."""
    sch = sl.create_schedule(_model(), world_size=1)
    sch["0"].checkpoint()
    path = save_schedule(
        folder / name, sch.record.calls, example_inputs={"x": torch.randn(2, 8)}, world_size=1
    )
    data = json.loads(path.read_text())
    data["meta"]["model"] = {"kind": "factory", "factory": factory}
    path.write_text(json.dumps(data))
    return path


def _cli(run_bounded, env, cwd, *args):
    return run_bounded(
        [sys.executable, "-m", "slapo_lab.cli", *map(str, args)],
        60,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _one_error(r, command: str) -> str:
    """The single error line of a clean refusal (exit status 2, no traceback, nothing else printed)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)  # -6 would be os.abort
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # a fork would print twice, code.interact its banner
    assert lines[0].startswith(f"slapo-lab {command}: error: ") and "Traceback" not in r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------ command line
@pytest.mark.parametrize("command", ["check", "export"])
@pytest.mark.parametrize("factory", HOSTILE)
def test_cli_refuses_a_factory_without_consent(factory, command, tmp_path, run_bounded, subprocess_env):
    path = _schedule(tmp_path, factory)
    out = tmp_path / "train.py"
    extra = ["-o", out] if command == "export" else []
    err = _one_error(_cli(run_bounded, subprocess_env, tmp_path, command, path, *extra), command)
    assert f"names the factory {factory!r}, which would be imported and called" in err
    assert CONSENT in err and "InteractiveConsole" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "factory, command",
    [("os:abort", "check"), ("os:fork", "check"), ("code:interact", "check"), ("os:abort", "export")],
)
def test_cli_with_consent_still_refuses_a_factory_outside_the_project(
    factory, command, project, run_bounded, subprocess_env
):
    path = _schedule(project, factory)
    out = project / "train.py"
    extra = ["-o", out] if command == "export" else []
    r = _cli(run_bounded, subprocess_env, project, command, path, "--trust-factory", *extra)
    err = _one_error(r, command)
    assert f"The factory {factory!r} is refused because" in err and str(project) in err
    top = factory.split(":")[0]
    assert (
        f"{top} is built into Python" in err
        if top == "os"
        else f"{top} resolves to " in err and "outside the project" in err
    )
    assert not out.exists()


def test_cli_runs_a_project_factory_only_with_consent(project, tmp_path, run_bounded, subprocess_env):
    path = _schedule(project, FACTORY)
    marker = project / "ran.marker"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    err = _one_error(_cli(run_bounded, subprocess_env, project, "check", path), "check")
    assert repr(FACTORY) in err and CONSENT in err
    r = _cli(run_bounded, subprocess_env, project, "export", path, "-o", project / "train.py")
    assert repr(FACTORY) in _one_error(r, "export")
    assert not marker.exists() and not (project / "train.py").exists()

    # consent from another folder: the module is not in that project, so it is not imported either
    r = _cli(run_bounded, subprocess_env, elsewhere, "check", path, "--trust-factory")
    assert f"no module {MODULE} is found in the project {elsewhere.resolve()}" in _one_error(r, "check")
    assert not marker.exists()

    r = _cli(run_bounded, subprocess_env, project, "check", path, "--trust-factory")
    assert r.returncode == 0 and "no open items" in r.stdout, (r.stdout, r.stderr)
    assert marker.read_text() == "ran"
    marker.unlink()
    r = _cli(run_bounded, subprocess_env, elsewhere, "check", path, "--trust-factory", "--project", project)
    assert r.returncode == 0 and "no open items" in r.stdout, (r.stdout, r.stderr)
    assert marker.exists()


# --------------------------------------------------------------------------------------------------- API
@pytest.fixture
def tripwires(monkeypatch):
    """In this process ``os.abort``, ``os.fork``, ``code.interact`` and ``sys.exit`` only record that they
    were called, so an API regression fails its test instead of ending pytest; returns the record."""
    import code

    called = []
    for owner, name in ((os, "abort"), (os, "fork"), (code, "interact"), (sys, "exit")):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: called.append(_n))
    return called


@pytest.mark.parametrize("factory", [*HOSTILE, FACTORY])
def test_build_from_spec_refuses_without_consent(factory, project, monkeypatch, tripwires):
    monkeypatch.chdir(project)
    with pytest.raises(ExportError) as err:
        build_from_spec({"kind": "factory", "factory": factory})
    msg = str(err.value)
    assert f"names the factory {factory!r}" in msg and CONSENT in msg and "\n" not in msg
    assert MODULE not in sys.modules and not (project / "ran.marker").exists() and tripwires == []


def test_build_from_spec_with_consent_builds_a_project_factory(project, tmp_path, monkeypatch):
    path_before = list(sys.path)
    model = build_from_spec({"kind": "factory", "factory": FACTORY}, trust_factory=True, project=project)
    assert isinstance(model, torch.nn.Sequential) and model[0].weight.device.type == "meta"
    assert (project / "ran.marker").exists() and sys.path == path_before
    sys.modules.pop(MODULE, None)
    monkeypatch.chdir(project)  # the project defaults to the working directory
    assert isinstance(
        build_from_spec({"kind": "factory", "factory": FACTORY}, trust_factory=True), torch.nn.Module
    )
    assert check_factory_in_project(FACTORY) == (project / f"{MODULE}.py").resolve()


@pytest.mark.parametrize(
    "factory, why",
    [
        ("os:abort", "os is built into Python"),
        ("os:fork", "os is built into Python"),
        ("sys:exit", "sys is built into Python"),
        ("code:interact", "code resolves to "),
        ("json:loads", "json resolves to "),
        ("torch.nn:Linear", "torch resolves to "),
        ("__main__:main", "__main__ is the running program"),
        ("no_such_module_18:build", "no module no_such_module_18 is found"),
    ],
)
def test_consent_never_reaches_outside_the_project(factory, why, project, tripwires):
    with pytest.raises(ExportError) as err:
        build_from_spec({"kind": "factory", "factory": factory}, trust_factory=True, project=project)
    msg = str(err.value)
    assert msg.startswith(f"The factory {factory!r} is refused because {why}") and "\n" not in msg
    assert str(project) in msg and tripwires == []


def test_a_function_the_project_only_reexports_is_not_called(project, tripwires):
    (project / "consent_reexport.py").write_text("from os import abort\n")
    try:
        with pytest.raises(ExportError) as err:
            build_from_spec(
                {"kind": "factory", "factory": "consent_reexport:abort"}, trust_factory=True, project=project
            )
    finally:
        sys.modules.pop("consent_reexport", None)
    msg = str(err.value)
    assert msg.startswith("The factory 'consent_reexport:abort' is refused because abort is defined in ")
    assert "\n" not in msg and tripwires == []


def test_installed_code_inside_the_project_is_refused(project, monkeypatch):
    """A site-packages folder (a virtual environment) inside the project, a link to the standard library,
    and a module imported from no file are not the user's project code."""
    pkg = project / ".venv" / "lib" / "site-packages" / "consent_fake_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    with pytest.raises(ExportError, match="inside a site-packages folder"):
        check_factory_in_project("consent_fake_pkg:build", project)
    assert "consent_fake_pkg" not in sys.modules

    import code

    (project / "consent_linked.py").symlink_to(code.__file__)
    with pytest.raises(ExportError, match=r"consent_linked resolves to .*code\.py, outside the project"):
        check_factory_in_project("consent_linked:interact", project)

    monkeypatch.setitem(sys.modules, "consent_no_file", types.ModuleType("consent_no_file"))
    with pytest.raises(ExportError, match="consent_no_file cannot be located"):
        check_factory_in_project("consent_no_file:build", project)


def test_loading_a_schedule_file_imports_nothing(project):
    sf = load_schedule(_schedule(project, FACTORY))
    assert sf.meta["model"] == {"kind": "factory", "factory": FACTORY}
    assert MODULE not in sys.modules and not (project / "ran.marker").exists()


def test_factories_of_the_users_own_code_keep_importing(project, tmp_path, monkeypatch):
    """factory= in Python is the user's code (consent), and so is the MODEL of the script they launch:
    neither needs the file consent, nor the project check (Verify runs the script from a temporary folder)."""
    from slapo_lab.train.weights import build_meta_model

    monkeypatch.syspath_prepend(str(project))
    monkeypatch.chdir(tmp_path)
    f = save_schedule(tmp_path / "mine.json", [], factory=FACTORY)
    assert load_schedule(f).meta["model"] == {"kind": "factory", "factory": FACTORY}
    assert sl.export.model_spec(_model(), factory=FACTORY)["factory"] == FACTORY
    model = build_meta_model({"kind": "factory", "factory": FACTORY})
    assert isinstance(model, torch.nn.Sequential) and (project / "ran.marker").exists()
    assert os.getcwd() == str(tmp_path)
