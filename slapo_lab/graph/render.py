"""Graphviz rendering of level graphs to SVG, with a layout cache for restyling.

A graph is laid out once by ``dot``; the positions (nodes, edge splines, label positions) are kept in
an LRU cache keyed by a hash of the *structure*: node tokens (always the canonical ``n<i>``; the
``token_prefix`` of the drawn SVG is applied afterwards, so it never misses the cache), shapes,
labels (badges included, since they change node sizes) and edges with their labels.  A later call
whose structure hashes the same (only fill / border colour / pen width differ) feeds the cached
positions to ``neato -n2``, which draws without laying out again.  Graphviz is run as a subprocess
(no shell) with a timeout.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import json
import re
import shutil
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import networkx as nx

HEX = re.compile(r"^#[0-9a-fA-F]{6}$")
_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_STYLE_KEYS = frozenset({"fill", "color", "badges", "penwidth", "band", "dashed", "cut"})
_MAX_LABEL = 48
_MAX_BADGE = 24
_MAX_BADGES = 6
#: Characters of the badge line drawn in a node; the rest is summarised as "+k" (full list in the
#: tooltip), so badges never make a node wider than about this many 10-pt characters.
MAX_BADGE_LINE = 28
FAN = 6  # edges of a node with at least this many out (in) edges are drawn unlabelled and merged
#: Font sizes (points = SVG user units at 1:1): node names, second lines and badges, edge labels.
LABEL_PT, SMALL_PT, EDGE_PT = 12, 10, 10
#: A chain of more than this many single-node ranks (e.g. 80 expanded decoder layers) is wrapped
#: into rows, so the fitted drawing keeps a readable scale instead of becoming a 1-px line.
MAX_CHAIN = 12
#: Colour of the bar and pen of the edges that leave a node that ends a pipeline stage.
CUT_COLOUR = "#d6336c"
#: The schedule's colours, one visual channel per fact (the editor's nodes and legend read them here): fill =
#: tensor parallelism, band on the left = pipeline stage, dashed border = checkpointed, bar on the outgoing
#: edges = cut (:data:`CUT_COLOUR`), halo (drawn by the browser) = selected.
COLUMN_COLOUR = "#c6dbef"  # column parallel / partitioned output (fill)
ROW_COLOUR = "#fdd0a2"  # row parallel / partial sums (fill)
TP_INSIDE_COLOUR = "#e5f5e0"  # a module that contains sharded modules (fill)
CHECKPOINT_COLOUR = "#718096"  # the legend swatch of the dashed border (readable on light and dark)
SELECTED_COLOUR = "#2196f3"  # the legend swatch of the selection halo
STAGE_COLOURS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")

FONT = "Helvetica,Arial,sans-serif"

# kind -> (shape, style, default fill, default border).  The border colour is the node kind's
# only; stage (band), checkpoint (dashed border), cut (bar on the outgoing edges) and selection
# (halo, drawn by the browser) each have their own channel.
_KIND_LOOK = {
    "module": ("box", "rounded,filled", "#ffffff", "#4a5568"),
    "folded": ("box3d", "filled", "#ffffff", "#4a5568"),
    "input": ("ellipse", "filled", "#e8f0fe", "#5b7bb5"),
    "output": ("ellipse", "filled", "#e6f4ea", "#4f8a5b"),
}


class RenderError(RuntimeError):
    """Graphviz could not be run or failed; ``str()`` is one sentence."""


# -- text safety -----------------------------------------------------------------------------------
def display(text, limit: int = _MAX_LABEL) -> str:
    """Text safe to show: control characters written as escapes (``\\n``), cut to ``limit`` chars."""
    s = _CTRL.sub(lambda m: repr(m.group(0))[1:-1], str(text))
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return s


def _html(text, limit: int = _MAX_LABEL) -> str:
    """Escaped text for a graphviz HTML-like label.

    Graphviz expands ``\\N`` / ``\\G`` escapes even inside HTML-like labels (after decoding
    entities), so backslashes are doubled as well.
    """
    return html.escape(display(text, limit), quote=True).replace("\\", "\\\\")


def _dot_string(text: str) -> str:
    """A DOT double-quoted string whose escString expansion is ``text`` literally (``\\n`` = line)."""
    lines = [display(line, 400) for line in str(text).split("\n")]
    body = "\\n".join(line.replace("\\", "\\\\\\\\").replace('"', '\\"') for line in lines)
    return '"' + body + '"'


def _check_colour(value, what: str, path) -> str:
    if not isinstance(value, str) or not HEX.match(value):
        raise ValueError(
            f"The {what} colour for node {display(path)!r} must be a six-digit hex string like "
            f"'#1f77b4', got {display(repr(value))}."
        )
    return value.lower()


# -- graphviz execution ----------------------------------------------------------------------------
_EXE: dict[str, str] = {}


def _exe(name: str) -> str:
    path = _EXE.get(name)
    if path is None:
        path = shutil.which(name)
        if path is None:
            raise RenderError(
                f"The graphviz '{name}' executable was not found on PATH; install graphviz "
                "(e.g. apt-get install graphviz)."
            )
        _EXE[name] = path
    return path


def _run(prog: str, args: list[str], dot: str, timeout: float) -> str:
    try:
        # a fixed argv (dot/neato found on PATH), no shell; the DOT text goes in on stdin, every label escaped
        r = subprocess.run(
            [_exe(prog), *args],
            input=dot.encode("utf-8"),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RenderError(f"Graphviz '{prog}' did not finish within {timeout:g} s.") from None
    if r.returncode != 0:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()
        first = err[0] if err else f"exit status {r.returncode}"
        raise RenderError(f"Graphviz '{prog}' failed: {display(first, 200)}.")
    return r.stdout.decode("utf-8", "replace")


# -- layout cache ----------------------------------------------------------------------------------
class _LayoutCache:
    def __init__(self, maxsize: int = 128):
        self.maxsize = maxsize
        self.data: OrderedDict[str, dict] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.lock = threading.Lock()

    def get(self, key: str):
        with self.lock:
            v = self.data.get(key)
            if v is None:
                self.misses += 1
            else:
                self.hits += 1
                self.data.move_to_end(key)
            return v

    def put(self, key: str, value: dict) -> None:
        with self.lock:
            self.data[key] = value
            self.data.move_to_end(key)
            while len(self.data) > self.maxsize:
                self.data.popitem(last=False)


_CACHE = _LayoutCache()


def layout_cache_info() -> dict:
    """Layout cache statistics: ``{"hits", "misses", "size", "maxsize"}`` (counts since the last
    :func:`clear_layout_cache`)."""
    with _CACHE.lock:
        return {
            "hits": _CACHE.hits,
            "misses": _CACHE.misses,
            "size": len(_CACHE.data),
            "maxsize": _CACHE.maxsize,
        }


def clear_layout_cache() -> None:
    """Forget every cached layout and reset the hit / miss counters."""
    with _CACHE.lock:
        _CACHE.data.clear()
        _CACHE.hits = 0
        _CACHE.misses = 0


def _layers(G: nx.DiGraph) -> dict[int, list]:
    """``{layer: [nodes]}``: the longest-path layers of the DAG ``G`` (``networkx.topological_generations``),
    sources (inputs) placed just above their first consumer, not all in layer 0."""
    layer: dict = {}
    for i, gen in enumerate(nx.topological_generations(G)):
        for n in gen:
            layer[n] = i
    for n in list(layer):
        succ = [layer[m] for m in G.successors(n)]
        if succ and G.in_degree(n) == 0:
            layer[n] = min(succ) - 1
    by_layer: dict[int, list] = {}
    for n, i in layer.items():
        by_layer.setdefault(i, []).append(n)
    return by_layer


# -- DOT generation --------------------------------------------------------------------------------
def _node_style(node, attrs: Mapping, style: Mapping | None):
    kind = attrs.get("kind", "module")
    shape, gv_style, fill, border = _KIND_LOOK.get(kind, _KIND_LOOK["module"])
    if kind in ("module", "folded") and attrs.get("ran") is False:
        gv_style += ",dotted"
        fill = "#f4f4f4"
    penwidth = 1.0
    badges: list[str] = []
    band = None
    cut = False
    if style:
        unknown = set(style) - _STYLE_KEYS
        if unknown:
            raise ValueError(
                f"Unknown style key(s) {sorted(unknown)} for node {display(node)!r}; "
                f"allowed: {sorted(_STYLE_KEYS)}."
            )
        if style.get("fill") is not None:
            fill = _check_colour(style["fill"], "fill", node)
        if style.get("color") is not None:
            border = _check_colour(style["color"], "border", node)
        if style.get("penwidth") is not None:
            penwidth = _check_penwidth(style["penwidth"], node)
        badges = _style_badges(style)
        if style.get("band") is not None:
            band = _check_colour(style["band"], "band", node)
        if style.get("dashed"):
            gv_style = gv_style.replace(",dotted", "") + ",dashed"
            penwidth = max(penwidth, 1.6)
        cut = bool(style.get("cut"))
    return kind, shape, gv_style, fill, border, penwidth, badges, band, cut


def _check_penwidth(value: object, node: object) -> float:
    """A node style's ``penwidth``: a number between 0 and 10.

    Raises:
        ValueError: when it is not a number, or outside that range (one sentence naming the node).
    """
    try:
        penwidth = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"The penwidth for node {display(node)!r} must be a number.") from None
    if not 0 <= penwidth <= 10:
        raise ValueError(f"The penwidth for node {display(node)!r} must be between 0 and 10.")
    return penwidth


def _style_badges(style: Mapping) -> list[str]:
    """A node style's badges (one string or several), each cut for display, at most ``_MAX_BADGES``."""
    raw = style.get("badges") or ()
    if isinstance(raw, str):
        raw = (raw,)
    return [display(b, _MAX_BADGE) for b in list(raw)[:_MAX_BADGES]]


