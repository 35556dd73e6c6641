"""JSON from other processes and clients: nesting too deep for Python's parser is a ValueError
at every parser that reads it, never a RecursionError that escapes an `except ValueError`."""

import json

import pytest

from pdserve import untrusted_json
from pdserve.kv_transfer.nixl_leases import REPLY, REQUEST, _parse_request, parse_reply
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.services.convert import handle_from_proto
from pdserve.structured_outputs import StructuredOutputsParams

DEEP = "[" * 5000


def test_loads_parses_json_and_refuses_what_python_cannot_hold():
    assert untrusted_json.loads('{"a": [1, 2]}') == {"a": [1, 2]}
    assert untrusted_json.loads(b"[[1]]") == [[1]]
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # the failure this module exists for
    for bad in (DEEP, "{", b"\xff"):
        with pytest.raises(ValueError):
            untrusted_json.loads(bad)


def test_every_reader_of_foreign_json_refuses_deep_nesting_as_a_value_error():
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json=DEEP)
    with pytest.raises(ValueError, match="handle.descriptor_json"):
        handle_from_proto(common_pb2.KVHandle(connector="shm", descriptor_json=DEEP))
    with pytest.raises(ValueError):  # the nixl lease server drops it and keeps serving
        _parse_request(REQUEST + DEEP.encode())
    assert parse_reply(REPLY + DEEP.encode(), "nonce") is None
