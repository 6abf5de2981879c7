"""Slapo's fused MLP (Slapo 0.0.3 ``slapo/op/mlp.py``)."""

from __future__ import annotations

import torch

from .linear import LinearWithAct, LinearWithDropout


class FusedMLP(torch.nn.Module):
    """``fc_out(act(fc_in(x)))`` with bias + activation and bias + dropout fused (Slapo 0.0.3
    ``slapo/op/mlp.py``), for GPT-style MLPs whose two linears have biases.

    ``forward(hidden_states)``: ``(*, hidden_size)`` -> ``(*, hidden_size)``; parameters ``fc_in.weight``
    ``(intermediate_size, hidden_size)``, ``fc_out.weight`` ``(hidden_size, intermediate_size)`` and their
    biases. ``orig_act``: ``"gelu"`` or ``"gelu_new"`` (HF's ``activation_function``); dropout ``resid_pdrop``
    after ``fc_out`` in training mode. (Slapo passed ``orig_act`` as ``bias`` by mistake and always used its
    tanh GELU; here the activation is the one named.)

    Raises:
        ScheduleError: an unsupported ``orig_act`` or a dropout probability outside ``[0, 1]``.
    """

    def __init__(self, hidden_size, intermediate_size, orig_act, resid_pdrop, use_torchscript=False):
        super().__init__()
        self.fc_in = LinearWithAct(hidden_size, intermediate_size, act_fn=orig_act)
        self.fc_out = LinearWithDropout(
            intermediate_size, hidden_size, p=resid_pdrop, use_torchscript=use_torchscript
        )

    def forward(self, hidden_states):
        return self.fc_out(self.fc_in(hidden_states))
