"""The log-probabilities a request asks for are a plain forward's log-softmax of the same prefix,
whichever draft proposed the tokens, for the output (from the verify) and the prompt (from the
prefill, a cached prefix and chunking included)."""

import pytest
import torch

from device_reads import reads
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.logprobs import token_logprobs
from specserve.replicas.request import SpecRequest, StreamItem
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TokenLogprob, TreeShape
from specserve.replicas.target import Target
from tiny_models import perturbed, tiny_model

PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i the log-softmax after ids[:i + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def assert_logprobs_match(model, prompt: list[int], out: list[int], got: list[TokenLogprob], top: int) -> None:
    rows = plain_logprobs(model, prompt + out)[len(prompt) - 1:-1]   # the rows that predicted out
    assert len(got) == len(out)
    for i, (token, lp) in enumerate(zip(out, got)):
        assert lp.logprob == pytest.approx(float(rows[i, token]), abs=1e-4), f"token {i}"
        values, ids = rows[i].topk(top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculation", [dict(draft="prompt-lookup", window=4),
                                         dict(draft="near", window=3),
                                         dict(draft="near", tree=TreeShape(3, 2, 6)),
                                         dict(draft="none")], ids=["lookup", "chain", "tree", "plain"])
def test_output_logprobs_are_the_plain_forwards(target, speculation, params):
    drafts = {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft()),
              "near": in_process_server("near", DraftLM("near", perturbed(target, seed=1)))}
    request = SpecRequest(PROMPT, 24, params, speculation["draft"], speculation.get("window", 0),
                          speculation.get("tree"), "r", logprobs=3)
    gen = run_batch(Target(target, slots=2), drafts, [request])[0]
    assert_logprobs_match(target, PROMPT, gen.token_ids, gen.logprobs, 3)
    if speculation["draft"] == "near" or (speculation["draft"] != "none" and params.greedy):
        assert gen.stats.accepted > 0   # tokens drafted and accepted got their logprobs too


def test_requests_sharing_a_verify_each_get_their_own_logprobs(target):
    """A verify reads every request's log-probabilities at once: each still gets its own tokens'
    values and as many alternatives as it asked for (none, one or five)."""
    drafts = {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())}
    prompts = [PROMPT, PROMPT[3:] + [12, 13], [20, 21, 22, 20, 21]]
    requests = [SpecRequest(prompt, 12, SamplingParams(), "prompt-lookup", 3, None, f"r{top}", logprobs=top)
                for prompt, top in zip(prompts, (0, 1, 5))]
    gens = run_batch(Target(target, slots=3), drafts, requests)
    for prompt, gen, top in zip(prompts, gens, (0, 1, 5)):
        assert_logprobs_match(target, prompt, gen.token_ids, gen.logprobs, top)
        assert all(len(lp.top) == top for lp in gen.logprobs)


def test_prompt_logprobs_are_the_plain_forwards_through_chunks_and_a_cached_prefix(target):
    longer = PROMPT + [12, 13, 14, 5, 6, 7]
    rows = plain_logprobs(target, longer)
    first = SpecRequest(PROMPT, 4, request_id="a")   # leaves PROMPT's KV in the slot as a prefix cache
    echo = SpecRequest(longer, 4, request_id="b", logprobs=0, prompt_logprobs=2)
    gens = run_batch(Target(target, slots=1), {}, [first, echo], prefill_chunk=5)
    got = gens[1].prompt_logprobs
    assert len(got) == len(longer) and got[0] is None
    for i in range(1, len(longer)):
        assert got[i].logprob == pytest.approx(float(rows[i - 1, longer[i]]), abs=1e-4)
        assert [t for t, _ in got[i].top] == rows[i - 1].topk(2).indices.tolist()
    assert gens[0].prompt_logprobs is None and gens[0].logprobs is None


@pytest.mark.parametrize("top", [0, 1, 5])
def test_token_logprobs_are_the_rows_log_softmax_exactly(top):
    """Read back in one piece, every value is the float32 log-softmax's own, each alternative's id
    its own."""
    rows = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 4
    tokens = [7, 299, 0, 7]
    got = token_logprobs(rows, tokens, top)
    logp = torch.log_softmax(rows, -1)
    assert [lp.logprob for lp in got] == [logp[i, t].item() for i, t in enumerate(tokens)]
    values, ids = logp.topk(top, -1)
    assert [list(lp.top) for lp in got] == [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    assert all(isinstance(t, int) for lp in got for t, _ in lp.top)
    assert token_logprobs(rows[:0], [], top) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a read from the device is seen on CUDA only")
def test_token_logprobs_wait_for_the_device_once():
    rows = torch.randn(6, 1000, device="cuda")
    got, waits = reads(lambda: token_logprobs(rows, [1, 2, 3, 4, 5, 6], 3), "cuda")
    assert waits == 1
    assert len(got) == 6 and all(len(lp.top) == 3 for lp in got)


def test_items_joined_keep_their_logprobs_in_order():
    a = StreamItem([1, 2], logprobs=[TokenLogprob(-1.0), TokenLogprob(-2.0)], prompt_logprobs=[None, TokenLogprob(-0.5)])
    b = StreamItem([3], "stop", logprobs=[TokenLogprob(-3.0)])
    joined = a.then(b)
    assert joined.token_ids == [1, 2, 3] and joined.finish_reason == "stop"
    assert [lp.logprob for lp in joined.logprobs] == [-1.0, -2.0, -3.0]
    assert joined.prompt_logprobs == a.prompt_logprobs
    assert StreamItem([1]).then(StreamItem([2])).logprobs is None
