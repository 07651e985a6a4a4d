"""Our Llama-family forward computes what Hugging Face computes, over the slot cache.

Float32 tiny models: the maths must agree with Hugging Face's to float32 rounding (the attention
is ordered differently, so not bit for bit); bfloat16 packed products must agree bit for bit
with ``F.linear``, since packing only changes the weight's memory layout.
"""

import pytest
import torch
import torch.nn.functional as F

from specserve.replicas.model import int8_linear, llama_forward
from specserve.replicas.model.batch_kv import BatchKV, Feed
from specserve.replicas.target import feature_tap
from tiny_models import DEVICE, rounded_to_int8_rows, tiny_model

PREFIX = [5, 17, 3, 42, 8, 8, 61, 2, 30, 11]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: q/k/v biases
def test_chain_and_tree_feeds_match_hugging_face(arch):
    model = tiny_model(arch, seed=7, layers=3)
    kv = BatchKV(model, slots=3)
    assert kv._fast is not None, f"{arch} should take our forward"
    kv.forward([Feed(0, PREFIX), Feed(2, PREFIX[:4])])
    # Slot 0: a chain of 3 after its prefix; slot 2: a tree (two children of the root, one grandchild).
    chain = [9, 4, 77]
    tree, parents = [20, 21, 22], [-1, -1, 0]
    got = kv.forward([Feed(0, chain, 3), Feed(2, tree, 3, parents)])
    want_chain = hf_logits(model, PREFIX + chain)[-3:]
    torch.testing.assert_close(got[0], want_chain, rtol=0, atol=1e-4)
    # Each tree node sees the cached prefix and its own ancestors only.
    for node, path in ((0, [20]), (1, [21]), (2, [20, 22])):
        want = hf_logits(model, PREFIX[:4] + path)[-1]
        torch.testing.assert_close(got[1][node], want, rtol=0, atol=1e-4)


def test_a_ragged_step_feeds_each_request_only_its_own_tokens_and_matches_hugging_face():
    """One feed of 1 token, one chain of 5, one tree of 4 in one forward: on the CPU the step is
    flat (no feed is padded to the longest), and every feed's logits are Hugging Face's."""
    model = tiny_model("llama", seed=9, layers=3)
    kv = BatchKV(model, slots=4)
    flat = kv.device.type == "cpu"   # an accelerator pads the feeds instead
    with torch.inference_mode():   # as BatchKV.forward runs
        assert kv._fast.flat_usable(5, kv.device, kv._dtype) == flat
    kv.forward([Feed(0, PREFIX), Feed(1, PREFIX[:6]), Feed(3, PREFIX[:3])])
    tree, parents = [20, 21, 22, 23], [-1, 0, 0, 1]
    got = kv.forward([Feed(3, tree, 4, parents), Feed(0, [9]), Feed(1, [4, 77, 5, 6, 1], 5)])
    if flat:
        assert [start for _, start, _ in kv._fed_rows] == [0, 4, 5]   # one after another
    torch.testing.assert_close(got[1], hf_logits(model, PREFIX + [9])[-1:], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[2], hf_logits(model, PREFIX[:6] + [4, 77, 5, 6, 1])[-5:], rtol=0, atol=1e-4)
    for node, path in ((0, [20]), (1, [20, 21]), (2, [20, 22]), (3, [20, 21, 23])):
        torch.testing.assert_close(got[0][node], hf_logits(model, PREFIX[:3] + path)[-1], rtol=0, atol=1e-4)
    assert kv.tokens[0] == PREFIX + [9] and len(kv.tokens[3]) == 3 + 4


def test_long_feeds_attend_in_blocks_of_query_rows_that_read_only_the_keys_they_see(monkeypatch):
    """A prefill chunk's attention (longer than a flat feed) runs in blocks of query rows (their scores fit in the CPU's
    caches), each over the keys up to the last one its rows may see; the logits are Hugging
    Face's, with a cached prefix or without."""
    model = tiny_model("llama", seed=5, layers=2)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(80)]   # longer than a flat feed
    heads = model.config.num_attention_heads
    monkeypatch.setattr(llama_forward, "SCORES_BLOCK_BYTES", 16 * 4 * heads * 80)   # 16 rows a block
    causal = torch.zeros(1, 1, 80, 80).masked_fill_(~torch.ones(80, 80, dtype=torch.bool).tril(), float("-inf"))
    assert llama_forward.query_blocks(causal, heads) == [(s, s + 16, s + 16) for s in range(0, 80, 16)]
    kv = BatchKV(model, slots=2)
    whole = kv.forward([Feed(0, prompt, 80)])[0]
    torch.testing.assert_close(whole, hf_logits(model, prompt), rtol=0, atol=1e-4)
    kv.forward([Feed(1, prompt[:12])])
    rest = kv.forward([Feed(1, prompt[12:], 68)])[0]   # 68 new rows after 12 cached
    torch.testing.assert_close(rest, whole[12:], rtol=0, atol=1e-5)


def test_the_hugging_face_module_still_computes_the_same_after_stacking():
    model = tiny_model("llama", seed=1)
    before = hf_logits(model, PREFIX)
    forward = llama_forward.for_model(model)
    # q/k/v and gate/up now live in stacked tensors; the module's parameters are views of them.
    stacked = forward.layers[0].qkv.weight.untyped_storage().data_ptr()
    assert model.model.layers[0].self_attn.k_proj.weight.untyped_storage().data_ptr() == stacked
    torch.testing.assert_close(hf_logits(model, PREFIX), before, rtol=0, atol=0)
    assert llama_forward.for_model(model) is llama_forward.for_model(model)   # stacked once per model


