"""The self-distilled answers: planned from held-out prompts, stored as ids, read back whole."""

import pytest

from specserve.training import answers
from specserve.training.answers import Answer, load_answers, load_chunk, planned_prompts, save_chunk


def test_a_chunk_reads_back_exactly_what_was_saved(tmp_path):
    saved = [Answer("chat", 3, [1, 2, 3, 9, 8]), Answer("turn", 5, [4, 4, 4, 4, 4, 7]), Answer("code", 1, [0, 65535])]
    save_chunk(tmp_path / "answers-00000.npz", saved)
    save_chunk(tmp_path / "answers-00001.npz", saved[:1])
    assert load_chunk(tmp_path / "answers-00000.npz") == saved
    assert load_answers(tmp_path) == saved + saved[:1]
    assert not list(tmp_path.glob("*.partial*"))


@pytest.mark.reference
def test_the_plan_holds_first_turns_later_turns_with_context_and_code():
    from transformers import AutoTokenizer

    from specserve.replicas.model_store import REFERENCE_TARGET, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(REFERENCE_TARGET), local_files_only=True)
    plan = planned_prompts(tokenizer, 120)
    kinds = [kind for kind, _ in plan]
    assert {"chat", "turn", "code"} <= set(kinds)
    assert all(len(ids) <= answers.CONTEXT_TOKENS for _, ids in plan)
    # A later turn carries the conversation before it: several user turns in one prompt.
    user = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    turn = next(ids for kind, ids in plan if kind == "turn")
    assert sum(turn[i:i + len(user)] == user for i in range(len(turn))) >= 2
    # Code is spread through the plan, not left to the end.
    assert kinds.index("code") < len(kinds) // 2
    assert planned_prompts(tokenizer, 120) == plan   # a fixed order: a build resumes where it stopped
