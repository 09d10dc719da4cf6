"""Inference linear layers through oneDNN with weights packed once, for CPU generation.

On a 2-core CPU, a batched generation pass of ~30 tokens spends about as long in the model's
linear layers as in attention, and PyTorch's default float32 ``linear`` (MKL) reaches well
under the cores' peak at such widths: the whole builtin model's linears at 34 tokens took
2.2 ms through MKL against 1.6 ms through oneDNN with weights laid out for it beforehand
(AMD EPYC, 2 threads). One token at a time stays faster through MKL, so a layer only takes the
packed path for inputs of :data:`MIN_TOKENS` tokens or more.

The packed copy of a weight is remade whenever the weight changes in place (its version
counter), so a model trained between generations (PPO) is always used as it is now.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Inputs with fewer tokens (rows of the flattened input) keep ``torch.nn.functional.linear``.
MIN_TOKENS = 2
#: Tokens the packed layout is tuned for (oneDNN's batch-size hint).
TOKENS_HINT = 64


def _packable(layer: torch.nn.Linear) -> bool:
    w = layer.weight
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and w.numel() > 0 and (layer.bias is None or layer.bias.dtype == torch.float32))


class PackedLinears:
    """The float32 CPU ``nn.Linear`` layers of ``model``, run through packed oneDNN weights
    inside :meth:`active` (inference only: under autograd a layer keeps its own forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules()
                       if isinstance(m, torch.nn.Linear) and _packable(m)]
        self._packed: dict[int, tuple[int, int, torch.Tensor]] = {}
        self._forwards = [_Bound(self, layer) for layer in self.layers]
        self.enabled = bool(self.layers) and self._matches()

    def _weight(self, layer: torch.nn.Linear) -> torch.Tensor:
        w = layer.weight
        seen = self._packed.get(id(layer))
        if seen is None or seen[0] != w.data_ptr() or seen[1] != w._version:
            seen = (w.data_ptr(), w._version,
                    torch.ops.mkldnn._reorder_linear_weight(w.detach(), TOKENS_HINT))
            self._packed[id(layer)] = seen
        return seen[2]

    def _forward(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        if (x.numel() < MIN_TOKENS * x.shape[-1] or x.dtype != torch.float32
                or weight.dtype != torch.float32 or torch.is_grad_enabled()):
            return torch.nn.functional.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._weight(layer), None if bias is None else bias.detach(),
            "none", [], "")

    def _matches(self) -> bool:
        """Whether this build runs the packed path and gives each layer's own outputs."""
        try:
            with torch.inference_mode():
                for layer in self.layers[:2]:
                    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
                    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                    got = self._forward(layer, x)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                        log.info("packed linear layers disagree with torch's; not used")
                        return False
            return True
        except (RuntimeError, AttributeError) as err:  # no oneDNN in this torch build
            log.info("packed linear layers unavailable (%s)", str(err).splitlines()[0])
            return False
        finally:
            self._packed.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The layers take the packed path for the length of the block (the model is shared,
        e.g. PPO trains it between generations)."""
        if not self.enabled:
            yield
            return
        # Straight into the instances' dicts: nn.Module's own attribute handling costs more
        # than the layers' arithmetic in a one-token pass.
        for layer, forward in zip(self.layers, self._forwards, strict=True):
            layer.__dict__["forward"] = forward
        try:
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)


class _Bound:
    """``layer.forward`` through :meth:`PackedLinears._forward`."""

    __slots__ = ("layer", "owner")

    def __init__(self, owner: PackedLinears, layer: torch.nn.Linear) -> None:
        self.owner, self.layer = owner, layer

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.owner._forward(self.layer, x)
