"""The committed gRPC stubs are what specserve.proto generates (nobody edited one without the other)."""

from specserve.ingress.grpc_stubs import HERE, STUBS, generate


def test_committed_stubs_match_the_proto(tmp_path):
    for fresh in generate(tmp_path):
        committed = HERE / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run `python -m specserve.ingress.grpc_stubs`")
    assert {p.name for p in tmp_path.iterdir()} == set(STUBS)