def badge_line(badges: list[str], limit: int = MAX_BADGE_LINE) -> str:
    """The badges as drawn in a node: joined by " · ", cut to about ``limit`` characters.

    Badges that do not fit are summarised as ``"+k"`` (the full list is in the node's tooltip); a
    first badge longer than ``limit`` is cut with "…".  ``[]`` -> ``""``.
    """
    if not badges:
        return ""
    shown: list[str] = []
    used = 0
    for i, b in enumerate(badges):
        rest = len(badges) - i - 1
        extra = len(b) + (3 if shown else 0)
        more = len(f" · +{rest}") if rest else 0
        if used + extra + more <= limit:
            shown.append(b)
            used += extra
            continue
        if not shown:
            shown.append(display(b, max(4, limit - more)))
            if rest:
                shown.append(f"+{rest}")
        else:
            shown.append(f"+{len(badges) - i}")
        break
    return " · ".join(shown)


def _label(attrs: Mapping, node, badges: list[str], band: str | None = None) -> str:
    label = attrs.get("label")
    if label is None:
        label = str(node)
    parts = [f"<B>{_html(label)}</B>" if attrs.get("kind") in (None, "module", "folded") else _html(label)]
    sub = attrs.get("sub")
    if sub:
        parts.append(f'<FONT POINT-SIZE="{SMALL_PT}" COLOR="#555555">{_html(sub)}</FONT>')
    if badges:
        parts.append(
            f'<FONT POINT-SIZE="{SMALL_PT}" COLOR="#8a3b00"><B>'
            + _html(badge_line(badges), MAX_BADGE_LINE + 4)
            + "</B></FONT>"
        )
    text = "<BR/>".join(parts)
    if band is None:
        return "<" + text + ">"
    # the pipeline stage: a coloured band down the node's left side (a table cell)
    return (
        '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>'
        f'<TD BGCOLOR="{band}" WIDTH="7"> </TD><TD CELLPADDING="3">{text}</TD></TR></TABLE>>'
    )


