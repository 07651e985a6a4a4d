"""Finished outputs shared between a target's replicas through Redis: what the suffix draft's
cluster index learns from (``replicas/drafts/suffix.py``).

    <prefix>:outputs:<target>    stream, capped (``MAXLEN ~ max_outputs``): one entry per finished
                                 output: ``r`` the replica, ``s`` its cache_salt (absent: none),
                                 ``t`` its token ids (int32, little-endian bytes)

Each replica appends its own outputs in batches (one pipeline per ``interval_s``) and reads the
others' from the last entry it saw; a replica that starts reads the whole stream first: the
capped stream is the snapshot a new replica rebuilds its index from. Its own outputs it already
remembered when they finished, so it skips them.

Nothing here is on the request path, and Redis being away costs only the sharing: an unsent
batch is kept (bounded: the oldest outputs go first) and sent when Redis answers. A batch whose
reply was lost may arrive twice, which only counts those outputs twice in the indexes; outputs
carry no secret beyond their tenant's, and a request reads only its own tenant's.

What is read is checked before the index sees it (``redis_schema``): an entry whose tokens are not
whole int32s, more than ``MAX_OUTPUT_TOKENS``, or outside [0, vocabulary), or whose salt is not
short UTF-8, is skipped and counted; one exchange reads at most ``max_outputs`` entries (the
stream's own cap), so a stream grown past it is caught up over several exchanges, never at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np
import redis

from specserve.policies.redis_schema import MAX_NAME, OVERSIZE, is_wrong_type, reject, stream_range

logger = logging.getLogger("ray.serve")

# Outputs waiting to be sent while Redis is away; beyond, the oldest are dropped.
MAX_UNSENT = 1024
READ_BATCH = 512
# An output longer than any request may generate is not one of ours.
MAX_OUTPUT_TOKENS = 1 << 17
# Token ids are int32 on the wire; without the target's vocabulary, any non-negative one.
MAX_VOCAB = 1 << 31


class OutputExchange:
    def __init__(self, url: str, prefix: str, target: str, interval_s: float = 1.0, max_outputs: int = 20000,
                 timeout_s: float = 2.0, vocab_size: int | None = None):
        """``vocab_size``: the target's vocabulary, the bound of a received token id (None: int32)."""
        self.url = url
        self.vocab_size = min(vocab_size or MAX_VOCAB, MAX_VOCAB)
        self.key = f"{prefix}:outputs:{target}"
        self.interval_s = interval_s
        self.max_outputs = max_outputs
        self.replica = uuid.uuid4().hex.encode()
        # Bytes, not text: the tokens travel as raw int32.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)
        self._unsent: deque[tuple[str | None, bytes]] = deque(maxlen=MAX_UNSENT)
        self._last_id = b"0-0"   # the stream from its start: the snapshot
        self._down_since: float | None = None
        self.sent = self.received = 0

    def share(self, cache_salt: str | None, tokens) -> None:
        """Queue a finished output for the other replicas (sent at the next exchange)."""
        self._unsent.append((cache_salt, np.asarray(tokens, dtype="<i4").tobytes()))

    def exchange_once(self, receive: Callable[[str | None, np.ndarray], None]) -> int:
        """Send the queued outputs, then hand every other replica's new ones to ``receive``;
        returns how many were received. Blocking: call it in a thread (``receive`` runs there too,
        so it must only queue)."""
        try:
            self._send()
            received = self._read(receive)
        except redis.ResponseError as err:
            if not is_wrong_type(err):
                raise
            reject("output", "type", self.key, err)   # nothing to share through until it is a stream again
            return 0
        except (redis.RedisError, OSError) as err:
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning("sharing outputs through %s failed (%s: %s); retried every %.1f s",
                               self.url.split("@")[-1], type(err).__name__, err, self.interval_s)
            return 0
        if self._down_since is not None:
            logger.warning("outputs are shared through Redis again")
            self._down_since = None
        return received

    def _send(self) -> None:
        if not self._unsent:
            return
        batch = list(self._unsent)
        pipe = self.client.pipeline(transaction=False)
        for salt, tokens in batch:
            fields = {b"r": self.replica, b"t": tokens}
            if salt is not None:
                fields[b"s"] = salt.encode()
            pipe.xadd(self.key, fields, maxlen=self.max_outputs, approximate=True)
        pipe.execute()
        for _ in batch:   # what arrived meanwhile stays queued
            self._unsent.popleft()
        self.sent += len(batch)

    def _read(self, receive: Callable[[str | None, np.ndarray], None]) -> int:
        received = read = 0
        while read < self.max_outputs:
            entries = stream_range(self.client, self.key, min(READ_BATCH, self.max_outputs - read),
                                   4 * MAX_OUTPUT_TOKENS, after=self._last_id)
            for entry_id, fields in entries:
                self._last_id = entry_id
                read += 1
                if OVERSIZE.encode() in fields:   # left on the server
                    reject("output", "size", self.key, f"a field of {fields[OVERSIZE.encode()].decode()} bytes")
                    continue
                if fields.get(b"r") == self.replica or b"t" not in fields:
                    continue
                output = self._checked(fields)
                if output is not None:
                    receive(*output)
                    received += 1
            if len(entries) < READ_BATCH:
                break
        self.received += received
        return received

    def _checked(self, fields: dict[bytes, bytes]) -> tuple[str | None, np.ndarray] | None:
        """(salt, tokens) of a stream entry, or None when it is not a bounded output (counted)."""
        raw, salt = fields[b"t"], fields.get(b"s")
        if len(raw) % 4 or len(raw) > 4 * MAX_OUTPUT_TOKENS or (salt is not None and len(salt) > MAX_NAME):
            reject("output", "size", self.key, f"{len(raw)} token bytes, {len(salt or b'')} salt bytes")
            return None
        tokens = np.frombuffer(raw, dtype="<i4").astype(np.int32)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            reject("output", "schema", self.key, f"token ids outside [0, {self.vocab_size})")
            return None
        try:
            return (None if salt is None else salt.decode()), tokens
        except UnicodeDecodeError as err:
            reject("output", "schema", self.key, err)
            return None

    async def run_forever(self, receive: Callable[[str | None, np.ndarray], None]) -> None:
        while True:
            try:
                await asyncio.to_thread(self.exchange_once, receive)
            except Exception:  # noqa: BLE001 - sharing never takes the replica down
                logger.exception("output exchange failed unexpectedly")
            await asyncio.sleep(self.interval_s)
