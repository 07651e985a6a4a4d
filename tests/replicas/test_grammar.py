"""Structured output on the reference target: drafted tokens the grammar forbids never reach the
verify, speculative output under a grammar is plain decoding's under it (greedy: the same tokens;
sampled: the same distribution), and outputs under JSON schemas parse and validate."""

import json

import jsonschema
import llguidance
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chi_square import chi_square_pvalue
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.grammar import GrammarState, grammar_tokenizer
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm
from specserve.replicas.prompt_ids import encode_chat
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams, logits_to_probs
from specserve.replicas.step import Proposal, TreeShape
from specserve.replicas.target import Target

pytestmark = pytest.mark.reference
Lark = llguidance.LLMatcher.grammar_from_lark
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def reference():
    loaded = load_causal_lm(REFERENCE_TARGET, dtype="float32")
    eos = tuple(sorted(loaded.eos_token_ids))
    return loaded, (lambda: grammar_tokenizer(loaded.tokenizer, loaded.model.config.vocab_size, eos))


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_drafted_tokens_the_grammar_forbids_end_the_chain_and_prune_the_tree(reference):
    loaded, tokenizer = reference
    grammar = GrammarState(Lark('start: "yes, indeed" | "no"'), tokenizer())
    yes, comma, bad = ids(loaded, "yes"), ids(loaded, ","), ids(loaded, " maybe")
    chain = grammar.admit(Proposal.chain(yes + comma + bad + comma))
    assert chain.tokens == yes + comma
    assert grammar.mask(torch.zeros(len(chain) + 1, loaded.model.config.vocab_size)).isfinite().sum(-1).tolist()[1] >= 1
    # A tree: the root's children "yes" (kept) and " maybe" (pruned, with its child).
    tree = Proposal(yes + bad + comma + comma, [-1, -1, 0, 1])
    kept = grammar.admit(tree)
    assert (kept.tokens, kept.parents) == (yes + comma, [-1, 0])
    rows = grammar.mask(torch.zeros(len(kept) + 1, loaded.model.config.vocab_size))
    assert bool(rows[0, yes[0]].isfinite()) and not bool(rows[0, bad[0]].isfinite())


def test_the_matcher_follows_the_output_through_any_proposals_and_rollbacks(reference):
    """Random chains and trees around a valid output (its tokens, others, the EOS), each admitted,
    then the longest valid prefix emitted: the matcher stays on the output and row 0 always
    admits its next token. (An EOS consumed in a complete grammar is no rollback step in
    llguidance: a rollback counting it lost the token before.)"""
    import random

    loaded, tokenizer = reference
    eos = min(loaded.eos_token_ids)
    true = ids(loaded, json.dumps({"name": "John Smith", "age": 45, "city": "Paris"})) + [eos]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    rng = random.Random(0)
    for _ in range(100):
        state, at = GrammarState(grammar, tokenizer(), ends=frozenset(loaded.eos_token_ids)), 0
        while at < len(true):
            k = rng.randint(0, 5)
            tokens = [true[at + i] if at + i < len(true) and rng.random() < 0.7 else rng.choice(true) for i in range(k)]
            tree = k >= 2 and rng.random() < 0.3
            kept = state.admit(Proposal(tokens, [-1] + [rng.randint(-1, i - 1) for i in range(1, k)]) if tree
                               else Proposal.chain(tokens))
            rows = state.mask(torch.zeros(len(kept) + 1, loaded.model.config.vocab_size))
            assert bool(rows[0, true[at]].isfinite())
            n = 0
            while kept.is_chain and n < len(kept) and at + n < len(true) and kept.tokens[n] == true[at + n]:
                n += 1
            state.advance(true[at:at + n + 1])
            at += n + 1


def plain_under_grammar(loaded, tokenizer, prompt: list[int], grammar: str, max_tokens: int) -> list[int]:
    """Greedy decoding with the grammar's mask, the whole prefix through the model for every token."""
    import llguidance.torch   # a submodule: imported by the grammar's first mask, not before

    matcher = llguidance.LLMatcher(tokenizer, grammar)
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens:
            logits = loaded.model(torch.tensor([prompt + out])).logits[0, -1:].float().clone()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            llguidance.torch.apply_token_bitmask_inplace(logits, mask)
            token = int(logits.argmax())
            out.append(token)
            if token in loaded.eos_token_ids:
                break
            assert matcher.consume_token(token)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("grammar_draft", [True, False], ids=["grammar-draft", "draft-only"])
