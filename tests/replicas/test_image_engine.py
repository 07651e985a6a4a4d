"""The image engine: guided, grid-aware picture requests through the batched engine with the
generator's draft, greedy output equal to the plain guided decoder's under every tree policy."""

import pytest
from specserve.policies.registry import build_policy
from specserve.replicas.image_engine import GENERATOR_DRAFT, ImageEngine
from specserve.replicas.imagegen import generate
from specserve.replicas.request import NO_DRAFT
from specserve.replicas.step import TreeShape
from tiny_models import tiny_generator_draft, tiny_generator_folder


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tiny_generator_folder(tmp_path_factory.mktemp("models"), grid=4)
    return ImageEngine(folder, tiny_generator_draft(folder), slots=8)


@pytest.mark.parametrize("policy", ["static-tree", "adt-tree", "adt-tree-vertical", "adt-tree-random", "sage",
                                    "eagle2-depth"])
def test_every_tree_policy_keeps_the_generators_greedy_pictures(engine, policy):
    labels = [0, 3, 5]
    expected = generate(engine.model, engine.settings.layout, labels, engine.settings.tokens,
                        cfg_scale=engine.settings.cfg_scale)
    requests = [engine.request(label, f"p{i}", GENERATOR_DRAFT, tree=TreeShape(3, 2, 6), temperature=0.0,
                               pinned=False) for i, label in enumerate(labels)]
    assert all(r.grid == 4 and r.guidance is not None for r in requests)
    gens = engine.generate(requests, policy=build_policy(policy))
    assert [g.token_ids for g in gens] == expected.tolist()
    assert sum(g.stats.accepted for g in gens) > 0
    pictures = engine.pictures(gens)
    assert len(pictures) == 3 and pictures[0].size == (16, 16)


def test_a_picture_without_a_draft_is_plain_guided_decoding(engine):
    gen = engine.generate([engine.request(2, "plain", NO_DRAFT, temperature=0.0)])[0]
    assert gen.token_ids == generate(engine.model, engine.settings.layout, [2], engine.settings.tokens,
                                     cfg_scale=engine.settings.cfg_scale)[0].tolist()
    assert gen.stats.accepted == 0
