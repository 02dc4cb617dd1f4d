"""Served weight formats of the transformers engine on the CPU (``LIVELORA_ENGINE_WEIGHTS``).

``fp32`` (what training uses), ``bf16``, ``int8`` and ``int4``. ``int8`` is weight-only: ``W`` ``(d_out, d_in)``
stored as ``q = round(W / s)`` clamped to ±127, ``s = max|W_row| / 127`` per output row, ``y = (x_bf16 @ qᵀ) · s``
by ``torch._weight_int8pack_mm``; a version served merged is re-quantized as a whole, ``quantize(W + s·B A)``
(:class:`~.lora_slots.MergedVersion`). ``int4`` is weight-only, asymmetric, in groups of 32 along ``d_in`` (GGUF's
``Q4_1`` grid, on which the built-in model's attention and MLP weights lie): ``W ≈ d·q + m``, ``q`` in 0..15,
``d = (max - min) / 15``, ``m = min`` per group, by ``torch._weight_int4pack_mm_for_cpu`` with bfloat16
activations; ``lm_head`` stays bfloat16 and versions are never merged into it (:func:`serve_weights`). Results
are cast back to the activations' dtype; a row's result never depends on the other rows of the batch.
Measurements and the choice: ``docs/serving.md``.
"""

from __future__ import annotations

import functools

import torch

#: The values of ``LIVELORA_ENGINE_WEIGHTS``.
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
#: ``int4`` group size along ``d_in`` (GGUF ``Q4_1``'s block).
INT4_GROUP = 32


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


class Int4Weight:
    """A weight ``(d_out, d_in)`` in asymmetric group-wise int4 (see the module docstring); ``d_in`` a multiple
    of :data:`INT4_GROUP`.

    Attributes:
        packed: ``torch``'s CPU int4 layout ``(d_out, d_in / 2)`` uint8; scales_zeros: bfloat16
        ``(d_in / 32, d_out, 2)``, ``(d, m + 8·d)`` (the kernel computes ``(q - 8)·d + zero``).
    """

    def __init__(self, weight: torch.Tensor):
        d_out, d_in = weight.shape
        with torch.no_grad():
            w = weight.detach().float().reshape(d_out, d_in // INT4_GROUP, INT4_GROUP)
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            d = ((hi - lo) / 15).clamp(min=1e-12)
            q = torch.round((w - lo) / d).clamp_(0, 15).to(torch.int32).reshape(d_out, d_in)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            zero = lo + 8 * d
            self.scales_zeros = torch.stack([d.reshape(d_out, -1).t(), zero.reshape(d_out, -1).t()], -1)
            self.scales_zeros = self.scales_zeros.to(torch.bfloat16).contiguous()
        self.shape = (d_out, d_in)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W̃ᵀ + bias`` for ``x`` ``(..., d_in)`` → ``(..., d_out)`` in ``x``'s dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_zeros).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The served weight in float32: ``(q - 8)·d + zero`` with the bfloat16 ``d`` and ``zero``."""
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16)
        return self.linear(eye).float().t().contiguous()


class Bf16Weight:
    """A weight served in bfloat16 inside a float32 model (activations rounded to bfloat16, result cast back)."""

    def __init__(self, weight: torch.Tensor):
        self.w = weight.detach().to(torch.bfloat16).contiguous()
        self.shape = tuple(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.w).to(x.dtype)
        return y if bias is None else y + bias


_KINDS = {"int8": Int8Weight, "int4": Int4Weight, "bf16": Bf16Weight}


def _quantized_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module._livelora_quantized.linear(x, module.bias)


def quantize_linears(model: torch.nn.Module, weights: str = "int8", skip: tuple = ()) -> int:
    """Serve every ``nn.Linear`` of ``model`` (before any LoRA layer is injected) from an :class:`Int8Weight`
    (``weights="int8"``), :class:`Int4Weight` (``"int4"``; layers whose ``d_in`` is not a multiple of 32 get
    int8) or :class:`Bf16Weight` (``"bf16"``) copy of its weight; a layer already served so is left alone.
    The float weight stays (it is what an adapter version is merged into, and what peft reads shapes from).
    ``skip``: modules left as they are. Returns the number of layers quantized."""
    count = 0
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear and not hasattr(module, "_livelora_quantized") and module not in skip:
            kind = "int8" if weights == "int4" and module.in_features % INT4_GROUP else weights
            module._livelora_quantized = _KINDS[kind](module.weight)
            module.forward = functools.partial(_quantized_forward, module)
            count += 1
    return count


def serve_weights(model: torch.nn.Module, weights: str) -> None:
    """Make ``model`` (a float model, before any LoRA layer is injected) serve ``weights``: ``int8`` every
    linear layer; ``int4`` the attention and MLP layers, ``lm_head`` in bfloat16 (quantized first: the built-in
    model's GGUF keeps it in Q8_0, which int4 would round); ``fp32``/``bf16`` nothing (the dtype does it)."""
    if weights == "int4":
        quantize_linears(model.get_output_embeddings(), "bf16")
    if weights in ("int8", "int4"):
        quantize_linears(model, weights)


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
