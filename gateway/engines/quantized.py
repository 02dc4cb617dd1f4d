"""Served weight formats of the transformers engine on the CPU (``LIVELORA_ENGINE_WEIGHTS``).

At one stream a CPU decode step reads every weight once, so its speed is bounded by the bytes read:
``fp32`` (4 bytes a weight, what training uses), ``bf16`` (2) and ``int8`` (1, plus one scale per output
channel). ``int8`` is weight-only: each ``nn.Linear`` weight ``W`` ``(d_out, d_in)`` is stored as
``q = round(W / s)`` clamped to ±127 with ``s = max|W_row| / 127`` per output row (symmetric, per channel),
and ``y = (x_bf16 @ qᵀ) · s`` is computed by ``torch._weight_int8pack_mm`` (activations in bfloat16, the
result cast back to the activations' dtype); a row's result never depends on the other rows of the batch.
An adapter version served from merged weights is re-quantized as a whole, ``quantize(W + s·B A)``
(:class:`~.lora_slots.MergedVersion`). Measurements and the choice: ``docs/serving.md``.
"""

from __future__ import annotations

import functools

import torch

#: The values of ``LIVELORA_ENGINE_WEIGHTS``.
WEIGHT_FORMATS = ("fp32", "bf16", "int8")


class Int8Weight:
    """A weight ``(d_out, d_in)`` in symmetric per-output-channel int8 (see the module docstring).

    Attributes:
        q: int8 ``(d_out, d_in)``; scales: bfloat16 ``(d_out,)``.
    """

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            w = weight.detach().float()
            scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            self.q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
            self.scales = scales.to(torch.bfloat16)
        self.shape = tuple(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W̃ᵀ + bias`` for ``x`` ``(..., d_in)`` → ``(..., d_out)`` in ``x``'s dtype (``W̃`` = ``q · s``)."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.q, self.scales).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The served weight ``q · s`` in float32 (for tests and fidelity checks)."""
        return self.q.float() * self.scales.float()[:, None]


def _int8_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module._livelora_int8.linear(x, module.bias)


def quantize_linears(model: torch.nn.Module) -> int:
    """Serve every ``nn.Linear`` of ``model`` (before any LoRA layer is injected) from an :class:`Int8Weight`
    copy of its weight; the float weight stays (it is what an adapter version is merged into, and what
    peft reads shapes from). Returns the number of layers quantized."""
    count = 0
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear and not hasattr(module, "_livelora_int8"):
            module._livelora_int8 = Int8Weight(module.weight)
            module.forward = functools.partial(_int8_forward, module)
            count += 1
    return count


def torch_dtype(weights: str, dtype: str | None) -> str:
    """The dtype the engine loads the model in for ``weights`` (``bf16`` → ``bfloat16``; ``int8`` keeps the
    float dtype of the non-quantized parts, ``float32`` by default).

    Raises:
        ValueError: ``weights`` not in :data:`WEIGHT_FORMATS`.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"engine weights {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "bf16":
        return "bfloat16"
    return dtype or "float32"
