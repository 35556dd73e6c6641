"""A KV producer process for the transport tests and the benchmark.

    python kv_producer.py KIND ENGINE_ID LAYOUT_JSON SEED [OPTIONS_JSON]

Allocates a cache through the transport, fills it with `fill_cache(layout, seed)`, serves it and
prints one line `DESCRIPTOR <json>` on stdout. Then obeys stdin lines:
    close  -> transport.close(), print "CLOSED", keep running
    exit   -> exit *without* calling close() (tests the at-exit cleanup)
    EOF    -> close and exit
"""

from __future__ import annotations

import json
import os
import sys

import torch

DESCRIPTOR_PREFIX = "DESCRIPTOR "
GRANTS_PREFIX = "GRANTS "


def fill_cache(layout_dict: dict, seed: int) -> torch.Tensor:
    """Deterministic contents (layers, 2, blocks, block_size, kv_heads, head_dim) for a layout."""
    from pdserve.kv_transfer import KVLayout

    layout = KVLayout.from_dict(layout_dict)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(layout.torch_dtype)


def main() -> None:
    from pdserve.kv_transfer import KVLayout, make_transport

    kind, engine_id, layout_json, seed = sys.argv[1:5]
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    layout_dict = json.loads(layout_json)
    if "tls" in options:  # {"cert", "key", "ca"}: PEM paths, as the --tls-*-file flags
        from pdserve.kv_transfer.socket_tls import SocketTls
        pem = {k: open(v, "rb").read() for k, v in options["tls"].items()}
        options["tls"] = SocketTls.from_pem(pem["cert"], pem["key"], pem["ca"])
    transport = make_transport(kind, engine_id, **options)
    cache = transport.allocate_kv_cache(KVLayout.from_dict(layout_dict))
    cache.copy_(fill_cache(layout_dict, int(seed)))
    descriptor = transport.serve()
    # Two leases, as a prefill engine grants them: every block, and blocks 1 and 2 only.
    grants = {"all": transport.grant("all", range(layout_dict["num_blocks"])),
              "small": transport.grant("small", [1, 2])}
    print(DESCRIPTOR_PREFIX + json.dumps(descriptor), flush=True)
    print(GRANTS_PREFIX + json.dumps(grants), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command.startswith("revoke "):
            transport.revoke(command.split()[1])
            print("REVOKED", flush=True)
        elif command == "close":
            transport.close()
            print("CLOSED", flush=True)
        elif command == "exit":
            sys.stdout.flush()
            return  # interpreter exit runs the transport's at-exit guard
    transport.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
