"""Training the image tokenizer: steps lower the pixel error, a run resumes where it stopped, dead
codes restart, and the export loads with its model card."""

import torch
from PIL import Image

from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer
from specserve.training.vq_train import VQRecipe, export, restart_dead_codes, train

TINY = VQConfig(channels=8, codebook_size=32, code_dim=4)
RECIPE = VQRecipe(steps=6, batch=4, lr=3e-3, warmup_steps=1, restart_every=3, eval_every=6, eval_scenes=4, save_every=3)


def test_training_lowers_the_error_resumes_and_exports(tmp_path):
    torch.manual_seed(0)
    work = train(work=tmp_path / "w", recipe=RECIPE, config=TINY, progress=False, steps=3)
    state = torch.load(work / "checkpoint.pt")
    assert state["step"] == 3 and [e["step"] for e in state["log"]] == [1, 2, 3] and "restarted" in state["log"][-1]
    train(work=work, recipe=RECIPE, config=TINY, progress=False)   # resumes at step 3
    state = torch.load(work / "checkpoint.pt")
    log = state["log"]
    assert [e["step"] for e in log] == list(range(1, 7)) and "eval" in log[-1]
    assert log[-1]["pixel_mse"] < log[0]["pixel_mse"]
    out = export(work=work, out=tmp_path / "vq", eval_scenes=4)
    assert VQTokenizer.load(out).config == TINY and "PSNR" in (out / "README.md").read_text()
    assert Image.open(out / "reconstructions.png").size == (8 * TINY.image_size, 2 * TINY.image_size)


def test_codes_no_cell_chose_restart_at_the_worst_fitted_encoder_outputs():
    torch.manual_seed(0)
    model = VQTokenizer(TINY)
    used = torch.zeros(TINY.codebook_size, dtype=torch.long)
    used[:30] = 1   # codes 30 and 31 are dead
    z = torch.randn(1, TINY.code_dim, 4, 4)
    before = model.codebook.weight.detach().clone()
    assert restart_dead_codes(model, used, z) == 2
    after = model.codebook.weight.detach()
    assert torch.equal(after[:30], before[:30]) and not torch.equal(after[30:], before[30:])
    flat = torch.nn.functional.normalize(z.permute(0, 2, 3, 1).reshape(-1, TINY.code_dim), dim=-1)
    assert all(any(torch.allclose(code, row) for row in flat) for code in after[30:])