def _tooltip(node, attrs: Mapping, badges: list[str] = ()) -> str:
    kind = attrs.get("kind", "module")
    if kind == "input":
        lines = [f"input {attrs.get('label', node)}", str(attrs.get("sub", ""))]
    elif kind == "output":
        lines = ["output", str(attrs.get("sub", ""))]
    else:
        lines = [*_module_tooltip(node, attrs, kind), *badges]
    return "\n".join(display(line, 200) for line in lines if line)


def _module_tooltip(node: object, attrs: Mapping, kind: str) -> list[str]:
    """The tooltip lines of a module (or folded run) node: its path (or member range), label, class, parameter
    counts, shapes, and whether it ran."""
    lines = [str(attrs.get("path", node)) or "(root)"]
    if attrs.get("label") not in (None, attrs.get("path")) and not str(attrs.get("path", "")).endswith(
        "." + str(attrs.get("label"))
    ):
        lines.append(str(attrs["label"]))
    members = (attrs.get("members") or []) if kind == "folded" else []
    if members:
        lines[0] = f"{members[0]} … {members[-1]}"
    if attrs.get("type") and attrs.get("type") != attrs.get("label"):
        lines.append(str(attrs["type"]))
    if attrs.get("params") is not None:
        lines.append(f"{int(attrs['params']):,} parameters")
    if attrs.get("params_rank") is not None and attrs.get("params_rank") != attrs.get("params"):
        lines.append(f"{int(attrs['params_rank']):,} on this rank")
    if attrs.get("shapes"):
        lines.append(str(attrs["shapes"]))
    if attrs.get("ran") is False:
        lines.append("did not run in the recorded forward")
    return lines


