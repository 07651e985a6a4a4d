"""The start-up cost probe: batch-1 verify points, and the loaded ones, on the slots it borrows."""

from specserve.replicas.cost_probe import LOADED_BATCH, LOADED_WINDOWS, loaded_verify_points, verify_points
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
