"""The image generator's guidance and its plain decoder (the reference speculative decoding of
image tokens must equal)."""

import pytest
import torch

from specserve.replicas.imagegen import ImagegenLayout, generate, guided_logits
from tiny_models import tiny_generator

LAYOUT = ImagegenLayout(codebook_size=24, classes=5)


def generator(seed: int = 0):
    return tiny_generator(LAYOUT, hidden=32, heads=2, kv_heads=2, context=64, scale=8.0, seed=seed)


def test_the_layout_places_classes_after_the_codebook():
    assert LAYOUT.class_token(0) == 24 and LAYOUT.unconditional == 29 and LAYOUT.vocab_size == 30
    with pytest.raises(ValueError):
        LAYOUT.class_token(5)


def test_guidance_extrapolates_from_the_unconditional_logits_over_codebook_ids_only():
    c, u = torch.randn(3, LAYOUT.vocab_size), torch.randn(3, LAYOUT.vocab_size)
    got = guided_logits(c, u, 4.0, LAYOUT.codebook_size)
    torch.testing.assert_close(got[:, :24], u[:, :24] + 4.0 * (c[:, :24] - u[:, :24]))
    assert torch.isinf(got[:, 24:]).all()
    plain = guided_logits(c, None, 4.0, LAYOUT.codebook_size)
    torch.testing.assert_close(plain[:, :24], c[:, :24])
    assert torch.isfinite(c).all()   # the input is left as it was


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_generation_is_the_argmax_of_the_whole_prefix_each_step(cfg_scale):
    model = generator()
    got = generate(model, LAYOUT, [1, 3], tokens=6, cfg_scale=cfg_scale)
    assert got.shape == (2, 6) and int(got.max()) < LAYOUT.codebook_size
    with torch.inference_mode():
        for row, label in enumerate([1, 3]):
            cond, uncond = [LAYOUT.class_token(label)], [LAYOUT.unconditional]
            for t in range(6):
                c = model(torch.tensor([cond])).logits[0, -1]
                u = model(torch.tensor([uncond])).logits[0, -1]
                want = int(guided_logits(c, u, cfg_scale, LAYOUT.codebook_size).argmax())
                assert int(got[row, t]) == want
                cond, uncond = cond + [want], uncond + [want]


def test_sampling_is_seeded_and_keeps_the_top_k():
    model = generator(1)
    a = generate(model, LAYOUT, [0, 2, 4], tokens=8, cfg_scale=2.0, temperature=1.0, top_k=3, seed=5)
    b = generate(model, LAYOUT, [0, 2, 4], tokens=8, cfg_scale=2.0, temperature=1.0, top_k=3, seed=5)
    assert torch.equal(a, b) and int(a.max()) < LAYOUT.codebook_size
