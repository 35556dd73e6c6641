"""A crashed instance's shm segment is reclaimed by its supervisor (`Cluster`, as `pdserve up`
runs it), and a live instance's segment is never touched."""

import os
import signal

from pdserve.cluster import SHM_DIR, Cluster, ClusterSpec


def segments_of(pid: int) -> list[str]:
    """The KV segments an instance process created (their names record the owner's pid)."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith("pdserve-kv-") and f"-{pid}-" in n]


def test_supervisor_reclaims_a_killed_instances_segment(tiny_model_dir, tmp_path):
    spec = ClusterSpec(model=str(tiny_model_dir), connector="shm", grpc_port=0,
                       kv_cache_memory_bytes=8 << 20, startup_timeout_s=90,
                       log_dir=str(tmp_path))
    with Cluster(spec) as cluster:
        prefill, decode = cluster.child("prefill-0"), cluster.child("decode-0")
        killed = segments_of(prefill.proc.pid)
        live = segments_of(decode.proc.pid)
        assert killed and live
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in killed)  # left behind
        assert [c.name for c in cluster.dead()] == ["prefill-0"]
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in killed)
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in live)
