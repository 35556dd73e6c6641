"""A cluster's ports are checked where its children bind them: on a wildcard host, a port
another address already uses is not free (checking 127.0.0.1 alone would say it is)."""

import socket

from pdserve import cluster as cluster_mod
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.ports import _bindable


def test_a_port_taken_on_another_address_is_not_free_on_the_wildcard():
    with socket.create_server(("127.0.0.2", 0)) as taken:
        port = taken.getsockname()[1]
        assert _bindable("127.0.0.1", port)  # what the old check looked at
        assert not _bindable("0.0.0.0", port)  # where a child given --host 0.0.0.0 binds


def test_the_cluster_checks_ports_on_the_host_children_bind(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(cluster_mod, "pick_free_port", lambda host: asked.append(host) or 40000)
    cluster = Cluster(ClusterSpec(host="0.0.0.0", grpc_port=0, log_dir=str(tmp_path)))
    assert asked == ["0.0.0.0"] and cluster.router_address == "127.0.0.1:40000"
