"""The losses a run trains on, and the batch helpers around them.

* the model's own loss when the batch carries labels (:func:`model_loss`), else the probe objective of benchmark
  runs (:func:`probe_loss`: the mean squared projection of the first output onto a fixed random unit vector);
* the token cross entropy of causal and masked language models (:func:`token_losses`; causal LM shifts by one
  as transformers' ``ForCausalLMLoss`` in ``transformers/loss/loss_utils.py``), summed over labelled tokens
  for evaluation, and the last pipeline stage's loss (:class:`PipelineLoss`);
* batches as dicts of tensors: moved to a device (:func:`to_device`), concatenated (:func:`cat_batches`), and
  split into inputs and target (:func:`split_target`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..verify import flatten_outputs
from .process import RunError


def first_tensor(outputs: Any) -> torch.Tensor:
    """The first floating-point tensor of a model output (tensor, tuple or HF ModelOutput)."""
    items = [t for name, t in flatten_outputs(outputs) if name != "loss"]
    if not items:
        raise RunError("The model returned no floating-point tensor to train on.")
    return items[0]


_PROBES: dict = {}


def probe_loss(hidden: torch.Tensor, seed: int) -> torch.Tensor:
    """The synthetic objective of benchmark runs without labels: the mean squared projection of
    ``hidden`` (..., d) onto a fixed random unit vector of size d (seeded; the same on every rank)."""
    key = (hidden.shape[-1], str(hidden.device), seed)
    if key not in _PROBES:
        probe = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(seed))
        _PROBES[key] = (probe / probe.norm()).to(hidden.device)
    return (hidden.float() @ _PROBES[key]).square().mean()


def no_cache_kwargs(model: nn.Module) -> dict:
    """``{"use_cache": False}`` for a model whose ``forward`` takes ``use_cache`` (Hugging Face decoders and
    encoder-decoders), else ``{}``.

    A training or evaluation forward never reads a key/value cache, but a Hugging Face model builds one when
    ``use_cache`` is left to its config (``DynamicCache`` in ``LlamaModel.forward``): it holds every layer's keys
    and values until the step ends, and under ``--compile`` each block's guard on its own cache entry recompiles
    the block, until dynamo's recompile limit stops the run (seen on an H200 with a 22-layer Llama).
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def model_loss(outputs: Any, seed: int) -> torch.Tensor:
    """The model's own loss (labels were given), else :func:`probe_loss` of its first output."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    return loss if loss is not None else probe_loss(first_tensor(outputs), seed)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, objective: str | None) -> torch.Tensor:
    """The cross entropy of every labelled token, float32 ``(tokens,)``; ``-100`` labels count nothing.

    ``logits`` ``(batch, seq, vocab)``, ``labels`` ``(batch, seq)``; causal LM: token ``t``'s logits predict
    label ``t + 1`` (transformers' ``ForCausalLMLoss`` shift), masked LM: label ``t`` itself.
    """
    if objective == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="none"
    )


def labelled_tokens(labels: torch.Tensor, objective: str | None) -> int:
    """The number of tokens :func:`token_losses` counts in ``labels`` ``(batch, seq)`` (-100: none)."""
    if objective == "causal_lm":
        labels = labels[:, 1:]
    return int((labels != -100).sum())


class PipelineLoss:
    """``loss_fn(output, target)`` of the last pipeline stage: next-token cross entropy (causal LM, as
    transformers' ``ForCausalLMLoss``), token cross entropy ignoring -100 (masked LM), or the probe.

    It averages over the micro-batch's labelled tokens; inside :meth:`summed` (evaluation) it returns their
    float64 sum instead (a micro-batch of padding rows adds 0), so that a loss over several micro-batches
    is the sum over all their tokens divided by the count, however they were cut.
    """

    def __init__(self, objective: str | None, seed: int) -> None:
        self.objective = objective
        self.seed = seed
        self.sum = False

    def __call__(self, output, target):
        if self.objective not in ("causal_lm", "masked_lm"):
            return probe_loss(output, self.seed)
        if self.sum:
            return token_losses(output, target, self.objective).double().sum()
        if self.objective == "causal_lm":
            output, target = output[:, :-1], target[:, 1:]
        return torch.nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )

    @contextlib.contextmanager
    def summed(self) -> Iterator[PipelineLoss]:
        """Within the block, the loss is the float64 sum over labelled tokens."""
        self.sum = True
        try:
            yield self
        finally:
            self.sum = False


def pipeline_loss_fn(objective: str | None, seed: int) -> PipelineLoss:
    """The last pipeline stage's :class:`PipelineLoss` for ``objective`` (``"causal_lm"``, ``"masked_lm"``,
    or None: the probe loss of ``seed``)."""
    return PipelineLoss(objective, seed)


def to_device(batch: dict, device: str) -> dict:
    """``batch`` with its tensors moved to ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def cat_batches(batches: list[dict]) -> dict:
    """One batch of ``batches`` concatenated along their first dimension (0-d tensors and other values: the
    first batch's)."""
    out = {}
    for k, v in batches[0].items():
        out[k] = torch.cat([b[k] for b in batches]) if isinstance(v, torch.Tensor) and v.dim() else v
    return out


def split_target(batch: dict, n: int, device: str) -> tuple[dict, torch.Tensor]:
    """``(inputs, target)``: ``batch`` without its ``labels``, and the labels (a zero vector of one value per row
    without them, the probe loss's unused target, on ``device``); ``n``, the micro-batches the caller cuts it
    into, changes nothing."""
    batch = dict(batch)
    target = batch.pop("labels", None)
    if target is None:
        rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
        target = torch.zeros(rows, device=device)
    return batch, target
