"""GraphWidget: a graphviz SVG shown in JupyterLab with pan, zoom, click and double-click.

The browser half is the ``slapo-lab`` labextension (``labextension/src/widget.ts``): it sanitises
the SVG (DOMPurify, SVG profile), lets the user pan and zoom (see *Navigation* below), highlights the
``selected`` node and the ``highlighted`` ones (search matches) and sends custom messages back to the
kernel::

    {"event": "click", "node": "<token>", "render": <render id>}
    {"event": "dblclick", "node": "<token>", "render": <render id>}
    {"event": "action", "action": "<name>", "node": "<token>"?, "render": <render id>?}
    {"event": "panel", "opened": true | false, "reason": "<one sentence>"?}

``action`` messages come from the keyboard shortcuts, the context menus and the command palette (JupyterLab
commands ``slapo-lab:*``, see ``labextension/src/plugin.ts``); ``<name>`` is one of :data:`ACTIONS`. ``node``
is optional except for ``select`` and is checked like a click's (same ``render`` rule, same stale-token rule);
the ``on_action`` callbacks get ``(action, token, path)`` with ``token`` / ``path`` None when no node was
named. ``panel`` acknowledges an ``open_panel`` request (``on_panel`` callbacks get ``(opened, reason)``).

Kernel → browser: :meth:`GraphWidget.open_panel` sends ``{"cmd": "open_panel", "model_id": <id>}``; the
labextension then opens another view of that widget model (the editor's panel layout) as a JupyterLab
main-area panel split to the right of the notebook, and answers with a ``panel`` event.

Context menus: ``action_reasons`` (action → "" when it applies, else the one-sentence reason it does not),
``action_labels`` (action → menu label, e.g. ``shard weight on axis 0``) and ``action_target`` (the module
path they describe) are synced; the browser disables a menu item whose reason is not empty and shows the
reason with it. Set them together with :meth:`set_action_reasons`.

A token is the ``id`` attribute graphviz gives a node's ``<g class="node">`` (set it with the
node's ``id`` attribute in dot). Every :meth:`GraphWidget.set_graph` bumps ``render_id`` (synced
together with ``svg``), and the browser sends the ``render_id`` of the drawing the user clicked: a
click on an older drawing (sent before the new SVG arrived) is reported as one sentence and selects
nothing. Tokens should also name their drawing: draw with
``render_svg(G, styles, token_prefix=widget.next_token_prefix())`` (tokens ``d<render_id>n<i>``, e.g.
``d7n3``), so that a token from an older drawing is never a token of the current one, and a message
*without* ``render`` (kernel-side drivers and tests that send messages directly need not know the id)
carrying a stale token is ignored with one sentence instead of selecting whatever module the
positional token ``n3`` names now. ``node_ids`` maps each token of the current SVG to a module path;
every message is checked against it, and anything malformed or stale is reported to the ``on_error``
callbacks as one sentence instead of raising.

Zoom: the browser keeps its pan/zoom when ``svg`` changes (e.g. only colours changed). Call
:meth:`GraphWidget.reset_zoom` (or pass ``reset_view=True`` to :meth:`GraphWidget.set_graph`) to
go back to the home view, e.g. after showing a different level of the model: the whole drawing,
or, when that would make its text unreadably small, its top at a readable scale.

Navigation (browser only, as in Netron / Model Explorer): drag pans. The wheel and a trackpad's
two-finger scroll pan (both axes) only while the graph has focus (click it, or Tab to it; a focused
graph has a brand-coloured frame); over an unfocused graph they scroll the notebook as usual.
Ctrl+wheel (and a trackpad pinch, which browsers deliver as a wheel event with ``ctrlKey``) zooms
about the pointer by ``exp(-deltaY * 0.0015)`` (a 100-px wheel notch is 1.16x; scale clamped). The
"Fit" button fits the whole drawing into the box; levels of more than :data:`MINIMAP_NODES` nodes
get a minimap (a small copy of the drawing with the visible part framed; click or drag it to move).

Search: :meth:`GraphWidget.highlight` marks nodes (the synced ``highlighted`` tokens get the
``slapo-highlighted`` class, the others are dimmed) and asks the browser to centre the first one
(``centre`` + the ``centre_request`` counter). The rule is kept and re-applied to every new drawing
(tokens change with each :meth:`set_graph`), without centring again.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as widgets
from traitlets import Dict, Int, List, Unicode

from .. import __version__ as _version

__all__ = ["ACTIONS", "MINIMAP_NODES", "MODULE_NAME", "MODULE_VERSION", "GraphWidget"]

#: npm package / widget module name of the browser half.
MODULE_NAME = "slapo-lab"
#: Semver range of the browser module this Python class talks to: the distribution's version, which is the
#: labextension's (pyproject.toml reads it from package.json: ``[tool.hatch.version] source = "nodejs"``).
MODULE_VERSION = "^" + _version.split("+")[0]
#: Drawings with more nodes than this get a minimap in the browser (``widget.ts`` ``MINIMAP_NODES``).
MINIMAP_NODES = 40

_EVENTS = ("click", "dblclick", "action", "panel")
#: The actions a browser ``action`` message may name (keyboard shortcuts, context menus, command palette).
ACTIONS = (
    "undo",
    "redo",
    "checkpoint",
    "cut",
    "shard",
    "sync",
    "open",
    "up",
    "select",
    "similar",
    "panel",
)
#: A token made with :meth:`GraphWidget.next_token_prefix`: ``d<drawing>n<node>``.
_DRAWN_TOKEN = re.compile(r"d(\d{1,18})n\d{1,18}")
_log = logging.getLogger(__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _event_problem(content: Any) -> str | None:
    """Why a browser message is not one this widget handles (not a JSON object, no or an unknown
    ``event``), or None."""
    if not isinstance(content, dict):
        return f"Ignored a graph message that is not a JSON object (got {type(content).__name__})."
    if "event" not in content:
        return "Ignored a graph message without an 'event' field; expected 'click', 'dblclick' or 'action'."
    if content["event"] not in _EVENTS:
        return (
            f"Ignored a graph message with unknown event {_short(content['event'])}; "
            "expected 'click', 'dblclick' or 'action'."
        )
    return None


class GraphWidget(widgets.DOMWidget):
    """An interactive graphviz graph.

    Parameters
    ----------
    svg:
        The SVG text produced by graphviz (``dot -Tsvg``); shown after sanitising in the browser.
    node_ids:
        Token → module path for every clickable node of ``svg``.
    **kwargs:
        Other traits (``selected``, ``height``, layout, ...).

    Synced traits
    -------------
    svg : str
        The graphviz SVG.
    selected : str
        Token of the highlighted node ("" for none).
    height : str
        CSS height of the view, default ``"420px"``.
    reset_view : int
        A counter: each change makes the browser reset pan/zoom to "fit the whole graph".
    render_id : int
        Id of the current drawing; :meth:`set_graph` increments it together with ``svg``.
    highlighted : list[str]
        Tokens of the highlighted nodes (search matches); set with :meth:`highlight`.
    centre : str
        Token of the node to centre the view on; the browser does it each time ``centre_request``
        changes (so asking twice for the same node centres it twice).
    centre_request : int
        A counter: each change makes the browser centre ``centre`` (see :meth:`centre_on`).

    Callbacks are called as ``callback(token, path)`` for clicks and double clicks, and as
    ``callback(message)`` (one sentence) for malformed browser messages. A double click in the
    browser also produces the two clicks before it.
    """

    _model_name = Unicode("GraphModel").tag(sync=True)
    _model_module = Unicode(MODULE_NAME).tag(sync=True)
    _model_module_version = Unicode(MODULE_VERSION).tag(sync=True)
    _view_name = Unicode("GraphView").tag(sync=True)
    _view_module = Unicode(MODULE_NAME).tag(sync=True)
    _view_module_version = Unicode(MODULE_VERSION).tag(sync=True)

    svg = Unicode("", help="graphviz SVG text; sanitised in the browser").tag(sync=True)
    selected = Unicode("", help="token of the highlighted node, '' for none").tag(sync=True)
    height = Unicode("420px", help="CSS height of the view").tag(sync=True)
    reset_view = Int(0, help="bump to reset the browser's pan/zoom").tag(sync=True)
    render_id = Int(0, help="id of the current drawing; clicks carry it back").tag(sync=True)
    highlighted = List(Unicode(), help="tokens of the highlighted nodes (search matches)").tag(sync=True)
    centre = Unicode("", help="token of the node to centre on when centre_request changes").tag(sync=True)
    centre_request = Int(0, help="bump to centre the view on the node `centre`").tag(sync=True)
    action_reasons = Dict(
        value_trait=Unicode(),
        help="action -> '' when it applies to action_target, else the reason it does not",
    ).tag(sync=True)
    action_labels = Dict(value_trait=Unicode(), help="action -> context-menu label").tag(sync=True)
    action_target = Unicode("", help="module path action_reasons describe").tag(sync=True)

    def __init__(self, svg: str = "", node_ids: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        #: Token (graphviz node ``id``) → module path, for the nodes of the current ``svg``.
        self.node_ids: dict[str, str] = dict(node_ids or {})
        self._click_handlers = widgets.CallbackDispatcher()
        self._dblclick_handlers = widgets.CallbackDispatcher()
        self._error_handlers = widgets.CallbackDispatcher()
        self._action_handlers = widgets.CallbackDispatcher()
        self._panel_handlers = widgets.CallbackDispatcher()
        #: The rule of the last :meth:`highlight` (re-applied to each new drawing), or None.
        self._highlight_rule: Callable[[str, Any], bool] | None = None
        super().__init__(svg=svg, **kwargs)
        self.on_msg(self._on_browser_msg)

    # ------------------------------------------------------------------ public API

    def next_token_prefix(self) -> str:
        """The ``token_prefix`` to draw the next :meth:`set_graph`'s SVG with: ``"d<k>n"``, ``k`` the
        ``render_id`` that call will set (``render_svg(G, styles, token_prefix=w.next_token_prefix())``).

        Its tokens (``d<k>n0, d<k>n1, ...``) are then unique across the drawings of this widget, so a
        message naming a token of an older drawing is ignored (one sentence to ``on_error``) even when
        it carries no ``render`` id, instead of selecting the node that now has the same position.
        """
        return f"d{self.render_id + 1}n"

    def set_graph(self, svg: str, node_ids: Mapping[str, str], reset_view: bool = False) -> None:
        """Show a new graph: set ``node_ids`` and ``svg`` together.

        ``reset_view=True`` also resets the browser's pan/zoom (use it when the graph is a
        different one, not a recoloured one). Increments ``render_id``: clicks the browser sends
        for the previous drawing are ignored from now on (with one sentence to ``on_error``). Draw
        ``svg`` with :meth:`next_token_prefix` (called just before) so that its tokens cannot be
        confused with an older drawing's.
        """
        self.node_ids = dict(node_ids)
        with self.hold_sync():
            self.render_id += 1
            self.svg = svg
            self.highlighted = self._matching(self._highlight_rule)
            if self.centre not in self.node_ids:
                self.centre = ""
            if reset_view:
                self.reset_view += 1

    def reset_zoom(self) -> None:
        """Put every browser view back to its home view (resets pan and zoom)."""
        self.reset_view += 1

    def highlight(
        self,
        match: Callable[[str, Any], bool] | Iterable[str] | None,
        centre: bool = True,
    ) -> list[str]:
        """Highlight the nodes ``match`` names and (``centre=True``) centre the view on the first.

        ``match`` is ``callback(token, node)`` → bool, asked for every node of the current drawing
        in drawing order (``node`` is the ``node_ids`` value), or a collection of ``node_ids`` values
        (module paths) to highlight, or None (or empty) to clear. The rule is kept: each later
        :meth:`set_graph` highlights the matching nodes of the new drawing (without centring). Returns
        the highlighted tokens; a rule that raises highlights nothing and is reported to ``on_error``.
        """
        if match is None:
            rule = None
        elif callable(match):
            rule = match
        else:
            wanted = {str(path) for path in match}
            rule = (lambda _tok, node: node in wanted) if wanted else None
        self._highlight_rule = rule
        tokens = self._matching(rule)
        with self.hold_sync():
            self.highlighted = tokens
            if centre and tokens:
                self.centre_on(tokens[0])
        return tokens

    def centre_on(self, token: str) -> bool:
        """Ask every browser view to centre ``token``'s node; False (nothing asked) if it is not drawn."""
        if token not in self.node_ids:
            return False
        with self.hold_sync():
            self.centre = token
            self.centre_request += 1
        return True

    def on_node_click(self, callback: Callable[[str, str], Any], remove: bool = False) -> None:
        """Register ``callback(token, path)`` for clicks on a node (``remove=True`` unregisters)."""
        self._click_handlers.register_callback(callback, remove=remove)

    def on_node_dblclick(self, callback: Callable[[str, str], Any], remove: bool = False) -> None:
        """Register ``callback(token, path)`` for double clicks on a node (``remove=True`` unregisters)."""
        self._dblclick_handlers.register_callback(callback, remove=remove)

    def on_action(self, callback: Callable[[str, str | None, str | None], Any], remove: bool = False) -> None:
        """Register ``callback(action, token, path)`` for browser actions (keys, context menus, palette);
        ``token`` and ``path`` are None when the message named no node."""
        self._action_handlers.register_callback(callback, remove=remove)

    def on_panel(self, callback: Callable[[bool, str], Any], remove: bool = False) -> None:
        """Register ``callback(opened, reason)``: the browser's answer to :meth:`open_panel`."""
        self._panel_handlers.register_callback(callback, remove=remove)

    def set_action_reasons(
        self, target: str, reasons: Mapping[str, str | None], labels: Mapping[str, str] | None = None
    ) -> None:
        """Sync, in one message, the context-menu state for module ``target``: ``reasons`` (action → None or
        "" when it applies, else one sentence) and optional ``labels`` (action → menu label)."""
        with self.hold_sync():
            self.action_reasons = {str(k): str(v or "") for k, v in reasons.items()}
            if labels is not None:
                self.action_labels = {str(k): str(v) for k, v in labels.items()}
            self.action_target = target

    def front_end_problem(self) -> str | None:
        """None if this widget's comm reaches a Jupyter kernel's front end, else one sentence why not."""
        comm = getattr(self, "comm", None)
        if comm is None:
            return "The graph widget is closed, so no browser front end can be asked."
        if type(comm).__name__ == "DummyComm" or getattr(comm, "kernel", True) is None:
            return "No Jupyter front end is connected to this Python process (it is not running in a kernel)."
        return None

    def open_panel(self, model_id: str) -> str | None:
        """Ask the browser to show widget ``model_id`` in a JupyterLab main-area panel beside the notebook.

        Returns None when the request was sent (the browser answers with a ``panel`` event, see
        :meth:`on_panel`), else one sentence why it could not be (no front end: e.g. a plain Python process).
        """
        problem = self.front_end_problem()
        if problem is not None:
            return problem
        if not isinstance(model_id, str) or not model_id:
            return "There is no widget to open in a panel (no model id)."
        self.send({"cmd": "open_panel", "model_id": model_id})
        return None

    def on_error(self, callback: Callable[[str], Any], remove: bool = False) -> None:
        """Register ``callback(message)``, called with one sentence for each malformed browser message."""
        self._error_handlers.register_callback(callback, remove=remove)

    # ------------------------------------------------------------------ internals

    def _matching(self, rule: Callable[[str, Any], bool] | None) -> list[str]:
        """Tokens of the current drawing that ``rule`` accepts (drawing order); [] if it raises."""
        if rule is None:
            return []
        try:
            return [tok for tok, node in self.node_ids.items() if rule(tok, node)]
        except Exception as exc:  # noqa: BLE001 - a bad rule must not break a redraw
            _log.exception("slapo-lab GraphWidget highlight rule failed")
            self._report(f"Highlighting failed ({type(exc).__name__}: {exc}); nothing is highlighted.")
            return []

    def _on_browser_msg(self, _widget: Any, content: Any, _buffers: Any = None) -> None:
        """Validate one custom message from the browser and dispatch it; never raises."""
        try:
            problem = self._dispatch(content)
        except Exception as exc:  # noqa: BLE001 - a bug here must not break the comm
            problem = f"The graph widget failed to handle a browser message ({type(exc).__name__}: {exc})."
            _log.exception("slapo-lab GraphWidget message handler failed")
        if problem is not None:
            self._report(problem)

    def _dispatch(self, content: Any) -> str | None:
        """Hand one browser message to its handlers; returns why it was ignored (one sentence), or None."""
        why = _event_problem(content)
        if why is not None:
            return why
        event = content["event"]
        if event == "panel":
            return self._dispatch_panel(content)
        if event == "action":
            return self._dispatch_action(content)
        token, why = self._node_token(content, f"'{event}'")
        if why is not None:
            return why
        handlers = self._click_handlers if event == "click" else self._dblclick_handlers
        handlers(token, self.node_ids[token])
        return None

    def _dispatch_action(self, content: dict) -> str | None:
        """An ``action`` message (a key, the context menu, the palette): on its node, or on the selection
        when it names none (``select`` needs one)."""
        if "action" not in content:
            return "Ignored an 'action' message without an 'action' field."
        action = content["action"]
        if not isinstance(action, str) or action not in ACTIONS:
            return (
                f"Ignored an 'action' message with unknown action {_short(action)}; expected one of "
                f"{', '.join(ACTIONS)}."
            )
        if content.get("node") is None:
            if action == "select":
                return "Ignored a 'select' action without a 'node' field."
            self._action_handlers(action, None, None)
            return None
        token, why = self._node_token(content, f"'{action}' action")
        if why is not None:
            return why
        self._action_handlers(action, token, self.node_ids[token])
        return None

    def _node_token(self, content: dict, what: str) -> tuple[Any, str | None]:
        """``(token, None)`` for a message's node of the graph drawn now, else ``(None, why it was ignored)``
        (``what`` names the message in that sentence)."""
        if "node" not in content:
            return None, f"Ignored a {what} message without a 'node' field."
        token = content["node"]
        if not isinstance(token, str):
            return None, f"Ignored a {what} message whose node is not a string (got {type(token).__name__})."
        why = self._render_problem(content, what)
        if why is None and token not in self.node_ids:
            why = self._unknown_node(token, what)
        return (None, why) if why is not None else (token, None)

    def _render_problem(self, content: dict, what: str) -> str | None:
        """Why a message's ``render`` id (the drawing it was sent from) is not the one shown now, or None."""
        if "render" not in content:
            return None
        rid = content["render"]
        if not isinstance(rid, int) or isinstance(rid, bool):
            return f"Ignored a {what} message whose render id is not an integer (got {type(rid).__name__})."
        if rid != self.render_id:
            return (
                f"Ignored a {what} on the graph as drawn before the last redraw (drawing {rid}, "
                f"now {self.render_id}); click the node again."
            )
        return None

    def _unknown_node(self, token: str, what: str) -> str:
        """The sentence for a node token not in the current graph: of an earlier drawing, or unknown."""
        drawn = _DRAWN_TOKEN.fullmatch(token)
        if drawn is not None and int(drawn.group(1)) != self.render_id:
            return (
                f"Ignored a {what} on node {_short(token)} of drawing {drawn.group(1)}, not of the graph "
                f"shown now (drawing {self.render_id}); click the node again."
            )
        return f"Ignored a {what} on node {_short(token)}, which is not in the current graph."

    def _dispatch_panel(self, content: dict) -> str | None:
        opened = content.get("opened")
        if not isinstance(opened, bool):
            return f"Ignored a 'panel' message whose 'opened' is not true or false (got {_short(opened)})."
        reason = content.get("reason", "")
        if not isinstance(reason, str):
            return f"Ignored a 'panel' message whose reason is not a string (got {type(reason).__name__})."
        self._panel_handlers(opened, reason[:300])
        return None

    def _report(self, message: str) -> None:
        if self._error_handlers.callbacks:
            try:
                self._error_handlers(message)
            except Exception:  # noqa: BLE001 - CallbackDispatcher catches already; keep the promise anyway
                _log.exception("slapo-lab GraphWidget error callback failed")
        else:
            _log.warning("%s", message)
