"""Training the reference image generator: its vocabulary, its rows (class, then the image's grid,
the class dropped a tenth of the time for guidance), a tiny run that resumes, and its export as a
folder the server loads."""

import numpy as np
import pytest
import torch

from specserve.data.scenes import CLASSES, scene
from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer, to_pixels
from specserve.replicas.imagegen import ImagegenLayout, generate, load_generator
from specserve.training.imagegen_train import CFG_DROPOUT, ImagegenRecipe, export, sequences, token_grids, train


def test_the_vocabulary_holds_codes_then_classes_then_the_unconditional_token():
    layout = ImagegenLayout(512)
    assert layout.class_token(0) == 512 and layout.class_token(CLASSES - 1) == 512 + CLASSES - 1
    assert layout.unconditional == 512 + CLASSES and layout.vocab_size == 512 + CLASSES + 1
    with pytest.raises(ValueError):
        layout.class_token(CLASSES)


def test_rows_start_with_the_class_or_unconditional_token_about_a_tenth_of_the_time():
    layout = ImagegenLayout(16)
    ids = np.zeros((10000, 4), dtype=np.int16)
    labels = np.full(10000, 7, dtype=np.int16)
    rows = sequences(ids, labels, layout, np.random.default_rng(0))
    assert rows.shape == (10000, 5) and set(rows[:, 0].tolist()) == {layout.class_token(7), layout.unconditional}
    dropped = (rows[:, 0] == layout.unconditional).float().mean().item()
    assert abs(dropped - CFG_DROPOUT) < 0.01


def test_a_tiny_generator_trains_on_its_tokenizers_grids_and_resumes(tmp_path):
    torch.manual_seed(0)
    vq = VQTokenizer(VQConfig(channels=8, codebook_size=32, code_dim=4)).eval()
    folder = vq.save(tmp_path / "vq")
    recipe = ImagegenRecipe(steps=4, batch=4, scenes=128, hidden=32, layers=1, heads=2, eval_every=4, save_every=2)
    work = train(folder, work=tmp_path / "w", recipe=recipe, progress=False, steps=2)
    ids, labels = token_grids(vq, work, 128, progress=False)
    assert ids.shape == (128, 256) and labels[5] == scene(5).label
    assert np.array_equal(ids[5], vq.encode(to_pixels([scene(5).image])).flatten().numpy())
    train(folder, work=work, recipe=recipe, progress=False)
    state = torch.load(work / "checkpoint.pt")
    assert state["step"] == 4 and [e["step"] for e in state["log"]] == [1, 2, 3, 4]
    assert "held_out_loss" in state["log"][-1] and state["layout"]["codebook_size"] == 32

    out = export(folder, work=work, out=tmp_path / "gen")
    model, settings, tokenizer = load_generator(out)
    assert (settings.grid, settings.codebook_size, settings.layout.vocab_size) == (16, 32, 32 + CLASSES + 1)
    assert (out / "gallery.png").is_file() and "held-out loss" in (out / "README.md").read_text()
    # The exported weights are the checkpoint's, rounded to bfloat16.
    weights = state["weights"]["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, weights.to(torch.bfloat16).float())
    ids = generate(model, settings.layout, [3], 8, cfg_scale=settings.cfg_scale)
    assert ids.shape == (1, 8) and int(ids.max()) < 32
