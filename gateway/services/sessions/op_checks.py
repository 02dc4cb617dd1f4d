"""The door checks of one training op's body, before it is queued: :class:`OpChecks` (quotas, per-op limits,
field validation against the served model)."""

from __future__ import annotations

import json
from typing import Any

from livelora.clients.errors import BadRequestError, LiveloraError, PayloadTooLargeError, UnsupportedParameterError
from livelora.clients.types.tinker import ForwardBackwardInput, SaveWeightsForSamplerRequest
from livelora.clients.types.tinker_rest import MAX_TTL_SECONDS, MIN_TTL_SECONDS
from livelora.core.api_keys import Principal
from livelora.core.bus import redis_unavailable
from livelora.core.losses import validate_batch
from livelora.core.session_protocol import CheckpointIndex, check_checkpoint_name, resolve_checkpoint
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.tenants.model_ceilings import base_config, lora_save_bytes

#: save op → the kind of checkpoint it writes
SAVE_KINDS = {
    "save_weights": "weights",
    "save_weights_for_sampler": "sampler_weights",
    "save_weights_external": "external_weights",
}


class OpChecks:
    """What a training op must pass before it is queued: the tenant's quotas (429), the per-op work limits (413)
    and its fields against the served model and the store (400, resolved into the op's future).

    Args:
        ctx: the session services' shared context (quotas, settings, engine, store).
    """

    def __init__(self, ctx: SessionContext):
        self.ctx = ctx

    async def check_quotas(self, kind: str, model_id: str, raw: dict[str, Any], principal: Principal) -> None:
        """Raises: QuotaExceededError (429) over the tenant's token quota (forward, forward_backward) or its
        ``max_adapter_versions`` (the saves)."""
        if self.ctx.quotas is None:
            return
        if kind in ("forward", "forward_backward"):
            with redis_unavailable():
                await self.ctx.quotas.check_tokens(
                    principal.tenant, ("forward",) if kind == "forward" else ("trained",)
                )
        if kind in SAVE_KINDS:
            adding = self._new_versions(kind, model_id, raw)
            await self.ctx.quotas.check_adapter_versions(
                principal.tenant, adding, await self._save_bytes(kind, model_id) if adding else 0
            )

    async def _save_bytes(self, kind: str, model_id: str) -> int:
        """Bytes the save will write, from the model's LoRA shapes (``max_adapter_bytes``; 0 when unknown)."""
        try:
            record = json.loads(await self.ctx.redis.get(self.ctx.keys.model(model_id)) or "{}")
        except ValueError:
            record = {}
        config = base_config(self.ctx.engine.tokenizer)
        return lora_save_bytes(config, record.get("lora") or {}, with_optimizer=kind == "save_weights")

    def _new_versions(self, kind: str, model_id: str, raw: dict[str, Any]) -> int:
        """Counted adapter versions a save adds (``max_adapter_versions``): 1 for a new named checkpoint; 0 for
        ephemeral sampler weights (no ``path``; not counted), for a name that exists (an overwrite replaces its
        version, a refused one writes nothing) and for an invalid name (refused by validation)."""
        name = raw.get("path")
        if name is None or not isinstance(name, str):
            return 0 if kind == "save_weights_for_sampler" else 1
        key = f"{SAVE_KINDS[kind]}/{name}"
        try:
            return 0 if key in CheckpointIndex(self.ctx.home, model_id).read().get("checkpoints", {}) else 1
        except LiveloraError:
            return 1

    def check_limits(self, kind: str, req: Any) -> None:
        """Bounded work per op: at most ``max_datums_per_op`` datums and ``max_tokens_per_op`` input tokens.

        Raises:
            PayloadTooLargeError: over a limit (413; the message names the limit and its setting).
        """
        if kind not in ("forward", "forward_backward"):
            return
        # a forward is a ForwardRequest (forward_input) or, from SDK >= 0.25, forward_backward with forward_only
        data = (getattr(req, "forward_input", None) or req.forward_backward_input).data
        limit = self.ctx.settings.max_datums_per_op
        if len(data) > limit:
            raise PayloadTooLargeError(
                f"{kind} carries {len(data)} datums, more than the limit of {limit} per op "
                "(LIVELORA_MAX_DATUMS_PER_OP); split the batch",
                param="data",
                code="too_many_datums",
            )
        tokens, limit = sum(d.model_input.length for d in data), self.ctx.settings.max_tokens_per_op
        if tokens > limit:
            raise PayloadTooLargeError(
                f"{kind} carries {tokens} input tokens, more than the limit of {limit} per "
                "op (LIVELORA_MAX_TOKENS_PER_OP); split the batch",
                param="data",
                code="too_many_tokens",
            )

    def validate(self, kind: str, req: Any) -> dict[str, Any]:
        """The op body the executor runs (JSON), after checking ``req``'s fields against the served model (losses,
        vocabulary, context length), the checkpoint rules and the store.

        Raises:
            BadRequestError, UnsupportedParameterError, NotFoundError: a field that cannot be honoured.
        """
        if kind in ("forward", "forward_backward"):
            fb: ForwardBackwardInput = getattr(req, "forward_input", None) or req.forward_backward_input
            validate_batch(
                fb.data,
                fb.loss_fn,
                fb.loss_fn_config,
                vocab_size=int(self.ctx.engine.vocab_size),
                max_seq_len=int(self.ctx.max_seq_len or self.ctx.engine.max_model_len),
            )
            # provenance spans (SDK ≥0.26) were checked for tiling by the request model; only stable_reinforce
            # (refused above) reads them, so the executor gets the plain datums
            spans = {"model_input_spans", "loss_fn_input_spans"}
            return {"input": fb.model_dump(mode="json", exclude={"data": {"__all__": spans}})}
        if (
            kind in SAVE_KINDS
            and req.ttl_seconds is not None
            and not MIN_TTL_SECONDS <= req.ttl_seconds <= MAX_TTL_SECONDS
        ):
            raise BadRequestError(
                f"ttl_seconds must be between {MIN_TTL_SECONDS} (1 hour) and {MAX_TTL_SECONDS} "
                f"(10 years), or omitted to keep the checkpoint until deleted; got {req.ttl_seconds}",
                param="ttl_seconds",
            )
        if kind == "save_weights_external":
            check_checkpoint_name(req.path)
            if req.age_encryption_recipients:
                raise UnsupportedParameterError(
                    "age_encryption_recipients is not supported: livelora stores and serves external weights "
                    "unencrypted (behind signed URLs); omit it, or encrypt the downloaded files yourself with `age`",
                    param="age_encryption_recipients",
                )
        if kind == "save_weights_for_sampler":
            req: SaveWeightsForSamplerRequest
            if (req.path is None) == (req.sampling_session_seq_id is None):
                raise BadRequestError(
                    "give exactly one of path (a named sampler checkpoint) and "
                    "sampling_session_seq_id (ephemeral weights for a sampling session)",
                    param="path",
                )
        if kind == "load_weights":
            resolve_checkpoint(self.ctx.home, req.path, want="weights")
        return req.model_dump(mode="json", exclude_none=True)
