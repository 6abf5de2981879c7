"""Python syntax highlighting for the code panel (pygments), coloured by JupyterLab's theme variables."""

from __future__ import annotations

import functools
import html

_CSS = """<style>
.slapo-code-pre{background:var(--jp-cell-editor-background,#f7f7f7);color:var(--jp-content-font-color1,#000000);
 padding:6px;border:1px solid var(--jp-border-color2,#e0e0e0);max-height:260px;overflow:auto;
 font:12px var(--jp-code-font-family,monospace)}
.slapo-code-pre .k,.slapo-code-pre .kn,.slapo-code-pre .ow{color:var(--jp-mirror-editor-keyword-color,#008000);font-weight:bold}
.slapo-code-pre .s,.slapo-code-pre .s1,.slapo-code-pre .s2{color:var(--jp-mirror-editor-string-color,#ba2121)}
.slapo-code-pre .mi,.slapo-code-pre .mf{color:var(--jp-mirror-editor-number-color,#008800)}
.slapo-code-pre .c1,.slapo-code-pre .c{color:var(--jp-mirror-editor-comment-color,#408080);font-style:italic}
.slapo-code-pre .nf,.slapo-code-pre .na{color:var(--jp-mirror-editor-def-color,#0000ff)}
.slapo-code-pre .o,.slapo-code-pre .p{color:var(--jp-mirror-editor-operator-color,#aa22ff)}
</style>"""


@functools.lru_cache(maxsize=1)
def _pygments():
    """``(highlight, lexer, formatter)``, made once (a new formatter per line tripled the cost), or None."""
    try:
        from pygments import highlight  # noqa: PLC0415 - optional dependency
        from pygments.formatters import HtmlFormatter  # noqa: PLC0415 - optional dependency
        from pygments.lexers import PythonLexer  # noqa: PLC0415 - optional dependency
    except ImportError:  # pragma: no cover
        return None
    return highlight, PythonLexer(), HtmlFormatter(nowrap=True)


@functools.lru_cache(maxsize=20000)
def _line(line: str) -> str:
    tools = _pygments()
    if tools is None:  # pragma: no cover
        return html.escape(line)
    highlight, lexer, formatter = tools
    return highlight(line, lexer, formatter).rstrip("\n")


def highlight_python(code: str) -> str:
    """HTML for ``code`` inside ``<pre class="slapo-code-pre">`` with pygments token classes.

    Lines are highlighted one by one and memoised (the recorded schedule is one call per line and only
    grows at the end, so a click costs one line). Falls back to escaped plain text without pygments.
    Output contains no script.
    """
    body = "\n".join(_line(ln) for ln in code.split("\n"))
    return f"{_CSS}<pre class='slapo-code-pre'>{body}</pre>"
