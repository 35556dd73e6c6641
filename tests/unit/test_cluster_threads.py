"""A Cluster forks its children from the main thread only: Linux ties the parent-death
signal to the forking thread, so children started from a worker thread would be killed
when that thread ends."""

import threading

from pdserve.cluster import Cluster, ClusterError, ClusterSpec


def test_a_cluster_refuses_to_start_off_the_main_thread(tmp_path):
    cluster = Cluster(ClusterSpec(model=str(tmp_path / "no-model"), grpc_port=0,
                                  log_dir=str(tmp_path)))
    caught: list[BaseException] = []

    def start():
        try:
            cluster.start()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            caught.append(e)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join(30)
    assert len(caught) == 1 and isinstance(caught[0], ClusterError)
    assert "main thread" in str(caught[0])
    assert cluster.children == []  # nothing was started
