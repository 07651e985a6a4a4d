"""Low-rank adapters: a fresh adapter changes nothing, the trained one folds into the weights
(what serving loads) with the same output as the hooked layers, and a bad set is refused."""

import pytest
import torch
from specserve.replicas.vlm import merge_text_lora
from specserve.training.lora import ADAPTED, add_lora, lora_tensors

from tests.tiny_models import VOCAB, tiny_llava


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_fresh_adapter_changes_nothing_and_a_trained_one_folds_into_the_weights():
    hooked, merged = tiny_llava(seed=0).cpu(), tiny_llava(seed=0).cpu()
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(hooked, ids)
    learned = add_lora(hooked.model.language_model, rank=4, alpha=8.0)
    assert len(learned) == 2 * len(ADAPTED) * hooked.config.text_config.num_hidden_layers
    assert torch.equal(_logits(hooked, ids), before)   # B starts at zero

    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in learned:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    after = _logits(hooked, ids)
    assert (after - before).abs().max() > 1e-2   # the adapters do act

    tensors = lora_tensors(hooked.model.language_model.state_dict())
    assert set(tensors) == {f"layers.{i}.{part}.{name}.lora_{m}" for i in range(2) for m in "AB"
                            for part, names in (("self_attn", ADAPTED[:4]), ("mlp", ADAPTED[4:])) for name in names}
    merge_text_lora(merged, tensors, rank=4, alpha=8.0)
    torch.testing.assert_close(_logits(merged, ids), after, rtol=1e-4, atol=1e-4)


def test_a_set_that_does_not_fit_the_language_model_is_refused():
    model = tiny_llava(seed=0).cpu()
    hooked = tiny_llava(seed=0).cpu()
    add_lora(hooked.model.language_model, rank=4, alpha=8.0)
    good = lora_tensors(hooked.model.language_model.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    a_name = "layers.0.self_attn.q_proj.lora_A"
    for bad, match in (({k: v for k, v in good.items() if k != a_name}, "pairs"),
                       ({**good, "layers.9.self_attn.q_proj.lora_A": good[a_name],
                         "layers.9.self_attn.q_proj.lora_B": good[a_name.replace("_A", "_B")]}, "does not have"),
                       ({**good, a_name: good[a_name][:2]}, "does not fit"),
                       ({}, "pairs")):
        with pytest.raises(ValueError, match=match):
            merge_text_lora(model, bad, rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="does not fit"):
        merge_text_lora(model, good, rank=2, alpha=8.0)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        add_lora(model.model.language_model, rank=0, alpha=8.0)
    for name, weight in model.state_dict().items():   # a refused set changed nothing
        assert torch.equal(weight, weights[name]), name
