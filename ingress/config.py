"""What the ingress needs of the application's configuration (``cluster.config.AppConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.ingress.images import ImageLimits
from specserve.replicas.step import TreeShape


@dataclass(frozen=True)
class IngressConfig:
    target: str
    model_id: str
    draft_names: list[str]
    default_draft: str
    default_window: int
    policy: str = "load-aware"           # the deployment's policy (a request may name its own)
    # The tree a request starts from when its policy adapts trees and it names none (the cluster's
    # best shape replaces it at the replica when a prior has one).
    default_tree: TreeShape = TreeShape(4, 2, 8)
    api_keys_file: str | None = None     # besides SPECSERVE_API_KEYS in the ingress's environment
    max_model_len: int | None = None     # prompt + completion at most (default: the model's context)
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0         # the whole HTTP body within this (guard.py)
    stream_interval: int = 1             # tokens per streamed piece at least (the first piece excepted)
    tool_parser: str | None = "hermes"   # how the target writes tool calls (``tools.TOOL_PARSERS``); None: none
    resume_attempts: int = 3             # continuations of one request after its target replica failed
    resume_timeout_s: float = 60.0       # how long a continuation may wait for a replica to take it
    # How long a new request may wait for its first token (queued, admitted, prefilled): a target
    # deployment with no running replica must not hold a client forever.
    first_token_timeout_s: float = 120.0
    call_timeout_s: float = 10.0         # any other call to another deployment (policy service, routes)
    retry_after_s: int = 5               # what a 503 tells the client to wait
    # draft -> where it runs and why ({"where", "reason", "figures"}, ``cluster/placement.py``)
    placement: dict[str, dict] = field(default_factory=dict)
    images: ImageLimits = field(default_factory=ImageLimits)   # a VLM target's pictures
