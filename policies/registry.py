"""Policies by name: what a deployment's config (``AppConfig.policy``) chooses from.

``load-aware`` (the default) is the goodput gate over the request's own window: speculation only
where it pays at the replica's current batch. The window rules adapt each request's window every
step (``window.py``); they do not gate on load.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.policies.cache_fsm_window import CacheFSMWindow
from specserve.policies.fsm_window import FSMWindow
from specserve.policies.goodput import GoodputPolicy
from specserve.policies.hf_window import HFWindow
from specserve.policies.online_window import OnlineWindow
from specserve.policies.q_learning_window import QLearningWindow
from specserve.policies.static import StaticPolicy
from specserve.policies.window import WindowPolicy

# Names as in issue 13's benchmark rows.
POLICIES: dict[str, Callable[[], object]] = {
    "load-aware": lambda: GoodputPolicy(StaticPolicy()),
    "static": StaticPolicy,
    "online": lambda: WindowPolicy(OnlineWindow()),
    "fsm": lambda: WindowPolicy(FSMWindow()),
    "cache-fsm": lambda: WindowPolicy(CacheFSMWindow()),
    "q-learning": lambda: WindowPolicy(QLearningWindow()),
    "hf-heuristic": lambda: WindowPolicy(HFWindow()),
}
DEFAULT_POLICY = "load-aware"


def build_policy(name: str):
    """A fresh policy (its state is per replica); a clear error for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
