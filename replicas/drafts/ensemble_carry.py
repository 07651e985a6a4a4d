"""What a TABED ensemble's request (``ensemble.py``) leaves to the cluster when it ends, as integer
counts that every target replica adds up through Redis (``policies/carry.py``, docs/design.md §11):

    tabed_<views>_g<grid>_positions   the verified positions the session scored
    tabed_<views>_g<grid>_hits_<j>    of those, where candidate j's mix drafted the verified token

``<views>``: the views' indexes in ``ensemble.VIEWS``, in order (``01``: full, last-turn);
``<grid>``: the weight grid's steps. Together they name the candidate set, so an ensemble of other
views or another grid under the same draft name (a changed config) counts under other names and
never misreads these. Only the ``matches`` distance carries: its counts are exact integers, a
candidate absent from the sums never hit, and summed hits over summed positions is the hit rate a
request scores the candidates by; KL and TVD ensembles keep their prior on the replica.

For example, a full + last-turn ensemble at grid 10 whose request scored 12 positions, the equal mix
(j = 0) right at 9 of them and the full view alone right at 11, leaves
``{"tabed_01_g10_positions": 12, "tabed_01_g10_hits_0": 9, "tabed_01_g10_hits_9": 11, ...}``
(a candidate that never hit is left out).

Both ways cross deployments (a draft deployment's release reply; the snapshot's sums a request
brings to its draft), so both are checked here: names of this pattern, counts finite and
non-negative, hits at most positions, candidates within ``MAX_CANDIDATES``; a set with anything
else is dropped whole (a partial set would read as misses), which costs a cold first block, never
a request. No torch here: the policy service imports the pattern.
"""

from __future__ import annotations

import math
import re

# Candidates an ensemble carries counts for at most: four views at grid 10 are 286.
MAX_CANDIDATES = 300
_BELOW_300 = r"([0-9]|[1-9][0-9]|[12][0-9]{2})"
# A carried count's name (``carry.LEARNED_COUNTERS`` holds it; ``redis_schema`` admits it).
COUNTERS = rf"tabed_[0-5]{{1,6}}_g([1-9]|[1-9][0-9]|[12][0-9]{{2}})_(positions|hits_{_BELOW_300})"
_NAME = re.compile(r"(tabed_([0-5]+)_g([0-9]+)_)(positions|hits_([0-9]+))")
# One request's positions at most: far beyond any context.
MAX_POSITIONS = 1 << 31


def prefix(view_indexes: list[int], grid: int) -> str:
    """The names' common part for an ensemble of these views (indexes in ``VIEWS``) and grid."""
    return f"tabed_{''.join(map(str, view_indexes))}_g{grid}_"


def candidates_of(name_prefix: str) -> int:
    """How many candidate mixes the views and grid of ``name_prefix`` make: the points of the
    simplex grid, C(grid + m − 1, m − 1) for m views (two views at grid 10: 11)."""
    m = _NAME.fullmatch(name_prefix + "positions")
    views, grid = len(m.group(2)), int(m.group(3))
    return math.comb(grid + views - 1, views - 1)


def session_counts(name_prefix: str, positions: int, hits: list[int]) -> dict[str, int]:
    """A finished session's counts: its scored positions and each candidate's hits (none: {})."""
    if positions <= 0:
        return {}
    return {f"{name_prefix}positions": positions,
            **{f"{name_prefix}hits_{j}": n for j, n in enumerate(hits) if n > 0}}


def valid_counts(counts) -> dict[str, int]:
    """One session's counts as a release reply brought them, or {} when any is not a count of one
    candidate set (``COUNTERS``, a j below its candidates, a positive int, hits ≤ positions)."""
    if not isinstance(counts, dict) or not counts or len(counts) > MAX_CANDIDATES + 1:
        return {}
    parsed = [(_NAME.fullmatch(name) if isinstance(name, str) and re.fullmatch(COUNTERS, name) else None, n)
              for name, n in counts.items()]
    if any(m is None or type(n) is not int or not 0 < n <= MAX_POSITIONS for m, n in parsed):
        return {}
    prefixes = {m.group(1) for m, _ in parsed}
    if len(prefixes) != 1 or (total := candidates_of(next(iter(prefixes)))) > MAX_CANDIDATES:
        return {}
    positions = next((n for m, n in parsed if m.group(4) == "positions"), 0)
    if any(m.group(5) is not None and (int(m.group(5)) >= total or n > positions) for m, n in parsed):
        return {}
    return dict(counts)


# The final context's tokens a release carries (``valid_ending``): more than a block drafts.
ENDING_TOKENS = 64


def ending_of(context: list[int]) -> tuple[int, list[int]]:
    """What a release tells an ensemble of its request's final ``context``: its length and last
    tokens, enough to score the block drafted last."""
    return len(context), list(context[-ENDING_TOKENS:])


def valid_ending(ending) -> tuple[int, list[int]] | None:
    """An ending as a release brought it from the target (another deployment), or None: a length
    up to ``MAX_POSITIONS``, at most ``ENDING_TOKENS`` non-negative int tokens, no more than it."""
    if not isinstance(ending, (tuple, list)) or len(ending) != 2:
        return None
    length, tail = ending
    if type(length) is not int or not 0 < length <= MAX_POSITIONS or not isinstance(tail, (tuple, list)) \
            or not 0 < len(tail) <= min(length, ENDING_TOKENS) or any(type(t) is not int or t < 0 for t in tail):
        return None
    return length, list(tail)


def released_counts(reply, session_ids: list[str]) -> dict[str, dict[str, int]]:
    """The valid counts (``valid_counts``) of the asked ``session_ids`` in a draft's release reply."""
    if not isinstance(reply, dict):
        return {}
    out = {}
    for session_id in session_ids:
        counts = valid_counts(reply.get(session_id))
        if counts:
            out[session_id] = counts
    return out


def cluster_sums(learned: dict | None) -> dict[str, float] | None:
    """The ensemble's part of a request's carried sums (``SpecRequest.prior_learned["sums"]``),
    what its draft is sent with the session's first ask; None: there are none."""
    sums = (learned or {}).get("sums") if isinstance(learned, dict) else None
    if not isinstance(sums, dict):
        return None
    ours = {name: n for name, n in sums.items() if isinstance(name, str) and name.startswith("tabed_")}
    return ours or None


def hit_rates(sums, name_prefix: str, candidates: int) -> tuple[list[float], float] | None:
    """Each candidate's hit rate over the positions ``sums`` count under ``name_prefix`` (the
    cluster's decayed sums: floats), and those positions; None when the set is absent or any of
    its counts is bad (not finite, negative, a candidate beyond ``candidates``, hits above the
    positions beyond rounding). Other candidate sets' names are not read."""
    if not isinstance(sums, dict) or candidates > MAX_CANDIDATES:
        return None
    positions = sums.get(f"{name_prefix}positions")
    if not _amount(positions) or positions <= 0:
        return None
    rates = [0.0] * candidates
    for name, n in sums.items():
        if not isinstance(name, str) or not name.startswith(f"{name_prefix}hits_"):
            continue
        j = name.removeprefix(f"{name_prefix}hits_")
        if not re.fullmatch(r"[0-9]{1,3}", j) or int(j) >= candidates or not _amount(n) or n > positions * (1 + 1e-6) + 1e-3:
            return None
        rates[int(j)] = min(1.0, n / positions)
    return rates, float(positions)


def _amount(n) -> bool:
    return isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
