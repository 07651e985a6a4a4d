"""Cluster counters as the Redis store holds them, for the priors' and the policy view's tests."""

from collections import Counter


def counts(accepted, rejections, drafts=100, window=4, verify_ms=10.0, draft_ms=2.0, **extra):
    return Counter(drafts=drafts, draft_tokens=drafts * window, accepted_tokens=accepted, rejections=rejections,
                   emitted=accepted + drafts, **{f"window_{window}": drafts, f"verify_us_w{window}": int(drafts * verify_ms * 1e3)},
                   draft_us=int(drafts * draft_ms * 1e3), verify_us=int(drafts * verify_ms * 1e3), **extra)