def test_the_feature_tap_sees_what_the_hugging_face_hook_sees():
    model = tiny_model("llama", seed=2, layers=3)
    tap = feature_tap(model)
    for layer in (0, 1):   # several layers at once, as an EAGLE-3 head reads them
        tap.watch(layer)
    hf_logits(model, PREFIX)
    hooked = {layer: out.clone() for layer, out in tap.last.items()}   # [1, S, hidden] each, from the module hooks
    assert sorted(hooked) == [0, 1]
    kv = BatchKV(model, slots=1)
    kv.forward([Feed(0, PREFIX)])
    # The feed's own rows: a step replayed as a CUDA graph also taps its bucket's padding columns.
    tolerance = 1e-5 if DEVICE.type == "cpu" else 1e-4   # fused attention sums in another order
    for layer, out in hooked.items():
        torch.testing.assert_close(kv.fed_rows(tap.last[layer], 0), out[0], rtol=0, atol=tolerance)


def test_a_pruned_head_draft_scatters_its_logits_to_the_full_vocabulary():
    from specserve.replicas.drafts.pruned_head import PrunedHeadConfig, PrunedHeadLlamaForCausalLM

    base = tiny_model("llama", seed=4)
    # Its own model type, as config.json has it (the shipped draft once fell back to Hugging
    # Face's forward because only "llama" was recognised).
    fields = {k: v for k, v in base.config.to_dict().items() if k != "model_type"}
    config = PrunedHeadConfig.from_dict({**fields, "head_token_ids": list(range(0, base.config.vocab_size, 3))})
    assert config.model_type == "specserve_pruned_head_llama"
    torch.manual_seed(0)
    pruned = PrunedHeadLlamaForCausalLM(config).eval()
    assert llama_forward.supports(pruned)
    got = BatchKV(pruned, slots=1).forward([Feed(0, PREFIX, 2)])[0]
    torch.testing.assert_close(got, hf_logits(pruned, PREFIX)[-2:], rtol=0, atol=1e-4)


def test_other_architectures_keep_the_hugging_face_path():
    assert not llama_forward.supports(tiny_model("gpt2", seed=0))
    assert BatchKV(tiny_model("gpt2", seed=0), slots=1)._fast is None


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_packed_bfloat16_products_equal_f_linear_bit_for_bit(rows):
    torch.manual_seed(0)
    weight = (torch.randn(384, 96) * 0.05).bfloat16()
    if not llama_forward.packable(weight):
        pytest.skip("oneDNN has no bfloat16 path on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    linear = llama_forward.Linear(weight, None)
    assert linear.packed is not None
    x = torch.randn(2, rows, 96).bfloat16()
    assert torch.equal(linear(x), F.linear(x, weight))
    assert llama_forward.Linear(weight.float(), None).packed is None   # float32 is left as it is


def test_a_cpu_onednn_cannot_pack_for_keeps_16_bit_weights_as_they_are(monkeypatch):
    # Without AVX-512 or AVX-NE-CONVERT oneDNN refuses to pack bfloat16: F.linear serves instead.
    monkeypatch.setattr(llama_forward, "_onednn_supports", lambda dtype: False)
    weight = (torch.randn(8, 4) * 0.05).bfloat16()
    linear = llama_forward.Linear(weight, None)
    x = torch.randn(1, 2, 4).bfloat16()
    assert linear.packed is None and torch.equal(linear(x), F.linear(x, weight))


@pytest.mark.skipif(int8_linear.library() is None, reason="no C compiler: int8 drafts stay float32")
@pytest.mark.skipif(DEVICE.type != "cpu", reason="int8 rows are a CPU kernel: on other devices the weights stay as loaded")
def test_a_model_loaded_as_int8_computes_hugging_faces_maths_with_its_weights_rounded():
    """``quantization: int8`` rounds each product's weight to int8 rows: decode and prefill feeds
    give Hugging Face's logits for the same model with its weights so rounded."""
    model = tiny_model("llama", seed=4, layers=2)
    setattr(model, llama_forward.QUANTIZATION, "int8")
    kv = BatchKV(model, slots=2)
    assert all(lin.int8 is not None for lin in (kv._fast.lm_head, kv._fast.layers[0].qkv, kv._fast.layers[1].down))
    prompt = [(5 * i + 2) % model.config.vocab_size for i in range(40)]   # longer than the kernel's rows
    prefill = kv.forward([Feed(0, prompt, 40)])[0]
    step = kv.forward([Feed(0, [9, 4, 7], 3)])[0]
    rounded_to_int8_rows(model)
    torch.testing.assert_close(prefill, hf_logits(model, prompt), rtol=0, atol=1e-4)
    torch.testing.assert_close(step, hf_logits(model, prompt + [9, 4, 7])[-3:], rtol=0, atol=1e-4)


def test_a_rotary_table_outgrown_stays_alive_and_unchanged():
    """A CUDA graph captured before the table grew still reads the old table: it is never freed,
    and growing does not change the values of the positions it held."""
    import weakref

    forward = llama_forward.for_model(tiny_model("llama", seed=0))
    cos, sin = forward._rope_table(8, DEVICE, torch.float32)
    held, before = weakref.ref(cos), cos.clone()
    grown, _ = forward._rope_table(2 * len(cos) + 1, DEVICE, torch.float32)
    del cos, sin
    assert len(grown) > len(before) and held() is not None
    assert torch.equal(held(), before) and torch.equal(grown[:len(before)], before)
