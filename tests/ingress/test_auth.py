"""API keys: from the environment and a file, digests only, bearer or x-api-key, HTTP and gRPC."""

import pytest

from specserve.ingress.auth import KEYS_ENV, ApiKeys, bearer, client_headers, client_metadata


def test_no_key_configured_means_open():
    keys = ApiKeys.load(env={})
    assert not keys.enabled and keys.allows(None) and keys.allows_header(None)


def test_keys_from_the_environment_and_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops team\nk-file-1\n\n  k-file-2  \n")
    keys = ApiKeys.load(str(path), env={KEYS_ENV: "k-env-1, k-env-2"})
    assert len(keys) == 4
    for key in ("k-env-1", "k-env-2", "k-file-1", "k-file-2"):
        assert keys.allows_header(f"Bearer {key}"), key
        assert keys.allows_header(None, api_key=key), key
    for header in (None, "", "Bearer", "Bearer k-env-3", "Basic k-env-1", "k-env-1", "Bearer # ops team"):
        assert not keys.allows_header(header), header


def test_only_digests_are_kept():
    keys = ApiKeys(["s3cret-value"])
    assert "s3cret-value" not in repr(vars(keys))


def test_a_configured_file_that_cannot_be_used_stops_the_ingress(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        ApiKeys.load(str(tmp_path / "missing"), env={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(str(empty), env={})


def test_grpc_metadata_and_bearer_parsing():
    keys = ApiKeys(["abc"])
    assert keys.allows_metadata([("authorization", "Bearer abc")])
    assert keys.allows_metadata([("x-api-key", b"abc")])
    assert not keys.allows_metadata([("authorization", "Bearer abd")])
    assert not keys.allows_metadata([])
    assert bearer("bearer  abc ") == "abc" and bearer("Token abc") is None


def test_specserves_own_clients_send_the_key_from_their_environment():
    assert client_headers({}) == {} and client_metadata({}) == []
    assert client_headers({"SPECSERVE_API_KEY": "abc"}) == {"Authorization": "Bearer abc"}
    assert client_metadata({"SPECSERVE_API_KEY": "abc"}) == [("authorization", "Bearer abc")]
