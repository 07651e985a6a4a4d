"""A target replica's KV slots: on CUDA as many as the device's memory holds after what is in use
(vLLM's ``gpu_memory_utilization``), at most as configured, never none; elsewhere as configured.
A draft LM reserves its cache at start where its slots take a tenth of the device. Device memory
comes in as numbers, so every case runs on the CPU."""

import pytest
import torch
from transformers import LlamaConfig

from specserve.replicas.model.kv_memory import (SIZED_BY_CONFIG, SIZED_BY_DEVICE, KVBudget, KVSlots, check_utilization,
                                          choose_slots, draft_reservation, kv_budget, kv_bytes_per_token)

# 2 layers, 2 KV heads of 64 / 4 = 16 dimensions: 2 (K, V) x 2 x 2 x 16 = 128 elements a position.
TINY = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PER_TOKEN = 128 * 4   # float32
CUDA = torch.device("cuda", 0)   # only a name here: nothing is allocated on it
# u x total - in use - 5% of total = 900_000 - 400_000 - 50_000 = 450_000 bytes: 878 positions of 512 bytes.
TOTAL, FREE, WEIGHTS = 1_000_000, 600_000, 300_000
FITTING_TOKENS = 878


def device(free=FREE, total=TOTAL):
    return lambda _: (free, total)


def no_device(_):
    raise AssertionError("device memory is read on CUDA only")


def test_bytes_per_token_count_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(TINY, torch.float32) == PER_TOKEN
    assert kv_bytes_per_token(TINY, torch.bfloat16) == PER_TOKEN // 2
    # No num_key_value_heads: one KV head per attention head (4 x 16 = 64 per K or V, per layer).
    plain = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    plain.num_key_value_heads = None
    assert kv_bytes_per_token(plain, torch.float32) == 2 * 2 * 4 * 16 * 4
    # An explicit head_dim wins over hidden_size / heads.
    wide = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32)
    assert kv_bytes_per_token(wide, torch.float32) == 2 * 2 * 2 * 32 * 4


def test_the_budget_is_the_fraction_less_what_is_in_use_less_the_activations():
    budget = kv_budget(TOTAL, FREE, gpu_memory_utilization=0.9, weights_bytes=WEIGHTS, bytes_per_token=PER_TOKEN,
                       max_model_len=200)
    assert budget == KVBudget(kv_bytes=450_000, tokens=FITTING_TOKENS, max_model_len=200, slots=4)   # 878 // 200


def test_weights_count_as_in_use_even_when_free_was_read_before_they_loaded():
    # In use is max(0, 300_000): 900_000 - 300_000 - 50_000 = 550_000.
    budget = kv_budget(TOTAL, TOTAL, gpu_memory_utilization=0.9, weights_bytes=WEIGHTS, bytes_per_token=1000,
                       max_model_len=100)
    assert (budget.kv_bytes, budget.tokens, budget.slots) == (550_000, 550, 5)


def test_no_slot_that_fits_is_an_error_that_says_what_to_change():
    # 900_000 - 850_000 - 50_000 = 0 bytes for the KV cache.
    with pytest.raises(ValueError, match="lower max_model_len or raise gpu_memory_utilization") as err:
        kv_budget(TOTAL, 150_000, gpu_memory_utilization=0.9, weights_bytes=WEIGHTS, bytes_per_token=PER_TOKEN,
                  max_model_len=200)
    assert "max_model_len 200" in str(err.value)
    with pytest.raises(ValueError, match="lower max_model_len"):   # 878 positions, not 1000 in one slot
        kv_budget(TOTAL, FREE, gpu_memory_utilization=0.9, weights_bytes=WEIGHTS, bytes_per_token=PER_TOKEN,
                  max_model_len=1000)


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01, float("nan")])
def test_utilization_must_be_a_fraction_of_the_device(utilization):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        check_utilization(utilization)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        choose_slots(4, 2, 200, device=torch.device("cpu"), model_config=TINY, dtype=torch.float32,
                     weights_bytes=WEIGHTS, gpu_memory_utilization=utilization, mem_get_info=no_device)
    check_utilization(1.0)   # the whole device is allowed


def test_on_the_cpu_the_slots_are_as_configured():
    for max_model_len in (200, None):
        slots = choose_slots(4, 2, max_model_len, device=torch.device("cpu"), model_config=TINY, dtype=torch.float32,
                             weights_bytes=WEIGHTS, gpu_memory_utilization=0.9, mem_get_info=no_device)
        assert slots == KVSlots(slots=6, max_running=4, max_model_len=max_model_len, sized_by=SIZED_BY_CONFIG)


