"""The KV connectors an integration module runs over: all three with PDSERVE_SLOW_TESTS=1, by
default the ones the module names. Each connector's contract is checked end to end in the
default run (test_services, test_internal_attacks); modules whose subject is not the connector
(authentication, grammars, the router) start their cluster over one connector each, and over
every connector in the slow run."""

import os

import pytest

from pdserve.kv_transfer import nixl_available

SLOW = bool(os.environ.get("PDSERVE_SLOW_TESTS"))
ALL = ("shm", "tcp", "nixl")


def connectors(*default: str) -> list:
    """pytest parameters: `default` (every connector in the slow run); nixl is skipped, saying
    so, where it is not installed."""
    return [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(),
                                                          reason="nixl is not installed"))
            if name == "nixl" else name for name in (ALL if SLOW else default)]
