"""API keys ``tml-<id>-<secret>`` (core/api_keys.py): the secret's alphabet holds the separator ``-`` (and ``_``), so
:func:`parse_key` must cut a key at fixed places whatever the secret begins, ends or is full of, and a key made by
:class:`KeyStore` verifies as itself and nothing else."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from livelora.core.api_keys import KeyStore, parse_key

URLSAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
CRAFTED = ["-", "_", "--", "-abc", "abc-", "-abc-", "a--b", "_-_", "---x---", "-" * 43, "-" + "A" * 42]


@pytest.mark.parametrize("secret", CRAFTED)
def test_a_secret_that_begins_ends_or_is_full_of_the_separator_parses_whole(secret):
    key_id = secrets.token_hex(6)
    assert parse_key(f"tml-{key_id}-{secret}") == (key_id, secret)


@given(key_id=st.text("0123456789abcdef", min_size=12, max_size=12), secret=st.text(URLSAFE, min_size=1, max_size=64))
@example(key_id="0123456789ab", secret="-leading")
@example(key_id="0123456789ab", secret="trailing-")
def test_any_id_and_urlsafe_secret_round_trip(key_id, secret):
    assert parse_key(f"tml-{key_id}-{secret}") == (key_id, secret)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "tml-local",  # what an open server accepts: no id, no secret
        "tml-0123456789ab",  # no secret
        "tml-0123456789ab-",  # empty secret
        "tml-0123456789a-secret",  # 11-digit id
        "tml-0123456789AB-secret",  # upper-case hex
        "sk-0123456789ab-secret",  # another prefix
        "tml-0123456789ab-sec ret",  # outside the url-safe alphabet
        "tml-0123456789ab-secret\n",
    ],
)
def test_anything_else_is_refused(bad):
    with pytest.raises(ValueError, match="tml-<12 hex digits>-<secret>"):
        parse_key(bad)


def test_made_keys_verify_as_themselves_and_a_changed_secret_does_not(tmp_path):
    store = KeyStore(tmp_path)
    made = [store.create("acme", ["inference"], f"k{i}") for i in range(64)]
    for record, key in made:
        key_id, secret = parse_key(key)
        assert key_id == record.id and len(secret) == 43
        assert store.verify(key).key_id == record.id
        flipped = secret[:-1] + ("-" if secret[-1] != "-" else "_")
        assert store.verify(f"tml-{key_id}-{flipped}") is None
        assert store.verify(f"tml-{key_id}--{secret}") is None
    store.revoke(made[0][0].id)
    assert store.verify(made[0][1]) is None and store.verify(made[1][1]).tenant == "acme"
