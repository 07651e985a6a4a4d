"""Greedy equality on the reference target (SmolLM2-135M-Instruct, float32) over 20 prompts:
prompt lookup with window 8 and with a tree (on the ten where it drafts; the tiny-model tests take
every window 1..8), a real-weights draft LM (the target's first layers, untrained as a draft, so it
is rejected often, which is what this test wants), and every draft the package's zoo ships."""

import pytest
import torch

from equality import assert_greedy_equal
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.model_store import load_causal_lm, zoo_dir, zoo_drafts
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.engine import SpecEngine
from specserve.replicas.engine import speculative_generate

pytestmark = [pytest.mark.reference, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise in one sentence: The quick brown fox jumps over the lazy dog. The dog did not react.",
    "List three colours of the rainbow.",
    "Explain what a KV cache is in a transformer.",
    "Rewrite this code with clearer names: def f(a, b): return [x for x in a if x in b]",
    "Translate 'good morning' into Spanish.",
    "Give me a haiku about autumn leaves.",
    "What does HTTP stand for?",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"",
    "Repeat after me: the rain in Spain stays mainly in the plain.",
    "How many legs does a spider have?",
    "Write a SQL query that counts rows in a table named users.",
    "Name two planets of the solar system.",
    "Explain recursion to a child.",
    "What is 12 times 12?",
    "Write a short email declining a meeting invitation.",
    "Summarise: Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Give one tip for writing clean code.",
    "Complete the list: Monday, Tuesday, Wednesday,",
]
NEW_TOKENS = 32
GREEDY = SamplingParams()
# The prompts whose answers repeat the prompt or themselves most: where prompt lookup drafts, and
# so where its chains and trees are verified (on the others it proposes next to nothing).
LOOKUP = (0, 2, 5, 6, 7, 9, 10, 15, 17, 19)


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(engine, prompt_ids):
    target = Target(engine.loaded.model)
    return [speculative_generate(target, None, ids, NEW_TOKENS, GREEDY).token_ids for ids in prompt_ids]


def test_target_only_equals_hf_generate(engine, prompt_ids, expected):
    # Our decode loop must be the target's own greedy decoding, not merely self-consistent.
    model = engine.loaded.model
    for ids, exp in list(zip(prompt_ids, expected))[:5]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
        # HF stops at EOS; our reference runs without EOS so that it always has NEW_TOKENS.
        assert_greedy_equal(model, ids, exp[: len(out)], out, "target-only vs HF generate")
        assert len(out) == NEW_TOKENS or out[-1] in engine.loaded.eos_token_ids


# One window on the reference target (the tiny models take every window 1..8; the zoo drafts'
# test below runs chains of 3 and trees on it too).
@pytest.mark.parametrize("window", [8])
def test_prompt_lookup_chain(engine, prompt_ids, expected, window):
    target = Target(engine.loaded.model)
    draft = engine.drafts["prompt-lookup"]
    accepted = 0
    for ids, exp in ((prompt_ids[i], expected[i]) for i in LOOKUP):
        gen = speculative_generate(target, draft, ids, NEW_TOKENS, GREEDY, window=window)
        assert_greedy_equal(engine.loaded.model, ids, gen.token_ids, exp, f"prompt-lookup γ={window}")
        accepted += gen.stats.accepted
    assert accepted > 0, "no draft token was ever accepted: the test would prove nothing"


@pytest.mark.parametrize("shape", [TreeShape(6, 2, 16)], ids=str)
def test_prompt_lookup_tree(engine, prompt_ids, expected, shape):
    target = Target(engine.loaded.model)
    draft = engine.drafts["prompt-lookup"]
    accepted = 0
    for ids, exp in ((prompt_ids[i], expected[i]) for i in LOOKUP):
        gen = speculative_generate(target, draft, ids, NEW_TOKENS, GREEDY, tree=shape)
        assert_greedy_equal(engine.loaded.model, ids, gen.token_ids, exp, f"prompt-lookup {shape}")
        accepted += gen.stats.accepted
    assert accepted > 0, "no draft token was ever accepted: the test would prove nothing"


def test_real_weights_draft_lm_chain_and_tree(engine, prompt_ids, expected):
    """A draft built from the target's first 6 layers (shared embeddings and head)."""
    full = engine.loaded.model
    config = full.config.__class__.from_dict({**full.config.to_dict(), "num_hidden_layers": 6})
    small = type(full)(config).eval()
    small.load_state_dict(full.state_dict(), strict=False)
    draft = DraftLM("first-6-layers", small)
    target = Target(full)
    for i, (ids, exp) in enumerate(list(zip(prompt_ids, expected))[:6]):
        if i % 2:
            gen = speculative_generate(target, draft, ids, NEW_TOKENS, GREEDY, window=3)
        else:
            gen = speculative_generate(target, draft, ids, NEW_TOKENS, GREEDY, tree=TreeShape(3, 2, 6))
        assert_greedy_equal(full, ids, gen.token_ids, exp, f"first-6-layers draft, prompt {i}")


@pytest.mark.parametrize("name", zoo_drafts())
def test_shipped_zoo_draft_chain_and_tree(engine, prompt_ids, expected, name):
    """A committed draft loads (embeddings and frozen head from the target) and stays lossless;
    an HSR head gets the target's hidden states in-process."""
    draft = draft_from_model(name, load_causal_lm(str(zoo_dir() / name), dtype="float32").model)
    target = Target(engine.loaded.model)
    accepted = 0
    for i, (ids, exp) in enumerate(list(zip(prompt_ids, expected))[:6]):
        ask = {"window": 3} if i % 2 else {"tree": TreeShape(4, 2, 8)}
        gen = speculative_generate(target, draft, ids, NEW_TOKENS, GREEDY, **ask)
        assert_greedy_equal(engine.loaded.model, ids, gen.token_ids, exp, f"{name} {ask}, prompt {i}")
        accepted += gen.stats.accepted
    assert accepted > 6 * NEW_TOKENS // 4, f"a trained draft should be accepted often, got {accepted} tokens"
