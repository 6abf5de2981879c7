"""The editor's graph panel: the module tree and its search, the breadcrumbs, the graph of one level and the legend.

:class:`GraphPanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` it draws) and inherits
nothing from it. It records the model's dataflow once (:func:`slapo_lab.graph.record_dataflow` on the meta copy),
draws the level the state shows (:meth:`GraphPanel.refresh_graph`: graphviz through
:func:`slapo_lab.graph.render_svg`, redrawn only when the level, its nodes or their looks changed), folds and unfolds
runs of repeated blocks, highlights search hits and similar modules, and turns the browser's clicks, keys, context
menus and palette commands into the state's public calls (``select``, ``open_level``, ``apply``, ``undo`` ...).
What it records is kept on the editor under the names the tests read (``_flow``, ``_flow_error``, ``_last_graph``).
"""

from __future__ import annotations

import html
import logging
from typing import Any

import ipywidgets as W
import networkx as nx

from .. import graph as graph_module
from .. import module_state
from ..call_order import cached_call_order
from ..graph.dataflow import DataflowError, per_rank_edges
from ..plan import stage_assignment
from ..utils import to_meta
from .graph_widget import GraphWidget
from .memory_panel import set_silently

__all__ = ["GraphPanel"]

_log = logging.getLogger("slapo_lab.editor")