def _build(G: nx.DiGraph, styles: Mapping | None, rows: list[list] = (), prefix: str = "n"):
    """Returns (tokens, node_ids, structure_lines, node_style_attrs, edge_lines, busy).

    ``tokens`` (node -> ``n<i>``), the structure lines, the style attributes and the edges use the
    *canonical* tokens ``n<i>``: the layout pass and its cache key never depend on ``prefix``.
    ``node_ids`` maps the *public* tokens ``<prefix><i>`` (what the drawn SVG carries) to the nodes.
    """
    flat = {(r[k], r[k + 1]) for r in rows for k in range(len(r) - 1)}
    wrap = {(a[-1], b[0]) for a, b in itertools.pairwise(rows)}
    styles = styles or {}
    tokens: dict = {}
    node_ids: dict[str, object] = {}
    struct: list[str] = []
    looks: dict[str, str] = {}
    cut_nodes: set = set()
    for i, (node, attrs) in enumerate(G.nodes(data=True)):
        tok = f"n{i}"
        tokens[node] = tok
        node_ids[f"{prefix}{i}"] = node
        kind, shape, gv_style, fill, border, pw, badges, band, cut = _node_style(
            node, attrs, styles.get(node)
        )
        cls = f"slapo-node slapo-{kind}" if kind in _KIND_LOOK else "slapo-node"
        if band is not None:
            cls += " slapo-staged"
        if "dashed" in gv_style:
            cls += " slapo-ckpt"
        if cut:
            cls += " slapo-cut"
            cut_nodes.add(node)
        struct.append(
            f'{tok} [id="{tok}", class="{cls}", shape={shape}, label={_label(attrs, node, badges, band)}]'
        )
        looks[tok] = (
            f'style="{gv_style}", fillcolor="{fill}", color="{border}", penwidth={pw:g}, '
            f"tooltip={_dot_string(_tooltip(node, attrs, badges))}"
        )
    edges: list[tuple[str, str, str, str]] = []
    busy_any = False
    for j, (u, v, attrs) in enumerate(G.edges(data=True)):
        eid = f"e{j}"
        busy = (u, v) in flat or G.out_degree(u) >= FAN or G.in_degree(v) >= FAN
        busy_any = busy_any or busy
        lab_s = _edge_label(attrs, busy)
        if (u, v) in wrap or (rows and G.out_degree(u) >= FAN):
            # wrapped rows: the row-to-row edge and the fan-out of a shared source (the rotary
            # embedding feeding every layer) must not pull the rows out of their grid
            lab_s += ", constraint=false"
            if (u, v) not in wrap:  # a shared input of every row: drawn light, the chain stays in front
                lab_s += ', color="#b4bcc8", penwidth=0.6, arrowsize=0.4'
        if u in cut_nodes:
            # a pipeline stage ends here: a thick bar across the start of each outgoing edge
            lab_s += f', class="slapo-cut-edge", dir=both, arrowtail=tee, color="{CUT_COLOUR}", penwidth=3'
        edges.append((eid, tokens[u], tokens[v], lab_s))
    return tokens, node_ids, struct, looks, edges, busy_any


