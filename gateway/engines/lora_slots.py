"""LoRA slots of the transformers engine: adapter versions copied into reusable peft adapters, and the stacked
LoRA forward that serves a batch mixing versions in one pass per layer.

:class:`LoraSlots` maps version names to slots (peft adapters ``livelora_slot_<n>``); a version of the same shape
(:func:`slot_signature`) is copied into a free slot in place, in milliseconds. Rows of one batch may use
different versions: every LoRA ``Linear`` computes each row's own update in one stacked pass (:class:`MixedRows`),
and a version that every row has used for :data:`MERGE_AFTER_STEPS` passes is merged into the weights
(:class:`MergedVersion`) and runs at the base model's speed. peft's own forward remains for what the stacked
pass does not cover (DoRA, LoRA bias, embeddings, mixed LoRA shapes). Everything runs on the worker thread,
between forward passes. Why: ``docs/internals/engines.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from livelora.clients.errors import BadRequestError, LiveloraError
from livelora.core.base_models import building_lora
from livelora.gateway.engines.lora_pool import GATHER_FROM, GatheredRows, LoraPool
from livelora.gateway.engines.quantized import Int8Weight

log = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in adapter_names


class LoraSlots:
    """The served model's LoRA slots and its forward pass (docs/internals/engines.md).

    Args:
        model: the plain transformers model (LoRA layers are injected into it when the first version loads).
        schedule: runs a callable on the worker thread between two forward passes (spare slots are made so).
        merge: serve a version used alone by :data:`MERGE_AFTER_STEPS` consecutive batches from merged weights
            (:class:`MergedVersion`; costs one copy of the adapted layers' weights, 425 MB in float32 for
            SmolLM2-135M with LoRA on every linear layer; 1 byte a weight with ``quantize``).
        quantize: merged weights are re-quantized to int8 (:class:`~.quantized.Int8Weight`), as the base
            layers are when the engine serves ``int8``.

    Attributes:
        peft: the ``PeftModel`` wrapping ``model`` while any slot exists, else ``None``.
        versions: adapter version name → the slot holding its weights.
        free_slots: slots no version uses, kept for the next versions of their shape.
        stacks: slot names of a mixed batch → ``{id(LoRA module): (A, B) stacks}`` (see :class:`MixedRows`).
    """

    def __init__(
        self, model, schedule: Callable[[Callable[[], None]], None], *, merge: bool = True, quantize: bool = False
    ):
        self.model = model
        self.schedule = schedule
        self.peft = None
        self.lora_enabled = True
        self.versions: dict[str, LoraSlot] = {}
        self.free_slots: list[LoraSlot] = []
        self._slot_counter = 0
        self.active_slot: str | None = None  # peft's active adapter, for single-version batches
        self.mixed_rows: MixedRows | GatheredRows | None = None  # set during a batched mixed-version forward
        self.stacks: dict[tuple[str, ...], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.lora_linear_only = True  # every LoRA layer is a peft lora.Linear (else no batched path)
        #: merged weights of the version most recently served alone (see :class:`MergedVersion`), or None
        self.merged: MergedVersion | None = None
        self.merge_enabled = merge
        self.quantize = quantize
        self._alone: tuple[LoraSlot | None, int] = (None, 0)  # the slot batches used alone, for how many passes
        self.pool = LoraPool()  # every slot's factors by row, for batches of many versions (GatheredRows)

    def forward(self, adapters: list[str | None], **kw) -> torch.Tensor:
        """One forward pass; returns logits ``(B, T_kept, V)``. ``adapters`` has one entry per row."""
        if self.peft is None:
            return self.model(**kw).logits
        slots = [self.versions[a] if a is not None else None for a in adapters]
        rows = self._batched_rows(slots)
        if rows is not None and self._merged_for(slots) is not None:  # every row on one merged version
            rows = MixedRows((), [], {}, merged=self.merged)
        if rows is not None:  # every LoRA layer serves each row its own version (see MixedRows)
            self.mixed_rows = rows
            try:
                return self.model(**kw).logits
            finally:
                self.mixed_rows = None
        # peft's own paths: DoRA, LoRA bias, LoRA on non-Linear layers, or versions of several shapes
        if all(a is None for a in adapters):
            self._set_lora(False)
            return self.model(**kw).logits
        self._set_lora(True)
        if len(set(adapters)) == 1:
            self._activate(slots[0].name)
            return self.model(**kw).logits
        names = [s.name if s is not None else BASE_ADAPTER for s in slots]
        return self.peft(adapter_names=names, **kw).logits

    def _merged_for(self, slots: list[LoraSlot | None]) -> MergedVersion | None:
        """The merged weights for a batch whose rows all use one version, built once that version has been
        alone in :data:`MERGE_AFTER_STEPS` consecutive forward passes; else ``None`` (the stacked pass runs)."""
        first = slots[0]
        if not self.merge_enabled or first is None or not first.mergeable or any(s is not first for s in slots):
            self._alone = (None, 0)
            return None
        if self.merged is not None and self.merged.slot is first:
            return self.merged
        seen, count = self._alone
        count = count + 1 if seen is first else 1
        self._alone = (first, count)
        if count < MERGE_AFTER_STEPS:
            return None
        t0 = time.perf_counter()
        merged = MergedVersion.build(self.peft, first, reuse=self.merged, quantize=self.quantize)
        if merged.slot is None:  # a layer that cannot be merged: this slot is always served stacked
            first.mergeable = False
            return None
        self.merged = merged
        log.info(
            "merged LoRA slot %s into a copy of %d layers' weights in %.3f s",
            first.name,
            len(self.merged.weights),
            time.perf_counter() - t0,
        )
        return self.merged

    def _drop_merged(self, slot: LoraSlot) -> None:
        """Forget the merged weights if they belong to ``slot`` (its weights change or it is deleted); the
        buffers are kept for the next merge."""
        if self.merged is not None and self.merged.slot is slot:
            self.merged.slot = None
        if self._alone[0] is slot:
            self._alone = (None, 0)

    def _set_lora(self, enabled: bool) -> None:
        if self.peft is not None and enabled != self.lora_enabled:
            if enabled:
                self.peft.base_model.enable_adapter_layers()
            else:
                self.peft.base_model.disable_adapter_layers()
            self.lora_enabled = enabled

    def _activate(self, slot: str) -> None:
        """Make ``slot`` peft's active adapter (used by forwards without ``adapter_names``)."""
        if self.active_slot != slot:
            self.peft.base_model.set_adapter(slot, inference_mode=True)
            self.active_slot = slot

    def _batched_rows(self, slots: list[LoraSlot | None]) -> MixedRows | GatheredRows | None:
        """The :class:`MixedRows` of a batch (:class:`~.lora_pool.GatheredRows` from
        :data:`~.lora_pool.GATHER_FROM` versions on), or ``None`` when peft's own forward must run (versions of
        different shapes, DoRA or LoRA bias, or LoRA on layers other than ``nn.Linear``)."""
        used = list(dict.fromkeys(s for s in slots if s is not None))
        if not self.lora_linear_only or not all(s.batchable for s in used) or len({s.signature for s in used}) > 1:
            return None
        if len(used) >= GATHER_FROM:
            return self.pool.batch(self.peft, slots)
        key = tuple(s.name for s in used)
        stacks = self.stacks.pop(key, None)
        if stacks is None:
            stacks = {}
            while len(self.stacks) >= MAX_STACK_SETS:
                self.stacks.pop(next(iter(self.stacks)))
        self.stacks[key] = stacks  # most recently used last
        position = {s.name: i for i, s in enumerate(used)}
        return MixedRows(key, [position[s.name] if s is not None else -1 for s in slots], stacks)

    def install(self, name: str, config, weights: dict[str, torch.Tensor], source: str) -> None:
        """Install adapter version ``name`` (a peft ``LoraConfig`` and its state dict, read by the caller)
        into a LoRA slot.

        A free slot of the same shape (:func:`slot_signature`) has its tensors overwritten in place (a few
        milliseconds); otherwise a new slot is created with peft ``add_adapter`` (about 0.2 s on CPU for
        SmolLM2 at rank 16 on every linear layer), and a spare one is prepared :data:`SPARE_DELAY_S`
        later so the next version finds it free.

        Raises:
            BadRequestError: not a LoRA config, or the weights do not fit (missing tensors, wrong shapes);
                nothing changes.
        """
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise BadRequestError(
                f"adapter at {source} is {config.peft_type}; only LoRA adapters are served", param="path"
            )
        config.inference_mode = True
        signature = slot_signature(config)
        slot = next((s for s in self.free_slots if s.signature == signature), None)
        if slot is not None:
            self.free_slots.remove(slot)
        else:
            slot = self._new_slot(config, signature, source)
        try:
            self._fill(slot, weights, source)
        except Exception as exc:
            self.free_slots.append(slot)  # its contents are garbage, but no version maps to it
            if isinstance(exc, LiveloraError):
                raise
            raise BadRequestError(f"adapter at {source} does not fit this base model: {exc}", param="path") from exc
        self.versions[name] = slot
        if not any(s.signature == signature for s in self.free_slots):  # later: not while the swap is served
            timer = threading.Timer(
                SPARE_DELAY_S, self.schedule, args=(lambda: self._prepare_spare(config, signature),)
            )
            timer.daemon = True
            timer.start()

    def _new_slot(self, config, signature: str, source: str) -> LoraSlot:
        slot = LoraSlot(f"{SLOT_PREFIX}{self._slot_counter}", signature)
        self._slot_counter += 1
        t0 = time.perf_counter()
        try:
            self.peft = add_peft_adapter(self.model, self.peft, config, slot.name)
        except Exception as exc:
            self._delete_slot(slot)
            raise BadRequestError(f"adapter at {source} does not fit this base model: {exc}", param="path") from exc
        self.lora_enabled = True
        self._set_lora(False)
        self.active_slot = None  # peft may have changed its active adapter
        slot.batchable = not getattr(config, "use_dora", False) and not getattr(config, "lora_bias", False)
        self._patch_lora_layers()
        self.stacks.clear()
        log.info(
            "created LoRA slot %s in %.3f s (%d slots, %d free)",
            slot.name,
            time.perf_counter() - t0,
            len(self.versions) + len(self.free_slots) + 1,
            len(self.free_slots),
        )
        return slot

    def _patch_lora_layers(self) -> None:
        """Route every peft LoRA ``Linear`` through :func:`_lora_linear_forward` (once per layer)."""
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.peft.modules():
            if isinstance(module, LoraLinear):
                if not getattr(module, "_livelora_patched", False):
                    module.forward = functools.partial(_lora_linear_forward, self, module, module.forward)
                    module._livelora_patched = True
            elif isinstance(module, BaseTunerLayer):
                self.lora_linear_only = False

    def _prepare_spare(self, config, signature: str) -> None:
        """Create one free slot of ``signature`` unless one is free already or no loaded version has that shape
        any more (runs between forward passes, :data:`SPARE_DELAY_S` after a load)."""
        if any(s.signature == signature for s in self.free_slots) or not any(
            v.signature == signature for v in self.versions.values()
        ):
            return
        try:
            self.free_slots.append(self._new_slot(config, signature, "spare slot"))
        except LiveloraError as exc:  # only an optimisation: the next load creates its slot itself
            log.warning("could not prepare a spare LoRA slot: %s", exc)

    def _fill(self, slot: LoraSlot, weights: dict[str, torch.Tensor], source: str) -> None:
        """Copy ``weights`` (keys as peft saves them, without the adapter name) into ``slot``'s tensors."""
        from peft.utils import set_peft_model_state_dict

        for key in [k for k in self.stacks if slot.name in k]:  # they hold copies of this slot's tensors
            del self.stacks[key]
        self._drop_merged(slot)
        self.pool.changed(slot.name)

        if slot.params is None:
            marker = f".{slot.name}."
            slot.params = {n.replace(marker, "."): p for n, p in self.peft.named_parameters() if marker in n}
        if weights.keys() == slot.params.keys():
            for key, tensor in weights.items():
                target = slot.params[key]
                if tensor.shape != target.shape:
                    raise BadRequestError(
                        f"adapter at {source}: tensor {key} has shape {tuple(tensor.shape)}, "
                        f"this base model needs {tuple(target.shape)}",
                        param="path",
                    )
            for key, tensor in weights.items():
                slot.params[key].copy_(tensor)
            return
        # other key spellings (older peft versions, other tools): peft's own loader maps them
        result = set_peft_model_state_dict(self.peft, weights, adapter_name=slot.name)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{slot.name}." in k]
        if missing:
            raise BadRequestError(
                f"adapter at {source} lacks weights for {len(missing)} LoRA tensors, "
                f"e.g. {missing[0].replace(f'.{slot.name}.', '.')}",
                param="path",
            )

    def _delete_slot(self, slot: LoraSlot) -> None:
        self.active_slot = None  # peft may change its active adapter
        self.stacks.clear()
        self._drop_merged(slot)
        self.pool.dropped(slot.name)
        if self.peft is None or slot.name not in self.peft.peft_config:
            return
        if len(self.peft.peft_config) == 1:
            self.peft.base_model.unload()  # removes every LoRA layer; self.model is the plain model again
            self.peft, self.merged = None, None  # (the merged buffers were keyed by the removed layers)
            self.lora_enabled = True
            self.lora_linear_only = True
        else:
            with warnings.catch_warnings():  # "adapter ... was active which is now deleted": we never use active
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(slot.name)

    def release(self, name: str) -> None:
        """Remove adapter version ``name`` (the caller checked that no live sequence uses it).

        Its slot becomes free for the next version of the same shape; at most :data:`MAX_FREE_SLOTS`
        free slots per shape are kept, and when no version is loaded at all the LoRA layers are removed
        (the plain model serves again at full speed).
        """
        slot = self.versions.pop(name, None)
        if slot is None:
            return
        self._drop_merged(slot)
        self.free_slots.append(slot)
        same = [s for s in self.free_slots if s.signature == slot.signature]
        extra = same if not self.versions else same[:-MAX_FREE_SLOTS]
        for s in extra:
            self.free_slots.remove(s)
            self._delete_slot(s)


