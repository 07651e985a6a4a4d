"""The self-distilled answers' plan: held-out first turns, later turns with context, code."""

import pytest

from specserve.training import answers
from specserve.training.answers import planned_prompts


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
