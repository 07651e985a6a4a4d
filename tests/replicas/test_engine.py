"""The in-process engine on the reference target: chat rendering, clear errors, cache reset."""

import pytest

from specserve.replicas.engine import GenerateRequest, SpecEngine

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(dtype="float32")


def test_prompts_are_rendered_with_the_chat_template(engine):
    ids = engine.encode("Hello there")
    text = engine.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert engine.encode("Hello there", chat=False) == engine.tokenizer("Hello there")["input_ids"]


def test_empty_prompt_and_unknown_draft_are_clear_errors(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.encode("  ")
    with pytest.raises(ValueError, match="unknown draft 'nope'; available: none, prompt-lookup"):
        engine.generate(GenerateRequest("hi", draft="nope"))


def test_prompt_longer_than_the_context_is_refused_before_any_forward(engine):
    too_long = [1] * engine.max_context
    with pytest.raises(ValueError, match="exceeds the target's context"):
        engine.generate_ids(too_long, GenerateRequest("", max_tokens=8))
    assert all(tokens == [] for tokens in engine.target.kv.tokens)


def test_generate_reports_usage_and_reset_forgets_caches(engine):
    out = engine.generate(GenerateRequest("Count to three.", max_tokens=6, window=3))
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 6
    assert any(engine.target.kv.tokens)
    engine.reset_caches()
    assert all(tokens == [] for tokens in engine.target.kv.tokens)


def test_a_seeded_suffix_draft_drafts_the_answer_it_was_seeded_with_and_stays_exact(engine, tmp_path):
    from specserve.data.answers import Answer, save_chunk

    ids = engine.encode("Name three colours of the rainbow.")
    plain = engine.generate_ids(ids, GenerateRequest("", 24, "none", 0))
    save_chunk(tmp_path / "answers-00000.npz", [Answer("chat", len(ids), ids + plain.token_ids)])
    seeded = SpecEngine.load(dtype="float32", suffix_seed=tmp_path)
    assert "suffix" in seeded.drafts
    got = seeded.generate_ids(ids, GenerateRequest("", 24, "suffix", 4))
    assert got.token_ids == plain.token_ids and got.stats.mean_accepted_len > 3.0
