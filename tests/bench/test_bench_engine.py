"""The engine benchmark's configurations: the zoo's shipped drafts get rows of their own, and a
wrong name says which ones exist."""

import pytest

from specserve.bench.engine import BASELINE, ZOO_TREE, select_configs, zoo_configs
from specserve.replicas.model_store import zoo_drafts


def test_every_shipped_zoo_draft_has_chain_and_tree_rows():
    shipped = zoo_drafts()
    assert {"smollm2-draft-2l", "smollm2-hsr"} <= set(shipped)
    rows = {c.name: c for c in zoo_configs()}
    for name in shipped:
        assert rows[f"{name}-2"].window == 2 and rows[f"{name}-4"].draft == name
        assert rows[f"{name}-tree"].tree == ZOO_TREE


def test_selection_keeps_the_baseline_and_names_the_choices():
    chosen = select_configs(["smollm2-hsr-4"])
    assert [c.name for c in chosen] == [BASELINE, "smollm2-hsr-4"]
    with pytest.raises(ValueError, match="smollm2-hsr-tree"):
        select_configs(["nope"])


def test_every_figure_records_the_cpu_it_ran_on():
    from specserve.bench.engine import machine_info

    info = machine_info()
    # This machine class differs ~2x with and without native bfloat16, so the model and the
    # flags that decide it go with every JSON a benchmark writes.
    assert info["cpu_model"] and info["cpu_count"] >= 1
    assert set(info.get("cpu_bf16", [])) <= {"avx512_bf16", "amx_bf16", "avx512f"}