def _edge_label(attrs: Mapping, busy: bool) -> str:
    """An edge's DOT label and tooltip attributes; a ``busy`` edge (one of many leaving / entering a node) gets no
    label (its shape is in the tooltip), and the graph is drawn with concentrate=true: labelled long fan-outs
    make dot very slow."""
    lab = attrs.get("label")
    tip = attrs.get("tooltip") or lab
    if busy:
        return f", tooltip={_dot_string(str(tip))}" if tip else ""
    lab_s = f", label=<{_html(lab, 80)}>" if lab else ""
    if tip and tip != lab:
        lab_s += f", tooltip={_dot_string(str(tip))}"
    return lab_s


def _chain_rows(G: nx.DiGraph, max_chain: int = MAX_CHAIN) -> list[list]:
    """Rows (lists of nodes) that wrap the long chains of ``G`` (empty when nothing is long).

    Ranks are longest-path layers (``networkx.topological_generations`` of the DAG); a run of more
    than ``max_chain`` consecutive layers that hold one node each (the layers of a model, expanded)
    is cut into rows of about ``sqrt(0.6 * run)`` nodes (a node is about twice as wide as a row is
    tall), so 80 layers become 12 rows of 7 instead of one column 80 nodes tall.
    """
    if G.number_of_nodes() <= max_chain or not nx.is_directed_acyclic_graph(G):
        return []
    by_layer = _layers(G)
    runs: list[list] = []
    run: list = []
    for i in sorted(by_layer):
        nodes = by_layer[i]
        single = len(nodes) == 1 and not str(nodes[0]).startswith(".")
        if single and run and G.has_edge(run[-1], nodes[0]):
            run.append(nodes[0])
            continue
        if len(run) > max_chain:
            runs.append(run)
        run = list(nodes) if single else []
    if len(run) > max_chain:
        runs.append(run)
    rows = []
    for run in runs:
        width = max(4, round((0.6 * len(run)) ** 0.5))
        rows.extend(run[k : k + width] for k in range(0, len(run), width))
    return rows


def _row_lines(rows: list[list], tokens: dict) -> list[str]:
    """DOT for wrapped rows: one ``rank=same`` subgraph each, and invisible heavy edges between
    the first nodes of consecutive rows so the rows stack left-aligned (layout pass only)."""
    out = ["{rank=same; " + "; ".join(tokens[n] for n in r) + "}" for r in rows]
    out += [
        f"{tokens[a[0]]} -> {tokens[b[0]]} [style=invis, weight=20];" for a, b in itertools.pairwise(rows)
    ]
    return out


_GRAPH_HEAD = (
    "digraph slapo {{\n"
    '  graph [rankdir={rankdir}, nodesep=0.3, ranksep=0.4, fontname="{font}", id="slapo-graph"{extra}];\n'
    '  node [fontname="{font}", fontsize={label_pt}, margin="0.12,0.05"];\n'
    '  edge [fontname="{font}", fontsize={edge_pt}, color="#777777", fontcolor="#444444", arrowsize=0.7];\n'
)


