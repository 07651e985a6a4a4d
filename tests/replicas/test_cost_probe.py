"""The start-up cost probe: batch-1 verify points, and the loaded ones, on the slots it borrows."""

from specserve.replicas.cost_probe import LOADED_BATCH, LOADED_WINDOWS, VERIFY_WINDOWS, loaded_verify_points, verify_points
from specserve.replicas.target import Target
from tiny_models import tiny_model


def test_the_probes_measure_each_size_and_leave_their_slots_empty():
    target = Target(tiny_model("llama", seed=0), slots=LOADED_BATCH + 2)
    alone = verify_points(target, target.slots - 1, rounds=1)
    assert [tokens for tokens, _ in alone] == [1, 3, 5, 7] and all(ms > 0 for _, ms in alone)
    slots = list(range(2, 2 + LOADED_BATCH))
    loaded = loaded_verify_points(target, slots, rounds=1)
    assert [tokens for tokens, _ in loaded] == [LOADED_BATCH * (1 + w) for w in LOADED_WINDOWS]
    assert all(ms > 0 for _, ms in loaded)
    assert all(len(target.kv.tokens[s]) == 0 for s in range(target.slots)), "a probe left a prefix cache behind"


def test_every_verify_feeds_its_root_and_window_on_a_context_prefilled_once():
    """The probes prefill once: each verify rolls its slot back to the context, so every round
    feeds the root and the window (1 + γ tokens a request), the loaded one on every slot."""
    target = Target(tiny_model("llama", seed=0), slots=LOADED_BATCH + 2)
    fed: list[list[int]] = []
    forward = target.kv.forward
    target.kv.forward = lambda feeds, *a, **k: (fed.append([len(f.tokens) for f in feeds]), forward(feeds, *a, **k))[1]
    verify_points(target, target.slots - 1, rounds=2)
    prefill, *verifies = fed
    assert len(prefill) == 1 and prefill[0] > 8
    assert verifies == [[1 + w] for w in VERIFY_WINDOWS for _ in range(3)]
    fed.clear()
    slots = list(range(2, 2 + LOADED_BATCH))
    loaded_verify_points(target, slots, rounds=1)
    prefill, *verifies = fed
    assert len(prefill) == 1
    assert verifies == [[1 + w] * LOADED_BATCH for w in LOADED_WINDOWS for _ in range(2)]
