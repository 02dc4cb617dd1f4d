"""Creating a segment on the store (adapters/segments.py), without a server: a refused create writes nothing
(no copied version, no lineage claim, no history line), the copy counts against the tenant's adapter limits, two
segments never share a lineage, and a lineage too long to have segments is said as such."""

from __future__ import annotations

import json
import re

import pytest

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.kept_versions import AdapterVersions
from livelora.adapters.segments import SegmentStore
from livelora.adapters.store import CONFIG_FILE, WEIGHTS_FILE, AdapterStore
from livelora.clients.errors import BadRequestError, ConflictError, RateLimitError
from livelora.core.owners import OwnerStore
from livelora.core.quotas import Limits, QuotaStore


def version(home, lineage: str, payload: bytes = b"w" * 1000) -> None:
    def write(tmp):
        (tmp / WEIGHTS_FILE).write_bytes(payload)
        (tmp / CONFIG_FILE).write_text(json.dumps({"r": 2}))

    AdapterStore(home).write_version(lineage, write, base_model="base")


def snapshot(home) -> tuple:
    """What a refused create must leave as it was: bindings, history, lineages and owner records."""
    endpoints = EndpointStore(home)
    owners = sorted(p.name for p in home.rglob("*") if "owners" in p.parts)
    return endpoints.all(), endpoints.log.read(), sorted(AdapterStore(home).lineages()), owners


@pytest.fixture
def home(tmp_path):
    endpoints = EndpointStore(tmp_path)
    version(tmp_path, "acme.support")
    OwnerStore(tmp_path).claim("lineage", "acme.support", "acme")
    endpoints.create("acme.live", "acme.support", tenant="acme", who="t")
    endpoints.create("acme.canary", "acme.support", tenant="acme", who="t")
    return tmp_path


def test_a_refused_create_writes_nothing(home):
    segments, before = SegmentStore(EndpointStore(home)), snapshot(home)
    with pytest.raises(BadRequestError) as bad:
        segments.create("acme.live", "vip", tenant="acme", who="t", reason="a\tb")
    assert bad.value.param == "reason"
    assert snapshot(home) == before and "acme.support-seg-vip" not in AdapterStore(home).lineages()
    assert OwnerStore(home).owner("lineage", "acme.support-seg-vip") is None
    binding, _ = segments.create("acme.live", "vip", tenant="acme", who="t", reason="now right")
    assert binding.lineage == "acme.support-seg-vip" and AdapterStore(home).version_numbers(binding.lineage) == [1]


def test_the_copied_version_counts_against_the_tenants_adapter_limits(home):
    QuotaStore(home).set("acme", Limits(max_adapter_versions=1))  # acme keeps acme.support@1 already
    versions, segments = AdapterVersions(home, Limits()), SegmentStore(EndpointStore(home))
    before = snapshot(home)
    with pytest.raises(RateLimitError) as over:
        segments.create("acme.live", "vip", tenant="acme", who="t", versions=versions)
    assert over.value.param == "max_adapter_versions" and snapshot(home) == before
    QuotaStore(home).set("acme", Limits(max_adapter_versions=None, max_adapter_bytes=1500))  # the copy: +1000 bytes
    with pytest.raises(RateLimitError) as over:
        segments.create("acme.live", "vip", tenant="acme", who="t", versions=versions)
    assert over.value.param == "max_adapter_bytes" and snapshot(home) == before
    QuotaStore(home).set("acme", Limits(max_adapter_versions=2, max_adapter_bytes=None))
    segments.create("acme.live", "vip", tenant="acme", who="t", versions=versions)
    assert versions.count("acme") == 2


def test_two_segments_never_share_a_lineage(home):
    segments = SegmentStore(EndpointStore(home))
    segments.create("acme.live", "vip", tenant="acme", who="t")
    before = snapshot(home)
    with pytest.raises(ConflictError) as taken:  # acme.canary follows the same lineage: same segment lineage
        segments.create("acme.canary", "vip", tenant="acme", who="t")
    assert taken.value.param == "segment" and snapshot(home) == before
    version(home, "acme.support-seg-gold")  # a lineage with versions already (not a segment's)
    with pytest.raises(ConflictError):
        segments.create("acme.live", "gold", tenant="acme", who="t")
    assert AdapterStore(home).version_numbers("acme.support-seg-gold") == [1]


def test_a_lineage_too_long_for_segments_is_said_as_such(tmp_path):
    endpoints, lineage = EndpointStore(tmp_path), "acme." + "l" * 55
    endpoints.create("acme.long", lineage, tenant="acme", who="t")
    with pytest.raises(BadRequestError) as bad:
        SegmentStore(endpoints).create("acme.long", "v", tenant="acme", who="t")
    assert bad.value.param == "endpoint" and "too long for a segment lineage" in bad.value.message
    assert not re.search(r"-\d", bad.value.message)
    endpoints.create("acme.mid", "acme." + "m" * 50, tenant="acme", who="t")  # room for 4 characters
    with pytest.raises(BadRequestError) as bad:
        SegmentStore(endpoints).create("acme.mid", "vipsx", tenant="acme", who="t")
    assert bad.value.param == "segment" and "at most 4 characters" in bad.value.message