def render_svg(
    G: nx.DiGraph,
    styles: Mapping | None = None,
    *,
    rankdir: str = "TB",
    timeout: float = 30.0,
    token_prefix: str = "n",
) -> tuple[str, dict]:
    """Render a level graph (or any DiGraph) to SVG with graphviz ``dot``, top to bottom.

    Args:
      G: nodes may carry ``label``, ``sub`` (second line), ``kind`` ("module", "folded", "input",
        "output"), ``path``, ``type``, ``params``, ``ran``, ``members``; edges may carry ``label``.
        All text is HTML-escaped and control characters are shown as escapes, so hostile module names
        (quotes, ``<script>``, newlines) cannot break the SVG.
      styles: ``{node id: {"fill": "#rrggbb", "color": "#rrggbb", "badges": ["TP:0", "ckpt"],
        "penwidth": 2.0, "band": "#rrggbb", "dashed": True, "cut": True}}``; every key optional;
        node ids are those of ``G`` (module paths, fold keys such as ``"encoder.layer.0-11"``).
        Badges (at most 6, 24 chars each) are a third label line cut to ``MAX_BADGE_LINE`` characters
        (see :func:`badge_line`; all of them are in the tooltip); ``band`` draws a coloured band down
        the node's left side (pipeline stage), ``dashed`` a dashed border (checkpoint), ``cut`` a bar
        across the start of every outgoing edge (class ``slapo-cut-edge``).  Edges may carry a
        ``tooltip`` (e.g. per-rank shapes from :func:`~slapo_lab.graph.dataflow.per_rank_edges`).
      rankdir: graphviz rank direction ("TB" top to bottom, "LR" left to right).
      timeout: seconds allowed for each graphviz subprocess.
      token_prefix: the node tokens are ``<token_prefix><i>``; default ``"n"`` (``n0, n1, ...``).
        A prefix that names the drawing (``"d7n"`` -> ``d7n0, d7n1, ...``, see
        :meth:`slapo_lab.editor.graph_widget.GraphWidget.next_token_prefix`) makes tokens unique
        across drawings, so a token from an older drawing can never name a node of a newer one.  It
        must be a letter followed by letters, digits or ``_``, end with a letter or ``_`` (so
        ``<prefix><i>`` is never ambiguous), and not be ``"e"`` or start with ``"a_"`` (graphviz's
        edge and anchor ids).  The prefix changes only the drawn ids: the layout cache is shared by
        every prefix.

    Returns:
      ``(svg, node_ids)``: the SVG text (UTF-8 string; each node is ``<g id="<token>" class="node">``
      with a ``<title>`` equal to the token and a tooltip; edges are ``<g id="e<j>">``) and a dict
      token -> node id of ``G`` (for level graphs: the module path, the fold key, ``".input:<name>"``
      or ``".output"``).  Tokens are ``<token_prefix><i>`` (``n0, n1, ...`` by default) in ``G.nodes``
      order; raw names never appear in ids.

    Layout: the first render of a structure runs ``dot -Tjson0`` for positions; every render draws
    from cached positions with ``neato -n2``, so renders whose nodes, labels, badges and edges are
    unchanged (only fill / border colour / pen width differ) skip the layout and come out with
    identical geometry.  See :func:`layout_cache_info`.  Edges of a node with at least ``FAN`` (6)
    outgoing (or incoming) edges are drawn without a label (the shape is their tooltip) and the graph
    uses ``concentrate=true``: a source feeding every one of 80 expanded layers would otherwise take
    dot minutes.  A chain of more than ``MAX_CHAIN`` (12) nodes is wrapped into left-aligned rows
    (80 layers: 12 rows of 7), so the drawing stays about as wide as tall and its 12-pt / 10-pt text
    readable when fitted (top to bottom only).

    Raises:
      ValueError: a colour that is not ``#rrggbb``, a bad pen width, an unknown style key, a bad
        ``rankdir`` or a bad ``token_prefix``.
      RenderError: graphviz is missing, failed, or timed out.
    """
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be one of TB, LR, BT, RL, got {display(repr(rankdir))}.")
    _check_prefix(token_prefix)
    rows = _chain_rows(G) if rankdir == "TB" else []
    tokens, node_ids, struct, looks, edges, busy = _build(G, styles, rows, token_prefix)
    head = ", concentrate=true" if busy else ""
    if rows:
        head += ", newrank=true"
    struct_text = _GRAPH_HEAD.format(
        rankdir=rankdir, font=FONT, label_pt=LABEL_PT, edge_pt=EDGE_PT, extra=head
    ) + "\n".join(
        [f"  {s};" for s in struct]
        + [f"  {r}" for r in _row_lines(rows, tokens)]
        + [f'  {u} -> {v} [id="{e}"{lab}];' for e, u, v, lab in edges]
    )
    key = hashlib.sha1(struct_text.encode("utf-8")).hexdigest()
    layout = _CACHE.get(key)
    if layout is None:
        out = _run("dot", ["-Tjson0"], struct_text + "\n}\n", timeout)
        layout = _parse_layout(json.loads(out))
        _CACHE.put(key, layout)
    # always draw from the cached positions, so a restyled SVG matches the first one exactly
    dot = _compose(rankdir, struct, looks, edges, layout, head, token_prefix)
    svg = _run("neato", ["-n2", "-Tsvg"], dot, timeout)
    return _strip_svg(svg), node_ids


