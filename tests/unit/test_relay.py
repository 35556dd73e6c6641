"""The router's relay of a decode stream: a message for a sequence the request does not have
is a broken stream, never forwarded (the gateway would put it in another prompt's choice)."""

import pytest

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.relay import BrokenDecodeStream, Relay


@pytest.mark.parametrize("index", [2, -1, 7])
def test_a_message_outside_the_requests_sequences_is_refused(index):
    relay = Relay("r", [1, 2, 3], 2, common_pb2.ServedBy())
    with pytest.raises(BrokenDecodeStream, match="index"):
        relay.forward(common_pb2.GenerateResponse(index=index, token_ids=[5]))
    assert not relay.received
    out = relay.forward(common_pb2.GenerateResponse(index=1, token_ids=[5], finish_reason="stop"))
    assert out.index == 1 and list(out.token_ids) == [5] and out.request_id == "r"
    assert relay.missing == [0]
