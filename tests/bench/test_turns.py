"""Rows taking turns: each round starts one row later, and every row leads once per len(rows) rounds."""

from specserve.bench.turns import in_turn


def test_each_round_starts_one_row_later_and_keeps_every_row():
    rows = ["a", "b", "c"]
    assert [in_turn(rows, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert in_turn(("x",), 5) == ["x"]
