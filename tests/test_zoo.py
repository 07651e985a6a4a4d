"""The zoo's training data: held out from every benchmark prompt, and the same batches from any
starting point (what makes a resumed run see exactly the batches it had not seen)."""

from itertools import islice

import pytest
import torch

from specserve.cluster.prompts import load_prompts
from specserve.cluster.zoo import batch_stream, recipe, training_conversations
from specserve.replicas.model_store import load_tokenizer_and_config

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer_and_config()[0]


def test_batches_from_any_start_are_the_continuation(tokenizer):
    batches = batch_stream(tokenizer, seq_len=64, batch=2)
    first_five = list(islice(batches(0), 5))
    assert all(ids.shape == (2, 64) and torch.equal(mask, torch.ones_like(ids)) for ids, mask in first_five)
    assert torch.equal(next(batches(3))[0], first_five[3][0])


def test_training_text_holds_out_the_benchmark_prompts():
    held_out = set(load_prompts("chat", 50)) | set(load_prompts("code", 20))
    seen = [m["content"] for messages in islice(training_conversations(), 2000) for m in messages]
    assert not held_out & set(seen)
    assert any("def " in text for text in seen), "HumanEval code is part of the mix"


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="the zoo has: smollm2-draft-2l"):
        recipe("nope")


@pytest.mark.slow
def test_train_export_and_load_a_draft(tmp_path):
    """The whole path on the real target, two steps long: train, export, load by path, draft."""
    from specserve.cluster.zoo import export, train
    from specserve.replicas.drafts.draft_lm import DraftLM
    from specserve.replicas.model_store import load_causal_lm
    from specserve.replicas.sampling import SamplingParams

    work = train("smollm2-draft-2l", steps=2, work=tmp_path / "work", head_sample_rows=200)
    assert (work / "checkpoint.pt").exists() and len((work / "train.log").read_text().splitlines()) == 2
    out = export("smollm2-draft-2l", work=work, out=tmp_path / "draft")
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    assert size_mb < 30, f"an exported draft should stay well under half the 60 MB budget, got {size_mb:.1f} MB"
    draft = load_causal_lm(str(out), dtype="float32")
    target = load_causal_lm(dtype="float32")
    assert torch.equal(draft.model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    proposal = DraftLM("d", draft.model).propose(target.tokenizer("Hello")["input_ids"], 3, SamplingParams(), None)
    assert len(proposal.tokens) == 3 and all(t in set(draft.model.config.head_token_ids) for t in proposal.tokens)
    from specserve.cluster.zoo import evaluate

    rows = evaluate([str(out)], prompts_per_category=1, max_tokens=8, window=2, dtype="float32")
    assert [r["category"] for r in rows] == ["code", "chat", "summarise", "edit"]
    for r in rows:
        assert r["draft"] == "draft" and 0 <= r["acceptance_rate"] <= 1 and r["mean_accepted_len"] >= 1
        assert 0 < r["latency_ratio"] < 1, "a 2-layer draft must cost less than the 30-layer target"
        assert r["speedup_vs_ar"] > 0
