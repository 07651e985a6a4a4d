"""The pruned-head draft: full-vocabulary logits with -inf outside the head, saved and loaded like
any model, and lossless as a draft (greedy equality against a tiny target)."""

import torch

from equality import assert_greedy_equal
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.pruned_head import PrunedHeadConfig, PrunedHeadLlamaForCausalLM
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.engine import speculative_generate
from tiny_models import VOCAB, tiny_model

HEAD = list(range(0, VOCAB, 2))   # every other token: the draft can never propose an odd one


def pruned_draft(seed: int = 1) -> PrunedHeadLlamaForCausalLM:
    torch.manual_seed(seed)
    config = PrunedHeadConfig(head_token_ids=HEAD, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512)
    return PrunedHeadLlamaForCausalLM(config).eval()


def test_logits_live_on_the_head_only():
    model = pruned_draft()
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, VOCAB)
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., ::2]).all()
    last = model(input_ids=torch.tensor([[1, 2, 3]]), logits_to_keep=1).logits[0, -1]
    assert torch.allclose(last, logits[0, -1], atol=1e-6)   # one row or three: only round-off differs


def test_saved_and_loaded_by_the_auto_classes(tmp_path):
    # load_causal_lm loads models with AutoModelForCausalLM; importing the model store registers
    # the architecture (tiny test models have no tokenizer, so the Auto class is called directly).
    import specserve.replicas.model_store  # noqa: F401
    from transformers import AutoModelForCausalLM

    model = pruned_draft()
    model.save_pretrained(tmp_path / "pruned")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", local_files_only=True).eval()
    assert isinstance(again, PrunedHeadLlamaForCausalLM) and again.config.head_token_ids == HEAD
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.allclose(again(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_greedy_equality_with_a_pruned_head_draft():
    target_model = tiny_model("llama", seed=0)
    draft = DraftLM("pruned", pruned_draft())
    greedy = SamplingParams()
    for prompt in ([1, 2, 3], [10, 20, 30, 40, 50], [7] * 9):
        assert all(t % 2 == 0 for t in draft.propose(prompt, 6, greedy, None).tokens), "proposed outside the head"
        want = speculative_generate(Target(target_model), None, prompt, 24, greedy).token_ids
        for window, tree in ((3, None), (0, TreeShape(3, 2, 6))):
            got = speculative_generate(Target(target_model), draft, prompt, 24, greedy, window=window, tree=tree)
            assert_greedy_equal(target_model, prompt, got.token_ids, want, f"pruned head, window={window} tree={tree}")


def save_with_target(tmp_path, frozen_head: bool):
    """A tiny target saved to ``tmp_path/target`` and a pruned draft sharing its embeddings (and,
    if ``frozen_head``, its output rows, frozen as zoo training keeps them) saved to ``tmp_path/draft``;
    returns (target, draft, the draft loaded back with what it takes from the target)."""
    import specserve.replicas.model_store  # noqa: F401 - registers the architecture
    from transformers import AutoModelForCausalLM

    from specserve.replicas.drafts.pruned_head import attach_from_target, save_without_embeddings

    target = tiny_model("llama", seed=0)
    target.save_pretrained(tmp_path / "target")
    draft = pruned_draft()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if frozen_head:
            draft.lm_head.weight.copy_(target.lm_head.weight[draft.head_token_ids(torch.device("cpu"))])
    draft.lm_head.weight.requires_grad_(not frozen_head)
    save_without_embeddings(draft, tmp_path / "draft", embeddings_from=str(tmp_path / "target"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", local_files_only=True, dtype=torch.float32)
    attach_from_target(loaded, tmp_path / "target")
    return target, draft, loaded.to(draft.device)


def test_saved_without_embeddings_and_attached_from_the_target(tmp_path):
    target, draft, loaded = save_with_target(tmp_path, frozen_head=False)
    assert loaded.config.embeddings_from == str(tmp_path / "target")
    assert torch.equal(loaded.model.embed_tokens.weight.cpu(), target.model.embed_tokens.weight.cpu())
    ids = torch.tensor([[5, 6, 7, 8]], device=draft.device)
    # Everything but the embeddings went through float16: close, not equal.
    assert torch.allclose(loaded(input_ids=ids).logits, draft(input_ids=ids).logits, atol=2e-2)


def test_a_frozen_head_is_not_stored_but_taken_from_the_target(tmp_path):
    from safetensors import safe_open

    _, draft, loaded = save_with_target(tmp_path, frozen_head=True)
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), framework="pt") as stored:
        assert "lm_head.weight" not in stored.keys() and "model.embed_tokens.weight" not in stored.keys()
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