_PREFIX = re.compile(r"^[A-Za-z](?:[A-Za-z0-9_]{0,30}[A-Za-z_])?$")


def _check_prefix(prefix) -> None:
    if not isinstance(prefix, str) or not _PREFIX.match(prefix) or prefix == "e" or prefix.startswith("a_"):
        raise ValueError(
            f"token_prefix must be a letter, then letters, digits or '_', ending in a letter or '_' (not 'e' "
            f"and not starting with 'a_'), like 'n' or 'd7n', got {display(repr(prefix))}."
        )


def _compose(rankdir, struct, looks, edges, layout, extra: str = "", prefix: str = "n") -> str:
    """The DOT drawn by ``neato -n2``: canonical tokens ``n<i>`` (``struct``, ``looks``, ``edges``,
    ``layout``) renamed to the public tokens ``<prefix><i>``."""

    def pub(tok: str) -> str:
        return prefix + tok[1:]

    if layout is not None:
        extra += f', bb="{layout["bb"]}"'
    lines = [_GRAPH_HEAD.format(rankdir=rankdir, font=FONT, label_pt=LABEL_PT, edge_pt=EDGE_PT, extra=extra)]
    for s in struct:
        tok = s.split(" ", 1)[0]
        head = f'{tok} [id="{tok}", '  # how _build starts every node line
        geo = ""
        if layout is not None:
            n = layout["nodes"].get(tok)
            if n is not None:
                geo = f', pos="{n[0]}", width={n[1]}, height={n[2]}'
        p = pub(tok)
        lines.append(f'  {p} [id="{p}", {s[len(head) : -1]}, {looks[tok]}{geo}];\n')
    for e, u, v, lab in edges:
        geo = ""
        if layout is not None:
            g = layout["edges"].get(e)
            if g is not None:
                geo = f', pos="{g[0]}"' + (f', lp="{g[1]}"' if g[1] else "")
        lines.append(f'  {pub(u)} -> {pub(v)} [id="{e}"{lab}{geo}];\n')
    lines.append("}\n")
    return "".join(lines)


def _parse_layout(data: dict) -> dict:
    nodes = {}
    for obj in data.get("objects", []):
        if "pos" in obj:
            nodes[obj["name"]] = (obj["pos"], obj.get("width", "0.75"), obj.get("height", "0.5"))
    edges = {}
    for e in data.get("edges", []):
        if "id" in e and "pos" in e:
            edges[e["id"]] = (e["pos"], e.get("lp"))
    return {"bb": data.get("bb", "0,0,0,0"), "nodes": nodes, "edges": edges}


