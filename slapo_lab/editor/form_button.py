"""FormButton: an ipywidgets ``Button`` whose click carries the browser's values of the form it submits.

ipywidgets sends a button's click to the kernel at once, but it may hold back a widget's state update while
that widget's previous update is still unanswered: the message throttle in ``@jupyter-widgets/base``
(``src/widget.ts``, ``WidgetModel.sync``) buffers sync messages only, never custom messages such as a click.
Under load a user who picks a preset and presses "apply preset" at once could then have the kernel apply the
previous choice. A FormButton's browser half (``labextension/src/form_button.ts``) sends, with the click, the
state the page shows for each widget of :attr:`FormButton.form`::

    {"event": "click", "form": [{"index": 2}, {"value": 1}, ...]}

(``index`` for selection widgets such as ``Dropdown``, ``value`` for the others), and the kernel applies them
with ``set_state`` (as if their updates had arrived first, observers included) before it runs the click
handlers. The held-back update, when it arrives, then changes nothing.
"""

from __future__ import annotations

import logging

import ipywidgets as widgets
from traitlets import Instance, List, Unicode

from .graph_widget import MODULE_NAME, MODULE_VERSION

__all__ = ["FormButton"]

_log = logging.getLogger(__name__)
_STATE_KEYS = frozenset({"index", "value"})


class FormButton(widgets.Button):
    """A ``Button`` that submits ``form``: its click first applies the page's values of those widgets.

    Args:
        form: the widgets whose values the click handlers read, in the order their values should be set (a
            widget whose observer resets another, e.g. a tensor choice that resets the axis choices, first).
        **kwargs: as :class:`ipywidgets.Button`.

    A malformed ``form`` part of a click message (not a list of one state per widget, or a state the widget
    refuses) is logged and ignored: the click then runs on the values the kernel has, never raises.
    """

    _model_name = Unicode("FormButtonModel").tag(sync=True)
    _model_module = Unicode(MODULE_NAME).tag(sync=True)
    _model_module_version = Unicode(MODULE_VERSION).tag(sync=True)
    _view_name = Unicode("FormButtonView").tag(sync=True)
    _view_module = Unicode(MODULE_NAME).tag(sync=True)
    _view_module_version = Unicode(MODULE_VERSION).tag(sync=True)
    form = List(Instance(widgets.Widget)).tag(sync=True, **widgets.widget_serialization)

    def __init__(self, form=(), **kwargs) -> None:
        super().__init__(form=list(form), **kwargs)

    def _handle_button_msg(self, _, content, buffers) -> None:
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        states = content.get("form")
        if states is not None:
            self._apply_form(states)
        self.click()

    def _apply_form(self, states) -> None:
        if not isinstance(states, list) or len(states) != len(self.form):
            _log.warning(
                "FormButton %r: ignored a click's form of %r (expected %d states)",
                self.description,
                type(states).__name__,
                len(self.form),
            )
            return
        for w, state in zip(self.form, states, strict=False):
            if not (isinstance(state, dict) and state and set(state) <= _STATE_KEYS):
                _log.warning("FormButton %r: ignored the state %r", self.description, state)
                continue
            try:
                w.set_state(state)
            except Exception as err:  # noqa: BLE001 - a refused value leaves the kernel's, never breaks the click
                _log.warning(
                    "FormButton %r: %s refused %r: %s", self.description, type(w).__name__, state, err
                )
