"""Fixtures shared by the integration modules."""

import pytest
from cluster_procs import prefill_and_decode


@pytest.fixture(scope="session")
def pd_pair(tiny_model_dir):
    """`get(connector)`: a prefill (5 s leases) and a decode process of the tiny model over
    `connector`, started on first use and shared by the modules that only send them requests
    (test_services, test_internal_attacks): each pair starts once a session, not once a module.
    """
    running = {}

    def get(connector: str):
        if connector not in running:
            running[connector] = prefill_and_decode(tiny_model_dir, connector)
        return running[connector]

    yield get
    for pair in running.values():
        for server in pair:
            server.stop()
