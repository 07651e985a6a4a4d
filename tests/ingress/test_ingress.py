"""The ingress's continuation of a request whose target replica failed (the live kill tests are in
test_faults.py)."""

from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import SpecRequest
from specserve.ingress.deployment import Ingress as IngressDeployment

Ingress = IngressDeployment.func_or_class   # the class behind the Serve deployment


def test_a_continuation_is_the_prompt_plus_what_was_produced_with_the_tokens_left():
    original = SpecRequest([1, 2, 3], 10, SamplingParams(), "prompt-lookup", 4, request_id="abc", pinned=True)
    rest = Ingress._continuation(original, [7, 8, 9], attempt=1)
    assert rest.prompt_ids == [1, 2, 3, 7, 8, 9] and rest.max_tokens == 7
    assert (rest.draft, rest.window, rest.pinned, rest.params) == ("prompt-lookup", 4, True, original.params)
    assert rest.request_id == "abc-r1"
    assert original.prompt_ids == [1, 2, 3] and original.max_tokens == 10   # the original is kept as it was


def test_a_seeded_continuation_draws_from_a_new_seed_derived_from_the_requests():
    original = SpecRequest([1], 10, SamplingParams(temperature=1.0, seed=42), request_id="s")
    first, second = (Ingress._continuation(original, [5], attempt=a) for a in (1, 2))
    assert len({original.params.seed, first.params.seed, second.params.seed}) == 3
    assert first.params.seed == Ingress._continuation(original, [5], attempt=1).params.seed   # repeatable
    assert 0 <= first.params.seed < 2**63 and first.params.temperature == 1.0