#: peft adapter names of the worker's LoRA slots are this prefix plus a counter (never a version name).
SLOT_PREFIX = "livelora_slot_"
#: Seconds after a load before a spare slot is created (a pause of decoding of ~0.2 s on CPU), so that it
#: does not delay the first requests on the version just installed.
SPARE_DELAY_S = 2.0
#: Free slots kept per shape for the next versions (a new slot costs a peft ``add_adapter``, a slot of
#: rank 16 on every linear layer of SmolLM2-135M holds 9 MB in float32).
MAX_FREE_SLOTS = 4
#: LoraConfig fields that do not change the LoRA modules' shapes or forward at inference.
_SIGNATURE_IGNORES = {
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "init_lora_weights",
    "lora_dropout",
    "peft_version",
    "auto_mapping",
    "task_type",
}


def slot_signature(config) -> str:
    """A key equal for two LoRA configs whose adapters have the same modules, ranks and scalings, so one's
    weights can be copied into the other's slot (canonical JSON of the config minus :data:`_SIGNATURE_IGNORES`)."""

    def canon(value):
        if isinstance(value, (set, frozenset)):
            return sorted(canon(v) for v in value)
        if isinstance(value, (list, tuple)):
            return [canon(v) for v in value]
        if isinstance(value, dict):
            return {str(k): canon(v) for k, v in value.items()}
        if hasattr(value, "value"):  # enums
            return value.value
        return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)

    fields = {k: canon(v) for k, v in config.to_dict().items() if k not in _SIGNATURE_IGNORES}
    return json.dumps(fields, sort_keys=True)


