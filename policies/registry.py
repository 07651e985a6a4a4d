"""Policies by name: what a deployment's config (``AppConfig.policy``) chooses from.

``load-aware`` (the default) is the goodput gate over the request's own window: speculation only
where it pays at the replica's current batch. The window rules adapt each request's window every
step (``window.py``); they do not gate on load. ``q-learning`` carries its table across requests
(the paper's agent), ``q-learning-per-request`` starts every request from a fresh one. The tree rules adapt each request's tree
(``tree.py``) and, like the window rules, leave what they do not adapt as the request asked: a
window policy leaves trees alone, a tree policy leaves chains alone. ``static-tree`` is the static
policy under the name the benchmark gives its tree row.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.policies.adt_tree import RANDOM, VERTICAL, ADTTree
from specserve.policies.cache_fsm_window import CacheFSMWindow
from specserve.policies.eagle2_depth_tree import Eagle2DepthTree
from specserve.policies.fsm_window import FSMWindow
from specserve.policies.goodput import GoodputPolicy
from specserve.policies.hf_window import HFWindow
from specserve.policies.online_window import OnlineWindow
from specserve.policies.q_learning_window import QLearningWindow
from specserve.policies.sage_tree import SageTree
from specserve.replicas.request import StaticPolicy
from specserve.policies.tree import TreePolicy
from specserve.policies.window import WindowPolicy

# The names are also the rows of ``bench policies``.
POLICIES: dict[str, Callable[[], object]] = {
    "load-aware": lambda: GoodputPolicy(StaticPolicy()),
    "static": StaticPolicy,
    "online": lambda: WindowPolicy(OnlineWindow()),
    "fsm": lambda: WindowPolicy(FSMWindow()),
    "cache-fsm": lambda: WindowPolicy(CacheFSMWindow()),
    "q-learning": lambda: WindowPolicy(QLearningWindow()),
    "q-learning-per-request": lambda: WindowPolicy(QLearningWindow(carry=False)),
    "hf-heuristic": lambda: WindowPolicy(HFWindow()),
    "static-tree": StaticPolicy,
    "sage": lambda: TreePolicy(SageTree()),
    "adt-tree": lambda: TreePolicy(ADTTree()),
    # ADT-Tree's other initialisations on an image grid (the paper's ablation, §V).
    "adt-tree-vertical": lambda: TreePolicy(ADTTree(init=VERTICAL)),
    "adt-tree-random": lambda: TreePolicy(ADTTree(init=RANDOM)),
    "eagle2-depth": lambda: TreePolicy(Eagle2DepthTree()),
}
DEFAULT_POLICY = "load-aware"
# Which names adapt chains and which adapt trees, so that a benchmark can tell them apart.
WINDOW_POLICY_NAMES = ("static", "online", "fsm", "cache-fsm", "q-learning", "q-learning-per-request", "hf-heuristic")
TREE_POLICY_NAMES = ("static-tree", "sage", "adt-tree", "adt-tree-vertical", "adt-tree-random", "eagle2-depth")


def build_policy(name: str):
    """A fresh policy (its state is per replica); a clear error for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