@pytest.mark.parametrize("max_model_len, slots, max_running", [
    (100, 6, 4),   # 8 fit: as configured, 4 running + 2 idle
    (175, 5, 4),   # 5 fit: one idle session given up
    (200, 4, 4),   # 4 fit: both idle sessions given up
    (400, 2, 2),   # 2 fit: two batch places given up as well
])
def test_on_cuda_fewer_slots_fit_give_up_idle_sessions_first(max_model_len, slots, max_running):
    got = choose_slots(4, 2, max_model_len, device=CUDA, model_config=TINY, dtype=torch.float32,
                       weights_bytes=WEIGHTS, gpu_memory_utilization=0.9, mem_get_info=device())
    assert got == KVSlots(slots, max_running, max_model_len, SIZED_BY_DEVICE)   # FITTING_TOKENS // max_model_len


def test_on_cuda_a_slot_holds_at_most_the_models_context():
    got = choose_slots(4, 2, 4096, device=CUDA, model_config=TINY, dtype=torch.float32, weights_bytes=WEIGHTS,
                       gpu_memory_utilization=0.9, mem_get_info=device())
    assert got == KVSlots(1, 1, 512, SIZED_BY_DEVICE)   # 878 // 512


def test_on_cuda_no_max_model_len_is_the_context_capped_so_that_the_batch_fits():
    got = choose_slots(4, 2, None, device=CUDA, model_config=TINY, dtype=torch.float32, weights_bytes=WEIGHTS,
                       gpu_memory_utilization=0.9, mem_get_info=device())
    assert got == KVSlots(4, 4, FITTING_TOKENS // 4, SIZED_BY_DEVICE)   # 219 positions each, 4 x 219 <= 878
    # 9_000_000 - 1_000_000 - 500_000 = 7_500_000 bytes: 14_648 positions, 3662 each for 4: the context
    # (512) is shorter, and 28 slots of it fit, of which the configured 6 are taken.
    roomy = choose_slots(4, 2, None, device=CUDA, model_config=TINY, dtype=torch.float32, weights_bytes=WEIGHTS,
                         gpu_memory_utilization=0.9, mem_get_info=device(free=9_000_000, total=10_000_000))
    assert roomy == KVSlots(6, 4, 512, SIZED_BY_DEVICE)


def test_on_cuda_a_batch_that_cannot_have_one_position_each_is_an_error():
    with pytest.raises(ValueError, match="lower max_batch, set max_model_len or raise gpu_memory_utilization"):
        choose_slots(4, 2, None, device=CUDA, model_config=TINY, dtype=torch.float32, weights_bytes=WEIGHTS,
                     gpu_memory_utilization=0.9, mem_get_info=device(free=150_000))


# A draft LM of TINY's shape: 512 positions x 512 bytes = 256 KiB a slot.
SLOT_BYTES = 512 * PER_TOKEN


@pytest.mark.parametrize("slots, free, total, max_model_len, want", [
    (2, 10 * SLOT_BYTES, 20 * SLOT_BYTES, None, 512),           # 2 slots: 10% of 20 slots' bytes, the context
    (2, 10 * SLOT_BYTES, 20 * SLOT_BYTES, 4096, 512),           # never past the model's context
    (4, 10 * SLOT_BYTES, 20 * SLOT_BYTES, 256, 256),            # 4 half-length slots: 2 full ones' bytes
    (3, 10 * SLOT_BYTES, 20 * SLOT_BYTES, None, 341),           # over a tenth of the device: what a tenth holds
    (2, SLOT_BYTES, 40 * SLOT_BYTES, None, 256),                # a tenth, but not free: what is free holds
    (5, 10 * SLOT_BYTES, 20 * SLOT_BYTES, None, None),          # 204 positions: outgrown at once, none reserved
    (5, 10 * SLOT_BYTES, 20 * SLOT_BYTES, 128, 128),            # ... unless every context served is shorter
], ids=["fits", "capped-by-context", "max-model-len", "over-a-tenth", "not-free", "too-few", "short-contexts"])
def test_a_draft_lm_reserves_what_a_tenth_of_the_device_holds(slots, free, total, max_model_len, want):
    assert draft_reservation(slots, max_model_len, device=CUDA, model_config=TINY, dtype=torch.float32,
                             mem_get_info=device(free, total)) == want


def test_a_draft_lm_off_cuda_grows_its_cache_on_demand():
    assert draft_reservation(2, 256, device=torch.device("cpu"), model_config=TINY, dtype=torch.float32,
                             mem_get_info=no_device) is None
