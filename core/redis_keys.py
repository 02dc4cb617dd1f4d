"""The Redis key layout: every key and channel livelora uses, built by one class, :class:`KeyLayout`.

Every key starts with the configured prefix (``LIVELORA_REDIS_PREFIX``, ``livelora:`` by default; tests use a
unique one). Nothing else in livelora builds a Redis key by hand; user-supplied text enters a name only as its
:func:`text_digest`. Each key's type and contents: ``docs/internals/redis-keys.md``.

Example::

    keys = KeyLayout("livelora:")
    keys.completion("chatcmpl-1")   # 'livelora:completion:chatcmpl-1'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: Consumer group of the trainer workers on the signals stream.
TRAINERS_GROUP = "trainers"


def text_digest(text: str) -> str:
    """``sha256(text)[:32]`` (hex): how user-supplied text appears in a key name (never raw: quotes, spaces,
    colons or newlines would break tooling and could forge another key's shape)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class KeyLayout:
    """The Redis key and channel names under one prefix (types and contents: docs/internals/redis-keys.md)."""

    prefix: str = "livelora:"

    # ------------------------------------------------------------------ live loop
    def completion(self, completion_id: str) -> str:
        """``{prefix}completion:{id}``: the completion record (JSON string, TTL = retention)."""
        return f"{self.prefix}completion:{completion_id}"

    def completion_bytes(self, tenant: str, day: str) -> str:
        """``{prefix}complog:bytes:{tenant}:{day}``: bytes of completion-log records the tenant wrote that UTC day
        (``YYYYMMDD``; TTL = retention + 1 day)."""
        return f"{self.prefix}complog:bytes:{tenant}:{day}"

    def rating(self, completion_id: str, rater: str) -> str:
        """``{prefix}rated:{completion_id}:{text_digest(rater)}``: id of the latest rating (replace-on-re-rate);
        ``rater`` is ``{caller}/{user}``, user text, so only its digest is in the name."""
        return f"{self.prefix}rated:{completion_id}:{text_digest(rater)}"

    def rater(self, lineage: str, rater_digest: str) -> str:
        """``{prefix}rater:{lineage}:{sha256(rater)[:32]}``: sorted set of the rater's accepted event ids, scored
        by receive time (s), for the per-rater rate limit (``trainer/signal_governor.py``)."""
        return f"{self.prefix}rater:{lineage}:{rater_digest}"

    def rater_labels(self, lineage: str) -> str:
        """``{prefix}raters:{lineage}:labels``: hash ``json([item, rater])`` → ``"1"``/``"0"``, the newest label each
        rater gave each rated completion or preference pair of the lineage (rater agreement weighting,
        :mod:`livelora.core.governance`)."""
        return f"{self.prefix}raters:{lineage}:labels"

    def rater_labels_order(self, lineage: str) -> str:
        """``{prefix}raters:{lineage}:order``: sorted set of the fields of :meth:`rater_labels`, scored by receive
        time (s); the oldest beyond the window are dropped from both."""
        return f"{self.prefix}raters:{lineage}:order"

    def version_requests(self, endpoint: str) -> str:
        """``{prefix}stats:{endpoint}:requests``: hash version label → requests served (live statistics)."""
        return f"{self.prefix}stats:{endpoint}:requests"

    def version_ratings(self, endpoint: str, version: str) -> str:
        """``{prefix}stats:{endpoint}:ratings:{version}``: hash rating key → 1 (thumbs up) / 0; a re-rate
        overwrites its field, so each (completion, rater) counts once."""
        return f"{self.prefix}stats:{endpoint}:ratings:{version}"

    def version_rated_at(self, endpoint: str, version: str) -> str:
        """``{prefix}stats:{endpoint}:rated_at:{version}``: hash rating key → Unix s of its latest rating (the
        fields of :meth:`version_ratings`, for liked share over time)."""
        return f"{self.prefix}stats:{endpoint}:rated_at:{version}"

    def learning(self, lineage: str) -> str:
        """``{prefix}learning:lineage:{lineage}``: where the lineage's next version stands (JSON, SET by the trainer
        at each stage change; ``trainer/learning_status.py``)."""
        return f"{self.prefix}learning:lineage:{lineage}"

    @property
    def learning_trainer(self) -> str:
        """``{prefix}learning:trainer``: the trainer's batch settings, step-time estimate and the newest signals
        stream id it has read (JSON)."""
        return f"{self.prefix}learning:trainer"

    @property
    def signals(self) -> str:
        """``{prefix}signals``: the stream of accepted signal events (group :data:`TRAINERS_GROUP`)."""
        return f"{self.prefix}signals"

    @property
    def signals_trained(self) -> str:
        """``{prefix}signals:trained``: sorted set of event ids trained into a version (score: Unix s)."""
        return f"{self.prefix}signals:trained"

    @property
    def signals_retrained(self) -> str:
        """``{prefix}signals:retrained``: counter of events a commit found already trained (should stay 0)."""
        return f"{self.prefix}signals:retrained"

    @property
    def bus_epoch(self) -> str:
        """``{prefix}bus:epoch``: a random id the trainer sets after checking the signals stream against the
        accepted-signal log; its absence or change means Redis lost its state (``trainer/bus_recovery.py``)."""
        return f"{self.prefix}bus:epoch"

    @property
    def store_id(self) -> str:
        """``{prefix}store_id``: the id of the store this prefix belongs to."""
        return f"{self.prefix}store_id"

    @property
    def layout_version(self) -> str:
        """``{prefix}layout``: ``"2"`` once the keys of the layout before digests were renamed
        (:mod:`livelora.core.key_migration`)."""
        return f"{self.prefix}layout"

    @property
    def notices(self) -> str:
        """``{prefix}notices``: pub/sub channel of version and endpoint notices."""
        return f"{self.prefix}notices"

    def idem(self, scope: str, key: str) -> str:
        """``{prefix}idemkey:{scope}:{text_digest(key)}``: idempotency record (SET NX, TTL); ``key`` is the
        client's ``Idempotency-Key``, so only its digest is in the name."""
        return f"{self.prefix}idemkey:{scope}:{text_digest(key)}"

    # ------------------------------------------------------------------ training sessions
    def session(self, sid: str) -> str:
        """``{prefix}session:{sid}``: the session record; its TTL is the session's life."""
        return f"{self.prefix}session:{sid}"

    def session_summary(self, sid: str) -> str:
        """``{prefix}sessionsummary:{sid}``: the session's summary (JSON: created, metadata, how it ended); its TTL
        is ``session_history_ttl_s`` from the last heartbeat or finish, so it outlives the session key."""
        return f"{self.prefix}sessionsummary:{sid}"

    def session_index(self, tenant: str) -> str:
        """``{prefix}sessionindex:{tenant}``: sorted set of the tenant's session ids by creation time (Unix s);
        TTL ``session_history_ttl_s`` from the last create or finish, trimmed to the newest 10,000."""
        return f"{self.prefix}sessionindex:{tenant}"

    @property
    def legacy_session_history(self) -> str:
        """``{prefix}sessionhistory``: the hash of every summary that stores before 2026-12 kept without expiry;
        a starting gateway moves it into :meth:`session_summary` keys and deletes it."""
        return f"{self.prefix}sessionhistory"

    def request_owner(self, request_id: str) -> str:
        """``{prefix}owner:request:{request_id}``: the tenant of an ad-hoc sample's future (sessions' own ids
        are owned through their session's record, :mod:`livelora.core.owners`)."""
        return f"{self.prefix}owner:request:{request_id}"

    def model(self, model_id: str) -> str:
        """``{prefix}model:{model_id}``: the training model's record (JSON)."""
        return f"{self.prefix}model:{model_id}"

    @property
    def models(self) -> str:
        """``{prefix}trainer:models``: set of training model ids whose op streams are read."""
        return f"{self.prefix}trainer:models"

    def model_last_request(self, model_id: str) -> str:
        """ISO time of the training model's last submitted op (``TrainingRun.last_request_time``)."""
        return f"{self.prefix}lastreq:model:{model_id}"

    def ops(self, model_id: str) -> str:
        """``{prefix}ops:{model_id}``: stream of the model's ops."""
        return f"{self.prefix}ops:{model_id}"

    def model_lease(self, model_id: str) -> str:
        """``{prefix}lease:model:{model_id}``: ``{token}:{owner}`` of the executor owning the model (PX TTL)."""
        return f"{self.prefix}lease:model:{model_id}"

    def model_fence(self, model_id: str) -> str:
        """``{prefix}fence:model:{model_id}``: counter handing out fencing tokens (INCR, never decreases)."""
        return f"{self.prefix}fence:model:{model_id}"

    def op_runs(self, model_id: str) -> str:
        """``{prefix}opruns:{model_id}``: hash ``seq`` → commits of that op's result, ``applied`` → highest seq."""
        return f"{self.prefix}opruns:{model_id}"

    def seq(self, model_id: str, seq_id: int) -> str:
        """``{prefix}seq:{model_id}:{seq_id}``: the first request that used this seq id (dedupe)."""
        return f"{self.prefix}seq:{model_id}:{seq_id}"

    def seq_refused(self, model_id: str) -> str:
        """``{prefix}seqrefused:{model_id}``: hash ``seq`` → failed future record of an op the gateway refused with
        an HTTP error (its seq stays free until a later seq consumes it)."""
        return f"{self.prefix}seqrefused:{model_id}"

    def future(self, request_id: str) -> str:
        """``{prefix}future:{request_id}``: the op's state, result or error (JSON, TTL)."""
        return f"{self.prefix}future:{request_id}"

    def sampler_completions(self, sampling_session_id: str) -> str:
        """List of a sampling session's finished/failed samples, in completion order (``retrieve_futures``)."""
        return f"{self.prefix}samplerdone:{sampling_session_id}"

    def sampler_clients(self, sampling_session_id: str) -> str:
        """Counter of a sampling session's joined clones (``join_sampling_session``)."""
        return f"{self.prefix}samplerclients:{sampling_session_id}"

    def sampler(self, sampling_session_id: str) -> str:
        """``{prefix}sampler:{id}``: a sampling session's record (JSON, TTL)."""
        return f"{self.prefix}sampler:{sampling_session_id}"

    @property
    def futures_channel(self) -> str:
        """``{prefix}futures``: pub/sub channel of request ids whose future just resolved."""
        return f"{self.prefix}futures"

    @property
    def sessions_channel(self) -> str:
        """``{prefix}sessions``: pub/sub channel of ids of sessions that finished."""
        return f"{self.prefix}sessions"

    # ------------------------------------------------------------------ usage metering
    def usage_hour(self, hour: str) -> str:
        """``{prefix}usage:{hour}``: token counters of one UTC hour (``YYYYMMDDHH``; ``""`` gives the stem)."""
        return f"{self.prefix}usage:{hour}"

    @property
    def usage_hours(self) -> str:
        """``{prefix}usage:hours``: set of hours whose ``usage:{hour}`` hash is live."""
        return f"{self.prefix}usage:hours"

    def usage_rolling(self, hour: str, rid: str) -> str:
        """``{prefix}usage:rolling:{hour}:{rid}``: an hour's counters being rolled up into the store."""
        return f"{self.prefix}usage:rolling:{hour}:{rid}"

    def usage_day(self, day: str, tenant: str) -> str:
        """``{prefix}usage:day:{day}:{tenant}``: the tenant's tokens per kind on one UTC day (``YYYYMMDD``)."""
        return f"{self.prefix}usage:day:{day}:{tenant}"

    def quota_sessions(self, tenant: str) -> str:
        """``{prefix}quota:sessions:{tenant}``: ids of the tenant's sessions holding a concurrency slot."""
        return f"{self.prefix}quota:sessions:{tenant}"

    @property
    def usage_pending(self) -> str:
        """``{prefix}usage:pending``: hash rolling key → ``"{hour} {ms}"`` of rollups not finished yet."""
        return f"{self.prefix}usage:pending"
