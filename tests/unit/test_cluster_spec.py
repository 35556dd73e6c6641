"""What a ClusterSpec (`pdserve up`'s plan) refuses before anything starts."""

import pytest

from pdserve.cluster import ClusterSpec


@pytest.mark.parametrize("key", ["sk-part-one,sk-part-two", " "])
def test_an_api_key_the_gateway_would_read_differently_is_refused(key):
    """The key reaches the gateway in $PDSERVE_API_KEY, a comma-separated list: a comma
    would make two keys of one (and let in whoever knows the second half)."""
    with pytest.raises(ValueError, match="api_key"):
        ClusterSpec(api_key=key)