@dataclass(eq=False)
class LoraSlot:
    """One peft adapter inside the served model, reused by successive adapter versions of one shape.

    Attributes:
        name: the peft adapter name (:data:`SLOT_PREFIX` + n); never exposed as a version name.
        signature: :func:`slot_signature` of the config it was created with.
        params: saved-key → parameter map for in-place copies, built on first fill.
        batchable: plain LoRA (no DoRA, no LoRA bias), so :class:`MixedRows` can serve it.
        mergeable: no adapted layer is other than a plain ``nn.Linear`` (:class:`MergedVersion`).
    """

    name: str
    signature: str
    params: dict[str, torch.nn.Parameter] | None = None
    batchable: bool = True  # plain LoRA (no DoRA, no LoRA bias): MixedRows can serve it
    mergeable: bool = True  # every adapted layer a plain nn.Linear: MergedVersion can serve it


#: Consecutive forward passes in which one version serves every row before its weights are merged (a merge
#: costs about one decode step; a version used alone only now and then is served by the stacked pass).
MERGE_AFTER_STEPS = 4


def add_peft_adapter(model, peft, config, name: str):
    """Add adapter ``name`` (a peft ``LoraConfig``) to ``peft``, or wrap ``model`` in a ``PeftModel`` with it when
    ``peft`` is None; returns the ``PeftModel``. peft warns of a LoRA on the tied ``lm_head``, but nothing here
    merges in place (:class:`MergedVersion` writes copies), so the input embedding never changes: silenced."""
    from peft import PeftModel

    # another thread may be loading a model (see MODEL_BUILD_LOCK's doc)
    with building_lora(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tied layer is part of the adapter.*")
        if peft is None:
            peft = PeftModel(model, config, adapter_name=name)
            peft.eval()
        else:
            peft.add_adapter(name, config)
    return peft


class MergedVersion:
    """One version's LoRA update merged into a copy of the adapted layers' weights.

    For every peft LoRA ``Linear`` layer the version adapts, ``W' = W + s·B A`` (Hu et al. 2021, eq. 3: the
    update merged at inference), with ``W`` the base layer's weight ``(d_out, d_in)``, ``A`` ``(r, d_in)``,
    ``B`` ``(d_out, r)`` and ``s`` the version's LoRA scaling; the layer then computes ``x W'ᵀ + bias``, one
    matmul instead of three. The base weights are never modified (base rows and other versions keep being
    served exactly), and the buffers are reused when the next version is merged. Layers whose base layer is
    not a plain ``nn.Linear`` in ``(d_out, d_in)`` layout (``fan_in_fan_out``) are not merged: a version with
    any such layer is never merged (:meth:`build` returns one that serves nothing; the stacked pass runs).

    With ``quantize`` (the engine serves ``int8``), ``W'`` is computed in float32 and re-quantized as a whole
    (:class:`~.quantized.Int8Weight`), so the version's rows are served ``quantize(W + s·B A)``.

    Attributes:
        slot: the slot whose weights were merged (``None`` once they changed: the buffers are stale).
        weights: ``id(LoRA layer) → W'`` (a tensor, or an :class:`~.quantized.Int8Weight`).
    """

    def __init__(self, slot: LoraSlot | None, weights: dict[int, torch.Tensor | Int8Weight]):
        self.slot, self.weights = slot, weights

    @classmethod
    def build(cls, peft, slot: LoraSlot, reuse: MergedVersion | None = None, quantize: bool = False) -> MergedVersion:
        """Merge ``slot``'s weights (runs on the worker thread, between forward passes; about 0.1 s for
        SmolLM2-135M at rank 16 on every linear layer on 2 CPU cores, more with ``quantize``)."""
        from peft.tuners.lora.layer import Linear as LoraLinear

        layers = [m for m in peft.modules() if isinstance(m, LoraLinear) and slot.name in m.lora_A]
        # checked before any buffer is written: the buffers may still hold the merged version being served
        if any(not isinstance(m.base_layer, torch.nn.Linear) or getattr(m, "fan_in_fan_out", False) for m in layers):
            return cls(None, {})
        old = reuse.weights if reuse is not None and not quantize else {}
        weights: dict[int, torch.Tensor] = {}
        # always in inference mode: the buffers are inference tensors (built during a decode step or a scoring
        # command alike), and an inference tensor may only be written in place inside inference mode
        with torch.inference_mode():
            for module in layers:
                base = module.base_layer
                a, b = module.lora_A[slot.name].weight, module.lora_B[slot.name].weight
                out = old.get(id(module))
                if out is None or out.shape != base.weight.shape or out.dtype != base.weight.dtype:
                    out = torch.empty_like(base.weight)
                torch.addmm(
                    base.weight,
                    b.to(base.weight.dtype),
                    a.to(base.weight.dtype),
                    alpha=module.scaling[slot.name],
                    out=out,
                )
                weights[id(module)] = Int8Weight(out) if quantize else out
        return cls(slot, weights)


#: Stack sets kept, one per set of versions seen together in a batch (each holds a copy of their LoRA
#: weights: 9 MB per version of rank 16 on SmolLM2-135M).
MAX_STACK_SETS = 8


class MixedRows:
    """A batch's rows and their versions (several, one, or only the base model), served in one pass per
    LoRA layer.

    peft's mixed-batch forward loops over the versions present in every layer (index the rows, two small
    matmuls, scatter back: about 5 operations per version per layer), and switching its active adapter
    or enabling/disabling its LoRA layers walks every module (20-25 ms on SmolLM2). Here the U versions' factors are
    concatenated along the rank, ``A = [A_1; …; A_U]`` of shape ``(Σr, d_in)`` and
    ``B = [s_1 B_1ᵀ; …; s_U B_Uᵀ]`` of shape ``(Σr, d_out)`` (``s_u`` = the version's LoRA scaling), and a
    0/1 mask ``M`` of shape ``(rows, 1, Σr)`` keeps each row's own block, so that for row b on version u

        y_b = W x_b + ((x_b Aᵀ) ⊙ M_b) B = W x_b + s_u B_u A_u x_b,

    the LoRA update of Hu et al. (2021), eq. 3; base rows have an all-zero mask. Two matmuls per layer
    whatever U is (the idea of S-LoRA / Punica's batched LoRA kernels, in plain torch). Stacks are built
    on first use per set of versions and dropped whenever a slot's weights change.

    Attributes:
        key: the slot names, in mask order.
        rows: per batch row, the index of its version in ``key`` or -1 for the base model.
        stacks: ``id(module) -> (A, B)`` for this ``key`` (shared across forwards, filled lazily).
    """

    def __init__(
        self,
        key: tuple[str, ...],
        rows: list[int],
        stacks: dict[int, tuple[torch.Tensor, torch.Tensor]],
        merged: MergedVersion | None = None,
    ):
        self.key, self.rows, self.stacks = key, rows, stacks
        self.merged = merged  # every row on this merged version: plain Linear layers on its weights
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def layer(self, module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(A, B, mask)`` of one LoRA layer for this batch, or ``None`` if no version adapts it."""
        if not self.key:  # every row on the base model
            return None
        entry = self.stacks.get(id(module))
        if entry is None:
            if not all(name in module.lora_A for name in self.key):
                return None
            with torch.no_grad():
                a = torch.cat([module.lora_A[n].weight for n in self.key], 0)
                b = torch.cat([module.lora_B[n].weight.t() * module.scaling[n] for n in self.key], 0)
            entry = self.stacks[id(module)] = (a, b)
        widths = tuple(module.lora_A[n].weight.shape[0] for n in self.key)
        mask = self._masks.get(widths)
        if mask is None:
            a = entry[0]
            mask = torch.zeros(len(self.rows), 1, a.shape[0], dtype=a.dtype, device=a.device)
            starts = [sum(widths[:i]) for i in range(len(widths))]
            for row, u in enumerate(self.rows):
                if u >= 0:
                    mask[row, 0, starts[u] : starts[u] + widths[u]] = 1
            self._masks[widths] = mask
        return entry[0], entry[1], mask

    def update(self, module, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA update of one layer for every row, ``(rows, T, d_out)``, or ``None`` if no version adapts it."""
        layer = self.layer(module)
        if layer is None:
            return None
        a, b, mask = layer
        return ((x.to(a.dtype) @ a.t()) * mask) @ b


def _lora_linear_forward(slots: LoraSlots, module, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Forward of a peft LoRA ``Linear``: peft's own, except during a :class:`MixedRows` pass.

    Shapes: ``x`` ``(rows, T, d_in)`` → ``(rows, T, d_out)``.
    """
    rows = slots.mixed_rows
    if rows is None:
        return peft_forward(x, *args, **kwargs)
    if rows.merged is not None:
        weight = rows.merged.weights.get(id(module))
        base = module.base_layer
        if weight is None:
            return base(x, *args, **kwargs)
        if isinstance(weight, Int8Weight):
            return weight.linear(x, base.bias)
        return torch.nn.functional.linear(x, weight, base.bias)
    result = module.base_layer(x, *args, **kwargs)
    delta = rows.update(module, x)
    return result if delta is None else result + delta.to(result.dtype)