def _strip_svg(svg: str) -> str:
    """Drop the XML prolog, DOCTYPE and generator comments (ready to inline into HTML)."""
    i = svg.find("<svg")
    return svg[i:] if i >= 0 else svg


# -- legend ----------------------------------------------------------------------------------------
def legend_svg(entries: Mapping[str, str] | Iterable[tuple[str, str]], title: str | None = None) -> str:
    """A small standalone SVG legend: one swatch + text row per ``(text, "#rrggbb")`` entry.

    ``entries`` is a mapping text -> colour or an iterable of pairs (order kept), or of triples
    ``(text, colour, swatch)`` where ``swatch`` draws the channel the colour is shown in: ``"fill"``
    (a filled square, the default), ``"band"`` (a node with a coloured left band), ``"dashed"`` (a
    dashed border), ``"bar"`` (an edge with a bar across its start) or ``"halo"`` (a glow).
    Text is escaped.  Raises ``ValueError`` for a colour that is not six-digit hex or an unknown
    swatch.
    """
    items = list(entries.items()) if isinstance(entries, Mapping) else [tuple(x) for x in entries]
    row, pad, sw = 18, 6, 12
    rows = []
    y = pad
    width = 40
    if title:
        rows.append(
            f'<text x="{pad}" y="{y + 11}" font-family="{FONT}" font-size="11" font-weight="bold">'
            f"{_html(title, 60)}</text>"
        )
        y += row
        width = max(width, 2 * pad + 7 * len(display(title, 60)))
    sw = 18
    for item in items:
        text, colour, kind = (*item, "fill") if len(item) == 2 else item
        colour = _check_colour(colour, "legend", text)
        label = display(text, 60)
        x, t = pad, y + 2
        if kind == "fill":
            mark = f'<rect x="{x}" y="{t}" width="{sw}" height="12" rx="2" fill="{colour}" stroke="#4a5568"/>'
        elif kind == "band":
            mark = (
                f'<rect x="{x}" y="{t}" width="{sw}" height="12" rx="2" fill="#ffffff" stroke="#4a5568"/>'
                f'<rect x="{x + 1}" y="{t + 1}" width="5" height="10" fill="{colour}"/>'
            )
        elif kind == "dashed":
            mark = (
                f'<rect x="{x}" y="{t}" width="{sw}" height="12" rx="2" fill="none" stroke="{colour}" '
                'stroke-width="1.6" stroke-dasharray="4,2"/>'
            )
        elif kind == "bar":
            mark = (
                f'<line x1="{x + 2}" y1="{t}" x2="{x + 2}" y2="{t + 12}" stroke="{colour}" stroke-width="3"/>'
                f'<line x1="{x + 2}" y1="{t + 6}" x2="{x + sw}" y2="{t + 6}" stroke="{colour}" stroke-width="3"/>'
            )
        elif kind == "halo":
            mark = (
                f'<rect x="{x + 1}" y="{t + 1}" width="{sw - 2}" height="10" rx="2" fill="none" '
                f'stroke="{colour}" stroke-width="4" stroke-opacity="0.45"/>'
                f'<rect x="{x + 1}" y="{t + 1}" width="{sw - 2}" height="10" rx="2" fill="none" '
                'stroke="#4a5568"/>'
            )
        else:
            raise ValueError(
                f"Unknown legend swatch {display(repr(kind))}; use fill, band, dashed, bar or halo."
            )
        rows.append(
            mark + f'<text x="{pad + sw + 6}" y="{y + 12}" font-family="{FONT}" font-size="11">'
            f"{html.escape(label)}</text>"
        )
        y += row
        width = max(width, pad * 2 + sw + 6 + 7 * len(label))
    height = y + pad
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="slapo-legend" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">' + "".join(rows) + "</svg>"
    )