@pytest.mark.parametrize("speculation", [dict(window=4), dict(tree=TreeShape(3, 2, 6)), dict(draft="none")],
                         ids=["chain", "tree", "plain"])
def test_greedy_output_under_a_grammar_is_plain_decodings(reference, speculation, grammar_draft):
    loaded, tokenizer = reference
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Describe a person as JSON: name, age, city."}])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    expected = plain_under_grammar(loaded, tokenizer(), prompt, grammar, 48)
    got = run_batch(Target(loaded.model), {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())},
                    [SpecRequest(prompt, 48, draft=speculation.get("draft", "prompt-lookup"),
                                 window=speculation.get("window", 0), tree=speculation.get("tree"), grammar=grammar,
                                 grammar_draft=None if grammar_draft else False)],   # the request overrides the replica
                    loaded.eos_token_ids, grammar_tokenizer=tokenizer, grammar_draft=True)[0]
    assert got.token_ids == expected
    # The schema's keys are forced (name, age, city): proposed by the grammar and accepted.
    assert (got.stats.forced_accepted >= 2) if grammar_draft else got.stats.forced == 0
    jsonschema.validate(json.loads(loaded.tokenizer.decode(got.token_ids, skip_special_tokens=True)), PERSON)


FIELD_TYPES = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                               {"type": "string", "enum": ["red", "green", "blue"]},
                               {"type": "array", "items": {"type": "integer"}, "maxItems": 3}])
SCHEMAS = st.dictionaries(st.sampled_from(["id", "title", "ok", "tags", "colour", "count"]), FIELD_TYPES,
                          min_size=1, max_size=3).map(lambda props: {
                              "type": "object", "properties": props, "required": sorted(props),
                              "additionalProperties": False})


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_outputs_under_json_schemas_parse_and_validate(reference, schema):
    loaded, tokenizer = reference
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Give one example record as JSON."}])
    gen = run_batch(Target(loaded.model), {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())},
                    [SpecRequest(prompt, 96, draft="prompt-lookup", window=4,
                                 grammar=llguidance.LLMatcher.grammar_from_json_schema(schema))],
                    loaded.eos_token_ids, grammar_tokenizer=tokenizer)[0]
    if gen.finish_reason == "stop":   # a string the model would not close in 96 tokens is cut, not wrong
        jsonschema.validate(json.loads(loaded.tokenizer.decode(gen.token_ids, skip_special_tokens=True)), schema)


@pytest.mark.slow
def test_sampled_tokens_under_a_grammar_follow_the_masked_distribution(reference):
    """Two tokens under the regex ``[0-9]{2}`` (each a digit; SmolLM2's digits are single tokens),
    drafted by prompt lookup from a prompt full of digit pairs: the pair's frequencies against
    P(t1) P(t2 | t1) of the masked, warped target."""
    loaded, tokenizer = reference
    digits = [ids(loaded, str(d))[0] for d in range(10)]
    prompt = ids(loaded, "Pick a number: 42 17 42 17 42 93 42 1")
    grammar = llguidance.LLMatcher.grammar_from_regex("[0-9]{2}")
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        first = loaded.model(torch.tensor([prompt])).logits[0, -1].float()
        second = loaded.model(torch.tensor([prompt + [d] for d in digits])).logits[:, -1].float()

    def masked(row):
        out = torch.full_like(row, float("-inf"))
        out[digits] = row[digits]
        return logits_to_probs(out, params)[digits]

    expected = masked(first)[:, None] * torch.stack([masked(second[i]) for i in range(10)])
    runs = 1200
    requests = [SpecRequest(prompt, 2, SamplingParams(temperature=1.0, seed=s), "prompt-lookup", 2, None, f"s{s}",
                            grammar=grammar) for s in range(runs)]
    gens = run_batch(Target(loaded.model, slots=16), {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())},
                     requests, loaded.eos_token_ids, grammar_tokenizer=tokenizer)
    counts = torch.zeros(10, 10)
    for gen in gens:
        counts[digits.index(gen.token_ids[0]), digits.index(gen.token_ids[1])] += 1
    assert chi_square_pvalue(counts, expected) > 1e-3
    assert sum(g.stats.accepted for g in gens) > runs // 20
