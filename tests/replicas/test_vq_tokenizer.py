"""The image tokenizer: pictures to a grid of codebook ids and back, its quantizer, its folder."""

import pytest
import torch

from specserve.data.scenes import scene
from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer, to_images, to_pixels

SMALL = VQConfig(image_size=32, channels=8, levels=1, codebook_size=16, code_dim=4)


def test_pixels_round_trip_through_pictures():
    images = [scene(s).image for s in range(2)]
    pixels = to_pixels(images)
    assert pixels.shape == (2, 3, 64, 64) and -1.0 <= pixels.min() and pixels.max() <= 1.0
    assert [list(i.getdata()) for i in to_images(pixels)] == [list(i.getdata()) for i in images]


def test_each_cell_takes_the_nearest_code_by_cosine_and_gradients_pass_straight_through():
    torch.manual_seed(0)
    model = VQTokenizer(SMALL)
    z = torch.randn(2, SMALL.code_dim, 4, 4, requires_grad=True)
    quantized, ids, loss = model.quantize(z)
    flat = torch.nn.functional.normalize(z.detach().permute(0, 2, 3, 1).reshape(-1, SMALL.code_dim), dim=-1)
    nearest = (flat @ model.codes().T).argmax(-1).reshape(2, 4, 4)
    assert torch.equal(ids, nearest) and ids.shape == (2, 4, 4)
    assert torch.allclose(quantized.detach().permute(0, 2, 3, 1), model.codes()[ids], atol=1e-6)
    quantized.sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0 and loss.item() >= 0


def test_ids_decode_to_pictures_of_the_configured_size_and_bad_ids_are_refused():
    model = VQTokenizer(SMALL).eval()
    pixels = to_pixels([scene(1).image.resize((32, 32))])
    ids = model.encode(pixels)
    assert ids.shape == (1, SMALL.grid, SMALL.grid) == (1, 16, 16)
    assert model.decode(ids).shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="image token ids"):
        model.decode(torch.full((1, 16, 16), SMALL.codebook_size))


def test_a_saved_folder_loads_back_the_same_tokenizer(tmp_path):
    model = VQTokenizer(SMALL).eval()
    loaded = VQTokenizer.load(model.save(tmp_path / "vq"))
    pixels = to_pixels([scene(3).image.resize((32, 32))])
    assert loaded.config == SMALL and torch.equal(loaded.encode(pixels), model.encode(pixels))
    (tmp_path / "vq" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a specserve VQ tokenizer"):
        VQTokenizer.load(tmp_path / "vq")


def test_the_shipped_tokenizer_rebuilds_held_out_scenes_from_their_grids():
    """The reference generator's trained tokenizer (``replicas/targets/scenes-vq``): held-out
    scenes through 16x16 tokens and back, busy backgrounds the harder part (its model card)."""
    from pathlib import Path

    import specserve.replicas as replicas
    from specserve.data.scenes import SMOOTH_BACKGROUNDS, TEST_SEED

    model = VQTokenizer.load(Path(replicas.__file__).parent / "targets" / "scenes-vq")
    held = [scene(TEST_SEED + i) for i in range(32)]
    pixels = to_pixels([s.image for s in held])
    ids = model.encode(pixels)
    assert ids.shape == (32, 16, 16)
    error = ((model.decode(ids) - pixels) ** 2).mean(dim=(1, 2, 3))
    smooth = torch.tensor([s.background in SMOOTH_BACKGROUNDS for s in held])
    assert error.mean() < 0.02 and error[smooth].mean() < error[~smooth].mean()
