"""The committed gRPC stubs are exactly what the .proto sources generate."""

from pathlib import Path

from pdserve.proto.generate import DEFAULT_OUT, generate


def test_regenerating_stubs_gives_the_committed_files(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = DEFAULT_OUT / "pdserve" / "v1" / path.name
        assert committed.exists(), f"{path.name} is not committed"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale"
    committed_names = {p.name for p in (DEFAULT_OUT / "pdserve" / "v1").glob("*_pb2*")}
    assert committed_names == {p.name for p in fresh if "_pb2" in p.name}


def test_services_are_in_the_descriptors():
    from pdserve.proto.pdserve.v1 import engine_pb2, router_pb2

    assert set(engine_pb2.DESCRIPTOR.services_by_name) == {"Prefill", "Decode", "Pooling"}
    assert {"Generate", "Embed"} <= set(router_pb2.DESCRIPTOR.services_by_name["Router"]
                                        .methods_by_name)
    assert Path(router_pb2.__file__).parent == DEFAULT_OUT / "pdserve" / "v1"