class GraphPanel:
    """The module tree, the search box, the breadcrumbs, the graph and the legend.

    Args:
        editor: the editor (its state: ``schedule``, ``level``, ``selected``, ``expanded``, ``select``,
            ``open_level``, ``collapse``, ``apply``, and its ``_style`` / ``_folded_style`` / ``_legend_html``
            looks, the message line).

    Attributes:
        tree (``ipywidgets.Select``), search (``Text``), search_info (``HTML``: "No module matches ..."),
        crumbs (``HBox`` of level buttons), graph (:class:`~slapo_lab.editor.graph_widget.GraphWidget`),
        legend (``HTML``), left (the tree column), center (crumbs, graph, legend).
    """

    def __init__(self, editor) -> None:
        self.editor = ed = editor
        self.searching = False
        self.crumbs_key = None
        self.tree_rows = self.tree_rows_of_schedule()
        self.tree = W.Select(options=self.tree_visible(), rows=30, layout=W.Layout(width="100%"))
        self.tree.observe(self.on_tree, names="value")
        self.tree.add_class("slapo-tree")
        self.search = W.Text(placeholder="search name or type", layout=W.Layout(width="100%"))
        self.search.observe(lambda ch: ed.search(ch["new"]), names="value")
        self.search.add_class("slapo-search")
        self.search_info = W.HTML()  # "No module matches 'xyz'." instead of an empty tree
        self.search_info.add_class("slapo-search-info")
        self.crumbs = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self.graph = GraphWidget(height="600px", layout=W.Layout(width="100%"))
        self.graph.on_node_click(lambda tok, path: ed._on_node_click(path))
        self.graph.on_node_dblclick(lambda tok, path: ed._on_node_dblclick(path))
        self.graph.on_error(ed._error)
        self.graph.on_action(ed._on_browser_action)  # keys, context menus, command palette
        self.graph.on_panel(self.on_panel_answer)
        self.legend = W.HTML()
        self.legend.add_class("slapo-legend")
        self.left = W.VBox(
            [W.HTML("<b>Modules</b>"), self.search, self.search_info, self.tree],
            layout=W.Layout(width="22%"),
        )
        self.center = W.VBox([self.crumbs, self.graph, self.legend], layout=W.Layout(width="48%"))

    # ------------------------------------------------------------------ the module tree and its search
    def tree_rows_of_schedule(self) -> list[tuple[str, int, str, bool]]:
        """Every module as a tree row ``(path, depth, "name · Type", has children)``, in tree order."""
        rows = []
        for path, node in self.editor.schedule.named_schedules():
            depth = path.count(".") + 1 if path else 0
            rows.append(
                (path, depth, (node.name or "(model)") + f" · {type(node.mod).__name__}", bool(node.child))
            )
        return rows

    def all_tree_options(self) -> list[tuple[str, str]]:
        """Every module as an indented ``(label, path)`` row, unfolded (what search filters)."""
        return [(("\u2003" * depth) + text, path) for path, depth, text, _ in self.tree_rows]

    def tree_visible(self) -> list[tuple[str, str]]:
        """The tree as shown: a module's children are listed only while it is open, and the open modules are
        the selected one, the level the graph shows, and their ancestors (selecting a row opens it, selecting
        an ancestor folds the rest away). A 70B model shows ~90 rows instead of ~1,000. ▸ marks a closed module
        with submodules, ▾ an open one."""
        open_ = {""}
        for path in (self.editor.selected, self.editor.level):
            parts = path.split(".") if path else []
            open_.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out = []
        for path, depth, text, has_children in self.tree_rows:
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            if path and parent not in open_:
                continue
            mark = ("\u25be " if path in open_ else "\u25b8 ") if has_children else ""
            out.append((("\u2003" * depth) + mark + text, path))
        return out

    def refresh_tree(self) -> None:
        """Show the collapsed tree for the current selection (unless a search lists its matches)."""
        if self.searching:
            return
        opts = self.tree_visible()
        if list(self.tree.options) != opts:
            sel = self.editor.selected
            keep = sel if any(p == sel for _, p in opts) else None
            set_silently(self.tree, self.on_tree, options=opts, value=keep)

    def show_selected(self) -> None:
        """Select the selected module's row in the tree when it is listed (without calling back)."""
        sel = self.editor.selected
        if self.tree.value != sel and any(p == sel for _, p in self.tree.options):
            set_silently(self.tree, self.on_tree, value=sel)

    def on_tree(self, change) -> None:
        path = change["new"]
        if path is None or path == self.editor.selected:
            return
        self.editor.select(path)

    def run_search(self, text: str) -> int:
        """:meth:`ScheduleEditor.search <slapo_lab.editor.app.ScheduleEditor.search>`: filter the tree, highlight
        the graph's matches; returns the number of rows listed."""
        ed = self.editor
        raw = (text or "").strip()
        text = raw.lower()
        self.searching = bool(text)
        opts = (
            self.tree_visible()
            if not text
            else [
                (f"{path or '(model)'} · {label.rsplit(' · ', 1)[-1]}", path)
                for label, path in self.all_tree_options()
                if text in label.lower() or text in path.lower()
            ]
        )
        keep = ed.selected if any(p == ed.selected for _, p in opts) else None
        set_silently(self.tree, self.on_tree, options=opts, value=keep)
        none = bool(text) and not opts
        self.tree.layout.display = "none" if none else None
        self.search_info.value = f"No module matches '{html.escape(raw)}'." if none else ""
        hits = {p for _, p in opts} if text else set()
        inside = {".".join(p.split(".")[:i]) for p in hits for i in range(1, p.count(".") + 1)}

        def shows_match(_token: str, node: Any) -> bool:  # re-applied to every redraw of the graph
            G = ed._last_graph
            data = G.nodes[node] if G is not None and node in G else {}
            if data.get("kind") not in ("module", "folded"):
                return False
            members = data.get("members") or [data.get("path", node)]
            return any(m in hits or m in inside for m in members)

        self.graph.highlight(shows_match if hits else None)
        return len(opts)

    # ------------------------------------------------------------------ graph nodes and navigation
    def is_folded(self, node_path: str) -> bool:
        G = self.editor._last_graph
        if G is not None and node_path in G:
            return G.nodes[node_path].get("kind") == "folded"
        return False

    def resolve_node(self, node_path: str) -> str | None:
        """Map a graph node (module path, folded range 'a.b.0-11', input/output) to a module path."""
        ed = self.editor
        if node_path in ed.schedule:
            return node_path
        if self.is_folded(node_path):
            first = ed._last_graph.nodes[node_path].get("path")
            if first in ed.schedule:
                return first
        return None

    def on_node_dblclick(self, path: str) -> None:
        """Unfold a folded run of repeated blocks, or open a module's level; busy state meanwhile."""
        ed = self.editor
        folded = self.is_folded(path)
        target = path if folded else self.resolve_node(path)
        if target is None or not (folded or ed.schedule[target].child):
            return
        what = f"unfolding {target}" if folded else f"opening {target}"
        try:
            with ed._working(what):
                if folded:
                    ed.expanded.add(target)
                    ed._refresh_view(reset_view=True)
                else:
                    ed.open_level(target)
        except Exception as err:  # noqa: BLE001 - never let a double-click kill the kernel
            _log.exception("double-click failed")
            if folded:
                ed.expanded.discard(target)
            ed._error(
                f"Could not show {target}: drawing the graph failed ({type(err).__name__}); "
                "the schedule is unchanged."
            )

    def go_up(self) -> None:
        """Show the parent level of the graph and select the module whose level it was (Backspace)."""
        ed = self.editor
        if not ed.level:
            ed._error("The graph already shows the top level of the model.")
            return
        came_from = ed.level
        ed.open_level(came_from.rsplit(".", 1)[0] if "." in came_from else "")
        ed.select(came_from)

    def on_browser_action(self, action: str, token: str | None, path: str | None) -> None:
        """Run one browser action (keyboard shortcut, context menu, command palette) with the same public
        methods as the editor's buttons; anything that does not apply is one sentence in the message line."""
        ed = self.editor
        try:
            view = {"undo": ed.undo, "redo": ed.redo, "panel": ed.open_panel, "up": self.go_up}.get(action)
            if view is not None:
                view()
            elif action == "open":
                self._open_from_browser(path)
            elif self._select_from_browser(action, path) and action != "select":
                self._act_on_selected(action)
        except Exception as err:  # noqa: BLE001 - a key press must never break the kernel
            _log.exception("browser action failed")
            ed._error(f"The {action} action failed ({type(err).__name__}: {err}); the schedule is unchanged.")

    def _open_from_browser(self, path: str | None) -> None:
        """Open the level of the node ``path`` (as a double click does), else of the selected module."""
        ed = self.editor
        if path is not None:
            ed._on_node_dblclick(path)
        elif not ed.schedule[ed.selected].child:
            ed._error(f"{ed.selected or 'The root module'} has no submodules to open.")
        else:
            ed.open_level(ed.selected)

    def _select_from_browser(self, action: str, path: str | None) -> bool:
        """Select the module of the node ``path`` the browser action names (None: the selection stays); False,
        with the sentence shown, when ``path`` is not a module."""
        ed = self.editor
        if path is None:
            return True
        target = self.resolve_node(path)
        if target is None:
            ed._error(f"{path} is not a module: there is nothing to {action} there.")
            return False
        if target != ed.selected:
            ed.select(target)
        return True

    def _act_on_selected(self, action: str) -> None:
        """Run the inspector's ``action`` (similar, checkpoint, cut, shard, sync) on the selected module; any other
        name does nothing."""
        ed = self.editor
        inspector = ed._inspector_panel
        if action == "similar":
            inspector.select_similar()
        elif action == "checkpoint":
            ed.apply("checkpoint")
        elif action == "cut":
            ed.apply("cut_pipeline_stage")
        elif action == "shard":
            inspector.on_shard()
        elif action == "sync":
            sync = inspector.sync.value
            ed.apply("sync", mode=sync[0], sync_op_or_fn=sync[1])

    def on_panel_answer(self, opened: bool, reason: str) -> None:
        if opened:
            self.editor._info(
                reason or "Opened the editor in a panel beside the notebook (the cell's view stays)."
            )
        else:
            self.editor._error(reason or "JupyterLab could not open the editor panel.")

    # ------------------------------------------------------------------ the dataflow and the drawing
    def record_flow(self) -> None:
        """Record the model's dataflow on the meta copy into ``editor._flow`` (``editor._flow_error``: one
        sentence when it was guessed, fell back or failed; the graph then shows modules without edges)."""
        ed = self.editor
        if not ed.example_inputs:
            ed._flow_error = "No example inputs were given, so the graph shows modules without dataflow."
            return
        try:
            # the schedule's meta copy, before any primitive touched it (one copy fewer at start-up)
            try:
                ed._flow = graph_module.record_dataflow(ed._meta_model, to_meta(ed.example_inputs))
            except DataflowError:  # a data-dependent `if t.all():` on meta (HF's packed-sequence check with
                # use_cache=False): record again guessing True; the guesses are listed in flow.assumptions
                ed._flow = graph_module.record_dataflow(
                    ed._meta_model, to_meta(ed.example_inputs), assume_bool=True
                )
                where = ", ".join(sorted({path or "the model" for path, _ in ed._flow.assumptions})[:3])
                ed._flow_error = (
                    f"The dataflow was recorded by assuming that a data-dependent condition in {where} "
                    "is true (meta tensors have no values), so the edges there show that branch only."
                )
            if getattr(ed._flow, "fallback", ""):
                ed._flow_error = f"The dataflow was {ed._flow.fallback.rstrip('.')}."
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            ed._flow = None
            reason = str(err).splitlines()[0][:200].rstrip(".")
            ed._flow_error = (
                "The dataflow could not be recorded, so the graph shows modules without edges and "
                f"every action still works: {reason}."
            )

    def level_graph(self) -> nx.DiGraph:
        """The graph of the level shown: the dataflow's (folded runs kept folded unless expanded), else the
        level's children without edges."""
        ed = self.editor
        if ed._flow is not None:
            try:
                return ed._flow.level_graph(ed.level, expanded=frozenset(ed.expanded))
            except Exception as err:  # noqa: BLE001 - fall back to the plain tree level
                _log.warning("level_graph failed: %s", err)
        G = nx.DiGraph()
        node = ed.schedule[ed.level]
        for name, child in node.child.items():
            G.add_node(
                child.path,
                path=child.path,
                label=f"{name}\n{type(child.mod).__name__}",
                type=type(child.mod).__name__,
                kind="module",
                params=sum(p.numel() for p in child.mod.parameters()),
            )
        return G

    def refresh_graph(self, reset_view: bool = False) -> None:
        """Draw the level (only when it, its nodes or their looks changed, or ``reset_view``), the selection and
        the legend."""
        ed = self.editor
        G = ed._level_graph()
        # edge labels: the shapes this rank sees after sharding (e.g. 2×16×64→32 after a column split)
        per_rank_edges(
            G, ed.world_size, lambda p: ed.schedule[p].mod if p in ed.schedule else None, module_state
        )
        ed._last_graph = G
        stage_of = None
        if ed.schedule.metadata.primitives.get("cut_pipeline_stage"):
            try:
                # by when modules run, once the forward's order is known (never recorded just for this)
                stage_of = stage_assignment(ed.schedule, cached_call_order(ed.schedule)).stage_of
            except Exception:  # noqa: BLE001 - a stale cut: show no bands rather than fail the view
                stage_of = None
        styles = {}
        for n, data in G.nodes(data=True):
            kind = data.get("kind")
            if kind in ("input", "output"):
                continue
            members = [m for m in (data.get("members") or [data.get("path", n)]) if m in ed.schedule]
            data["params_rank"] = sum(p.numel() for m in members for p in ed.schedule[m].mod.parameters())
            if kind == "folded":
                st = ed._folded_style(list(data.get("members") or []), stage_of)
            else:
                st = ed._style(data.get("path", n), stage_of)
            if st:  # no selection here: the browser draws it, so a click never reruns graphviz
                styles[n] = st
        key = (ed.level, tuple(G.nodes), tuple(G.edges), repr(sorted(styles.items())))
        if key != ed._rendered_key or reset_view:  # redraw only what is visible and changed
            # looked up at each call (tests count the renders through slapo_lab.graph.render_svg)
            svg, node_ids = graph_module.render_svg(G, styles, token_prefix=self.graph.next_token_prefix())
            self.graph.set_graph(svg, node_ids, reset_view=reset_view)
            ed._rendered_key = key
        inverse = {p: t for t, p in self.graph.node_ids.items()}
        self.graph.selected = inverse.get(ed.selected, "")
        self.legend.value = ed._legend_html(stage_of)

    def refresh_crumbs(self) -> None:
        """The breadcrumbs: the model, each level down to the one shown, and "fold repeats" when a run is open."""
        ed = self.editor
        key = (ed.level, any(k.startswith(ed.level) for k in ed.expanded))
        if key == self.crumbs_key:
            return
        self.crumbs_key = key
        parts = ed.level.split(".") if ed.level else []
        buttons = []
        acc = ""
        b = W.Button(description=type(ed.model).__name__, layout=W.Layout(width="auto"))
        b.on_click(lambda _: ed.open_level(""))
        buttons.append(b)
        for part in parts:
            acc = f"{acc}.{part}" if acc else part
            b = W.Button(description=part, layout=W.Layout(width="auto"))
            b.on_click(lambda _, p=acc: ed.open_level(p))
            buttons.append(b)
        if any(k.startswith(ed.level) for k in ed.expanded):
            fold = W.Button(
                description="fold repeats",
                icon="compress",
                layout=W.Layout(width="auto"),
                tooltip="fold expanded repeated blocks back into one node",
            )
            fold.on_click(lambda _: ed.collapse())
            buttons.append(fold)
        self.crumbs.children = buttons

    def shown_paths(self) -> set[str]:
        """The module paths the current drawing shows."""
        G = self.editor._last_graph
        return {d.get("path", n) for n, d in G.nodes(data=True)} if G is not None else set()
