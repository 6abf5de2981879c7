"""Reusable helpers for real-browser tests: JupyterLab server + headless Chromium via Playwright.

Typical use::

    with jupyter_lab(tmp_path, nb_dir) as (base_url, token), browser_page(tmp_path) as page:
        open_notebook(page, base_url, token, "demo.ipynb")
        run_all_cells(page)
        assert notebook_errors(page) == []

Everything is isolated under ``tmp_path`` (Jupyter config/data/runtime dirs, HOME, the Chromium
profile); the venv's ``share/jupyter`` stays on the Jupyter data path, so the installed
labextensions (ipywidgets' manager, slapo-lab) and the ``python3`` kernel are found. Every wait is
bounded, and every process started here (server, kernels, browser) is ended on exit, also on
failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO_ROOT = harness.REPO_ROOT
ARTIFACTS = REPO_ROOT / "artifacts"

# Front-end plugins that would reach the internet or pop up notices in a fresh profile.
_DISABLED_LAB_PLUGINS = {
    "@jupyterlab/apputils-extension:announcements": True,
    "@jupyterlab/extensionmanager-extension": True,
}


def browser_available() -> str | None:
    """None if a browser test can run here, else the reason it cannot (for ``pytest.skip``)."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is not installed"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------------ processes


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[tuple[int, int]] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            start = _proc_start_time(child)
            if start is not None:
                out.append((child, start))
                stack.append(child)
    return out


