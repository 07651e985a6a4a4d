"""A target replica over an image generator's folder (the class Serve constructs, outside Serve):
guided picture requests with the generator's draft placed inside give the plain guided decoder's
tokens; text-only features (grammars, the router) are off, not broken."""

import asyncio

import pytest
from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.imagegen import generate, load_generator
from specserve.replicas.request import Guidance, SpecRequest
from specserve.replicas.step import TreeShape
from specserve.replicas.target_deployment import TargetConfig, TargetDeployment
from tiny_models import tiny_generator_draft, tiny_generator_folder

Replica = TargetDeployment.func_or_class


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    generator = tiny_generator_folder(tmp_path_factory.mktemp("models"), grid=4)
    return generator, tiny_generator_draft(generator)   # no tokenizer: it loads without one


def picture(settings, label: int, request_id: str, **speculation) -> SpecRequest:
    return SpecRequest([settings.layout.class_token(label)], settings.tokens, request_id=request_id, grid=settings.grid,
                       guidance=Guidance((settings.layout.unconditional,), settings.cfg_scale, settings.codebook_size),
                       **speculation)


def test_a_generator_replica_serves_guided_pictures_with_its_draft(folders):
    generator, draft = folders
    replica = Replica(TargetConfig(str(generator), dtype="float32", max_batch=4), policy=PolicyByRequest("static"),
                      drafts={"draft": {"model": str(draft)}})
    assert replica.tokenizer is None and replica.routing is None and replica.generator.grid == 4
    model, settings, _ = load_generator(generator)
    expected = generate(model, settings.layout, [1, 4], settings.tokens, cfg_scale=settings.cfg_scale)

    async def one(request):
        return [t async for item in replica.generate(request) for t in item.token_ids]

    async def scenario():
        return await asyncio.gather(one(picture(settings, 1, "a", draft="draft", window=3, pinned=True)),
                                    one(picture(settings, 4, "b", draft="draft", tree=TreeShape(3, 2, 6), pinned=True)))

    got = asyncio.run(scenario())
    assert got == expected.tolist()
    stats = asyncio.run(replica.load())
    assert stats["running"] == 0
    with pytest.raises(ValueError, match="structured output"):
        replica.scheduler.add(SpecRequest([1], 4, grammar='start: "a"', request_id="g"))
