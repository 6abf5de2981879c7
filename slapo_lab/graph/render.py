"""Graphviz rendering of level graphs to SVG, with a layout cache for restyling.

A graph is laid out once by ``dot``; the positions (nodes, edge splines, label positions) are kept in
an LRU cache keyed by a hash of the *structure*: node tokens, shapes, labels (badges included, since
they change node sizes) and edges with their labels.  A later call whose structure hashes the same
(only fill / border colour / pen width differ) feeds the cached positions to ``neato -n2``, which
draws without laying out again.  Graphviz is run as a subprocess (no shell) with a timeout.
"""

from __future__ import annotations

import hashlib
import html
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
_STYLE_KEYS = frozenset({"fill", "color", "badges", "penwidth"})
_MAX_LABEL = 48
_MAX_BADGE = 24
_MAX_BADGES = 6
FAN = 6  # edges of a node with at least this many out (in) edges are drawn unlabelled and merged

FONT = "Helvetica,Arial,sans-serif"

# kind -> (shape, style, default fill, default border)
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
    body = "\\n".join(
        line.replace("\\", "\\\\\\\\").replace('"', '\\"') for line in lines
    )
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
        r = subprocess.run(
            [_exe(prog), *args], input=dot.encode("utf-8"), capture_output=True, timeout=timeout,
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
        return {"hits": _CACHE.hits, "misses": _CACHE.misses, "size": len(_CACHE.data), "maxsize": _CACHE.maxsize}


def clear_layout_cache() -> None:
    """Forget every cached layout and reset the hit / miss counters."""
    with _CACHE.lock:
        _CACHE.data.clear()
        _CACHE.hits = 0
        _CACHE.misses = 0


# -- DOT generation --------------------------------------------------------------------------------
def _node_style(node, attrs: Mapping, style: Mapping | None):
    kind = attrs.get("kind", "module")
    shape, gv_style, fill, border = _KIND_LOOK.get(kind, _KIND_LOOK["module"])
    if kind in ("module", "folded") and attrs.get("ran") is False:
        gv_style += ",dashed"
        fill = "#f4f4f4"
    penwidth = 1.0
    badges: list[str] = []
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
            try:
                penwidth = float(style["penwidth"])
            except (TypeError, ValueError):
                raise ValueError(f"The penwidth for node {display(node)!r} must be a number.") from None
            if not 0 <= penwidth <= 10:
                raise ValueError(f"The penwidth for node {display(node)!r} must be between 0 and 10.")
        raw = style.get("badges") or ()
        if isinstance(raw, str):
            raw = (raw,)
        badges = [display(b, _MAX_BADGE) for b in list(raw)[:_MAX_BADGES]]
    return kind, shape, gv_style, fill, border, penwidth, badges


def _label(attrs: Mapping, node, badges: list[str]) -> str:
    label = attrs.get("label")
    if label is None:
        label = str(node)
    parts = [f"<B>{_html(label)}</B>" if attrs.get("kind") in (None, "module", "folded") else _html(label)]
    sub = attrs.get("sub")
    if sub:
        parts.append(f'<FONT POINT-SIZE="9" COLOR="#555555">{_html(sub)}</FONT>')
    if badges:
        parts.append(
            '<FONT POINT-SIZE="9" COLOR="#8a3b00"><B>'
            + " · ".join(_html(b, _MAX_BADGE) for b in badges)
            + "</B></FONT>"
        )
    return "<" + "<BR/>".join(parts) + ">"


def _tooltip(node, attrs: Mapping) -> str:
    kind = attrs.get("kind", "module")
    if kind == "input":
        lines = [f"input {attrs.get('label', node)}", str(attrs.get("sub", ""))]
    elif kind == "output":
        lines = ["output", str(attrs.get("sub", ""))]
    else:
        lines = [str(attrs.get("path", node)) or "(root)"]
        if attrs.get("label") not in (None, attrs.get("path")) and not str(attrs.get("path", "")).endswith(
            "." + str(attrs.get("label"))
        ):
            lines.append(str(attrs["label"]))
        if kind == "folded":
            members = attrs.get("members") or []
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
    return "\n".join(display(line, 200) for line in lines if line)


def _build(G: nx.DiGraph, styles: Mapping | None):
    """Returns (tokens, node_ids, structure_lines, node_style_attrs, edge_lines)."""
    styles = styles or {}
    tokens: dict = {}
    node_ids: dict[str, object] = {}
    struct: list[str] = []
    looks: dict[str, str] = {}
    for i, (node, attrs) in enumerate(G.nodes(data=True)):
        tok = f"n{i}"
        tokens[node] = tok
        node_ids[tok] = node
        kind, shape, gv_style, fill, border, pw, badges = _node_style(node, attrs, styles.get(node))
        cls = f"slapo-node slapo-{kind}" if kind in _KIND_LOOK else "slapo-node"
        struct.append(f'{tok} [id="{tok}", class="{cls}", shape={shape}, label={_label(attrs, node, badges)}]')
        looks[tok] = (
            f'style="{gv_style}", fillcolor="{fill}", color="{border}", penwidth={pw:g}, '
            f"tooltip={_dot_string(_tooltip(node, attrs))}"
        )
    edges: list[tuple[str, str, str, str]] = []
    busy_any = False
    for j, (u, v, attrs) in enumerate(G.edges(data=True)):
        eid = f"e{j}"
        lab = attrs.get("label")
        if G.out_degree(u) >= FAN or G.in_degree(v) >= FAN:
            # one of many edges leaving / entering a node: no label (shape in the tooltip), and the
            # graph is drawn with concentrate=true; labelled long fan-outs make dot very slow
            busy_any = True
            lab_s = f", tooltip={_dot_string(str(lab))}" if lab else ""
        else:
            lab_s = f", label=<{_html(lab, 80)}>" if lab else ""
        edges.append((eid, tokens[u], tokens[v], lab_s))
    return tokens, node_ids, struct, looks, edges, busy_any


_GRAPH_HEAD = (
    "digraph slapo {{\n"
    '  graph [rankdir={rankdir}, nodesep=0.3, ranksep=0.4, fontname="{font}", id="slapo-graph"{extra}];\n'
    '  node [fontname="{font}", fontsize=11, margin="0.12,0.05"];\n'
    '  edge [fontname="{font}", fontsize=9, color="#777777", fontcolor="#444444", arrowsize=0.7];\n'
)


def render_svg(
    G: nx.DiGraph, styles: Mapping | None = None, *, rankdir: str = "TB", timeout: float = 30.0
) -> tuple[str, dict]:
    """Render a level graph (or any DiGraph) to SVG with graphviz ``dot``, top to bottom.

    Args:
      G: nodes may carry ``label``, ``sub`` (second line), ``kind`` ("module", "folded", "input",
        "output"), ``path``, ``type``, ``params``, ``ran``, ``members``; edges may carry ``label``.
        All text is HTML-escaped and control characters are shown as escapes, so hostile module names
        (quotes, ``<script>``, newlines) cannot break the SVG.
      styles: ``{node id: {"fill": "#rrggbb", "color": "#rrggbb", "badges": ["TP:0", "ckpt"],
        "penwidth": 2.0}}``; every key optional; node ids are those of ``G`` (module paths, fold keys
        such as ``"encoder.layer.0-11"``).  Badges (at most 6, 24 chars each) are a third label line.
      rankdir: graphviz rank direction ("TB" top to bottom, "LR" left to right).
      timeout: seconds allowed for each graphviz subprocess.

    Returns:
      ``(svg, node_ids)``: the SVG text (UTF-8 string; each node is ``<g id="n<i>" class="node">``
      with a ``<title>`` equal to the token and a tooltip; edges are ``<g id="e<j>">``) and a dict
      token -> node id of ``G`` (for level graphs: the module path, the fold key, ``".input:<name>"``
      or ``".output"``).  Tokens are ``n0, n1, ...`` in ``G.nodes`` order; raw names never appear in
      ids.

    Layout: the first render of a structure runs ``dot -Tjson0`` for positions; every render draws
    from cached positions with ``neato -n2``, so renders whose nodes, labels, badges and edges are
    unchanged (only fill / border colour / pen width differ) skip the layout and come out with
    identical geometry.  See :func:`layout_cache_info`.  Edges of a node with at least ``FAN`` (6)
    outgoing (or incoming) edges are drawn without a label (the shape is their tooltip) and the graph
    uses ``concentrate=true``: a source feeding every one of 80 expanded layers would otherwise take
    dot minutes.

    Raises:
      ValueError: a colour that is not ``#rrggbb``, a bad pen width, an unknown style key, or a bad
        ``rankdir``.
      RenderError: graphviz is missing, failed, or timed out.
    """
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be one of TB, LR, BT, RL, got {display(repr(rankdir))}.")
    _tokens, node_ids, struct, looks, edges, busy = _build(G, styles)
    head = ", concentrate=true" if busy else ""
    struct_text = _GRAPH_HEAD.format(rankdir=rankdir, font=FONT, extra=head) + "\n".join(
        [f"  {s};" for s in struct] + [f"  {u} -> {v} [id=\"{e}\"{lab}];" for e, u, v, lab in edges]
    )
    key = hashlib.sha1(struct_text.encode("utf-8")).hexdigest()
    layout = _CACHE.get(key)
    if layout is None:
        out = _run("dot", ["-Tjson0"], struct_text + "\n}\n", timeout)
        layout = _parse_layout(json.loads(out))
        _CACHE.put(key, layout)
    # always draw from the cached positions, so a restyled SVG matches the first one exactly
    dot = _compose(rankdir, struct, looks, edges, layout, head)
    svg = _run("neato", ["-n2", "-Tsvg"], dot, timeout)
    return _strip_svg(svg), node_ids


def _compose(rankdir, struct, looks, edges, layout, extra: str = "") -> str:
    if layout is not None:
        extra += f', bb="{layout["bb"]}"'
    lines = [_GRAPH_HEAD.format(rankdir=rankdir, font=FONT, extra=extra)]
    for s in struct:
        tok = s.split(" ", 1)[0]
        geo = ""
        if layout is not None:
            n = layout["nodes"].get(tok)
            if n is not None:
                geo = f', pos="{n[0]}", width={n[1]}, height={n[2]}'
        lines.append(f"  {s[:-1]}, {looks[tok]}{geo}];\n")
    for e, u, v, lab in edges:
        geo = ""
        if layout is not None:
            g = layout["edges"].get(e)
            if g is not None:
                geo = f', pos="{g[0]}"' + (f', lp="{g[1]}"' if g[1] else "")
        lines.append(f'  {u} -> {v} [id="{e}"{lab}{geo}];\n')
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

    ``entries`` is a mapping text -> colour or an iterable of pairs (order kept).  Text is escaped.
    Raises ``ValueError`` for a colour that is not six-digit hex.
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
    for text, colour in items:
        colour = _check_colour(colour, "legend", text)
        label = display(text, 60)
        rows.append(
            f'<rect x="{pad}" y="{y + 2}" width="{sw}" height="{sw}" rx="2" fill="{colour}" stroke="#4a5568"/>'
            f'<text x="{pad + sw + 6}" y="{y + 12}" font-family="{FONT}" font-size="11">{html.escape(label)}</text>'
        )
        y += row
        width = max(width, pad * 2 + sw + 6 + 7 * len(label))
    height = y + pad
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="slapo-legend" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">' + "".join(rows) + "</svg>"
    )