def _kill_if_same(pid: int, start: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process we recorded. True if alive."""
    if _proc_start_time(pid) != start:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
    return True


def _stop_process_tree(proc: subprocess.Popen, shutdown_url: str | None = None, grace: float = 15.0) -> None:
    """End ``proc`` and everything it started: polite shutdown, then SIGTERM, then SIGKILL."""
    tree = _descendants(proc.pid)
    if shutdown_url and proc.poll() is None:
        with contextlib.suppress(Exception):
            req = urllib.request.Request(shutdown_url, method="POST", data=b"")
            urllib.request.urlopen(req, timeout=5).close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    # kernels and other children that outlived the server
    tree += [d for d in _descendants(proc.pid) if d not in tree]
    alive = [(pid, start) for pid, start in tree if _kill_if_same(pid, start, signal.SIGTERM)]
    deadline = time.monotonic() + 5
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [(pid, start) for pid, start in alive if _proc_start_time(pid) == start]
    for pid, start in alive:
        _kill_if_same(pid, start, signal.SIGKILL)


# ------------------------------------------------------------------------------------ JupyterLab


# The front ends :func:`jupyter_server` can start: (python -m module, app config class, name in errors).
_APPS = {
    "lab": ("jupyterlab", "LabApp", "JupyterLab"),
    "notebook": ("notebook", "JupyterNotebookApp", "Notebook 7"),
}


@contextlib.contextmanager
def jupyter_lab(
    tmp_path: Path, notebook_dir: Path, startup_timeout: float = 90.0, extra_args: list[str] | None = None
) -> Iterator[tuple[str, str]]:
    """Run JupyterLab on 127.0.0.1 (free port, random token); yield ``(base_url, token)``.

    Config, data, runtime dirs and HOME live under ``tmp_path/jupyter``; the server log is
    ``tmp_path/jupyter/server.log`` (its tail is in every error raised here).
    """
    with jupyter_server(tmp_path, notebook_dir, app="lab", startup_timeout=startup_timeout,
                        extra_args=extra_args) as served:  # fmt: skip
        yield served


@contextlib.contextmanager
def jupyter_server(
    tmp_path: Path,
    notebook_dir: Path,
    app: str = "lab",
    startup_timeout: float = 90.0,
    extra_args: list[str] | None = None,
) -> Iterator[tuple[str, str]]:
    """Run ``app`` — ``"lab"`` (JupyterLab) or ``"notebook"`` (Notebook 7) — on 127.0.0.1 (free port,
    random token), isolated like :func:`jupyter_lab`; yield ``(base_url, token)``.

    Both expose the front end as ``window.jupyterapp``, so the notebook helpers below work in either
    (pass ``app=`` to :func:`open_notebook`).
    """
    if app not in _APPS:
        raise ValueError(f"app must be one of {sorted(_APPS)}, not {app!r}")
    module, app_class, app_name = _APPS[app]
    root = Path(tmp_path) / "jupyter"
    dirs = {name: root / name for name in ("config", "data", "runtime", "home", "ipython")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    (dirs["config"] / "labconfig").mkdir(exist_ok=True)
    (dirs["config"] / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": _DISABLED_LAB_PLUGINS})
    )
    port = free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(dirs["config"]),
        JUPYTER_DATA_DIR=str(dirs["data"]),
        JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
        HOME=str(dirs["home"]),
        IPYTHONDIR=str(dirs["ipython"]),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
    )
    for var in (
        "JUPYTER_PATH",
        "JUPYTER_CONFIG_PATH",
        "JUPYTERLAB_DIR",
        "JUPYTERLAB_SETTINGS_DIR",
        "JUPYTERLAB_WORKSPACES_DIR",
        "JUPYTER_TOKEN",
    ):
        env.pop(var, None)
    cmd = [
        sys.executable, "-m", module,
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={Path(notebook_dir).resolve()}",
        f"--{app_class}.expose_app_in_browser=True",
        *(["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"] if app == "lab" else []),
        *(extra_args or []),
    ]  # fmt: skip
    log_path = root / "server.log"
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=str(notebook_dir), start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{app_name} exited with code {proc.returncode}:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{base_url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{app_name} did not answer within {startup_timeout:.0f} s:\n{_tail(log_path)}"
                )
            time.sleep(0.2)
        yield base_url, token
    finally:
        _stop_process_tree(proc, shutdown_url=f"{base_url}/api/shutdown?token={token}")


def server_log(tmp_path: Path) -> str:
    """The tail of the server log written by :func:`jupyter_lab`."""
    return _tail(Path(tmp_path) / "jupyter" / "server.log")


# ------------------------------------------------------------------------------------ browser


@contextlib.contextmanager
def browser_page(tmp_path: Path, width: int = 1400, height: int = 1000, default_timeout_ms: int = 30_000):
    """Yield a Playwright page in headless /usr/bin/chromium with a fresh profile under ``tmp_path``.

    ``page.console_messages`` collects ``"type: text"`` of every console message and page error.
    """
    from playwright.sync_api import sync_playwright

    root = Path(tmp_path) / "chromium"
    profile, home = root / "profile", root / "home"
    for d in (profile, home):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
    )
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            env=env,
            viewport={"width": width, "height": height},
            timeout=60_000,
        )
        try:
            context.set_default_timeout(default_timeout_ms)
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(default_timeout_ms)
            messages: list[str] = []
            page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
            page.console_messages = messages  # type: ignore[attr-defined]
            yield page
        finally:
            with contextlib.suppress(Exception):
                context.close()


# ------------------------------------------------------------------------------------ notebook

# JS: the notebook panel currently in the main area (or null).
_CURRENT_NB = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  return w && w.content && w.sessionContext && w.context ? w : null;
}"""


def _js_with_timeout(body: str, timeout_s: float) -> str:
    """Wrap an async JS body (using ``nb``, the current notebook panel) in a bounded Promise.race."""
    ms = int(timeout_s * 1000)
    return f"""async () => {{
  const nb = ({_CURRENT_NB})();
  if (!nb) throw new Error('no notebook panel is open');
  const work = (async () => {{ {body} }})();
  const limit = new Promise((_, reject) => setTimeout(() => reject(new Error('timed out after {timeout_s} s')), {ms}));
  return await Promise.race([work, limit]);
}}"""


def open_notebook(
    page: Any,
    base_url: str,
    token: str,
    name: str,
    timeout: float = 90.0,
    reset: bool = False,
    app: str = "lab",
) -> None:
    """Open ``name`` (relative to the server root) in JupyterLab and wait until its kernel is idle.

    ``reset=True`` clears the saved workspace first, so documents opened earlier in the same browser
    profile are not reopened (and do not start kernels of their own). ``app="notebook"`` opens it in
    Notebook 7 (``/notebooks/<name>``, one document per page: ``reset`` does not apply) instead.
    """
    if app == "notebook":
        url = f"{base_url}/notebooks/{quote(name)}?token={token}"
    else:
        url = f"{base_url}/lab/tree/{quote(name)}?token={token}" + ("&reset" if reset else "")
    page.goto(url, wait_until="domcontentloaded", timeout=timeout * 1000)
    page.wait_for_function("() => !!window.jupyterapp", timeout=timeout * 1000)
    page.wait_for_function(
        f"""(name) => {{
  const nb = ({_CURRENT_NB})();
  return !!(nb && nb.context.path.endsWith(name) && nb.context.isReady);
}}""",
        arg=name,
        timeout=timeout * 1000,
    )
    wait_kernel_idle(page, timeout=timeout)


def wait_kernel_idle(page: Any, timeout: float = 60.0) -> None:
    """Wait until the current notebook's kernel is connected and idle."""
    page.evaluate(_js_with_timeout("await nb.sessionContext.ready;", timeout))
    page.wait_for_function(
        f"""() => {{
  const nb = ({_CURRENT_NB})();
  const k = nb && nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!(k && k.connectionStatus === 'connected' && k.status === 'idle');
}}""",
        timeout=timeout * 1000,
    )


def run_all_cells(page: Any, timeout: float = 120.0) -> None:
    """Run every cell of the current notebook, wait for all replies and an idle kernel."""
    wait_kernel_idle(page, timeout=timeout)
    page.evaluate(
        _js_with_timeout("await window.jupyterapp.commands.execute('notebook:run-all-cells');", timeout)
    )
    wait_kernel_idle(page, timeout=timeout)


def run_cell(page: Any, index: int, timeout: float = 120.0) -> None:
    """Run cell ``index`` of the current notebook (it becomes the active cell) and wait until idle."""
    wait_kernel_idle(page, timeout=timeout)
    page.evaluate(
        _js_with_timeout(
            f"nb.content.activeCellIndex = {int(index)}; "
            "await window.jupyterapp.commands.execute('notebook:run-cell');",
            timeout,
        )
    )
    wait_kernel_idle(page, timeout=timeout)


def notebook_errors(page: Any) -> list[str]:
    """``ename: evalue`` (+ traceback tail) of every error output in the current notebook."""
    return page.evaluate(
        f"""() => {{
  const nb = ({_CURRENT_NB})();
  const out = [];
  if (!nb) return ['no notebook panel is open'];
  for (const cell of nb.content.widgets) {{
    const outputs = cell.model.outputs;
    if (!outputs) continue;
    for (let i = 0; i < outputs.length; i++) {{
      const o = outputs.get(i).toJSON();
      if (o.output_type === 'error') {{
        const tb = (o.traceback || []).join('\\n').replace(/\\u001b\\[[0-9;]*m/g, '');
        out.push(`${{o.ename}}: ${{o.evalue}}\\n${{tb.slice(-2000)}}`);
      }}
    }}
  }}
  return out;
}}"""
    )


def cell_locator(page: Any, index: int) -> Any:
    """Playwright locator of cell ``index`` of the current notebook."""
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell").nth(index)


def save_screenshot(target: Any, name: str) -> Path:
    """Screenshot a page or locator into ``artifacts/<name>`` (the folder is git-ignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    target.screenshot(path=str(path))
    return path


def write_notebook(path: Path, cells: list[str], hide_input: bool = False) -> Path:
    """Write a notebook of code cells (python3 kernel) to ``path``.

    ``hide_input=True`` collapses the cells' source in JupyterLab, so outputs are in view.
    """
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    if hide_input:
        for cell in nb.cells:
            cell.metadata["jupyter"] = {"source_hidden": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


__all__ = [
    "ARTIFACTS", "CHROMIUM", "CHROMIUM_ARGS", "browser_available", "browser_page", "cell_locator",
    "free_port", "jupyter_lab", "jupyter_server", "notebook_errors", "open_notebook", "run_all_cells", "run_cell",
    "save_screenshot", "server_log", "wait_kernel_idle", "write_notebook",
]  # fmt: skip
