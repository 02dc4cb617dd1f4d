"""Durations in the messages people read are in words (:func:`livelora.core.durations.in_words`)."""

import pytest

from livelora.core.durations import in_words


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (604800, "7 days"),
        (86400, "1 day"),
        (5400, "1.5 hours"),
        (3600, "1 hour"),
        (90, "1.5 minutes"),
        (59, "59 seconds"),
        (1, "1 second"),
        (0, "0 seconds"),
        (0.3, "0.3 seconds"),
    ],
)
def test_in_words(seconds, words):
    assert in_words(seconds) == words
