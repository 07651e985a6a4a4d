"""Optional API keys on the ingress: HTTP ``Authorization: Bearer <key>``, gRPC metadata
``authorization: Bearer <key>`` (or ``x-api-key``), the same keys for both.

Keys come from the environment (``SPECSERVE_API_KEYS``, comma-separated) and/or a file named in the
application config (one key per line, ``#`` comments), read by the ingress replica itself: the
keys never travel in the Serve config, where the dashboard would show them. Only their SHA-256
digests are kept, compared in constant time, and no key is ever logged. With no key configured,
the ingress is open (the local default); a key file that is configured but unreadable or empty
stops the ingress from starting, so a typo never silently turns authentication off.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

KEYS_ENV = "SPECSERVE_API_KEYS"     # the server's accepted keys
CLIENT_KEY_ENV = "SPECSERVE_API_KEY"  # the key specserve's own clients (CLI, benchmarks) send


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._digests = [_digest(k) for k in {k.strip() for k in keys} if k]

    @classmethod
    def load(cls, keys_file: str | None = None, env: dict[str, str] | None = None) -> "ApiKeys":
        env = os.environ if env is None else env
        keys = [k for k in env.get(KEYS_ENV, "").split(",") if k.strip()]
        if keys_file:
            path = Path(keys_file).expanduser()
            try:
                lines = path.read_text().splitlines()
            except OSError as err:
                raise ValueError(f"api_keys_file {path}: cannot read it ({err.strerror or err}); "
                                 "fix the path or remove the setting") from None
            from_file = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
            if not from_file:
                raise ValueError(f"api_keys_file {path} holds no key (one per line, # for comments)")
            keys += from_file
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, key: str | None) -> bool:
        if not self.enabled:
            return True
        if not key:
            return False
        digest = _digest(key)
        # Every digest is compared, so the time taken says nothing about which key was close.
        return any([hmac.compare_digest(digest, d) for d in self._digests])

    def allows_header(self, authorization: str | None, api_key: str | None = None) -> bool:
        """``Authorization: Bearer <key>`` (OpenAI's clients) or an ``x-api-key`` header."""
        return self.allows(bearer(authorization) or api_key)

    def allows_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        found = {k.lower(): (v.decode() if isinstance(v, bytes) else v) for k, v in metadata}
        return self.allows_header(found.get("authorization"), found.get("x-api-key"))


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def client_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """The header specserve's own clients send: ``SPECSERVE_API_KEY`` when set."""
    key = (os.environ if env is None else env).get(CLIENT_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def client_metadata(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in client_headers(env).items()]
