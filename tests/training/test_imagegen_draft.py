"""The image generator's draft: streams the generator samples, a tiny training run that resumes,
greedy acceptance by grid row, and the export the engine drafts with."""

import numpy as np
import torch
from transformers import LlamaForCausalLM

from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.imagegen import generate, load_generator
from specserve.replicas.request import Guidance, SpecRequest
from specserve.replicas.target import Target
from specserve.training import imagegen_draft
from specserve.training.imagegen_draft import DraftRecipe, export, streams, train
from tiny_models import tiny_generator_folder


def test_the_draft_learns_from_the_generators_own_pictures_and_drafts_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(imagegen_draft, "STREAM_CHUNK", 64)
    folder = tiny_generator_folder(tmp_path, grid=4)
    generator, settings, _ = load_generator(folder)
    ids, labels = streams(folder, tmp_path / "w", 128, progress=False)
    assert ids.shape == (128, 16) and labels[:7].tolist() == [0, 1, 2, 3, 4, 5, 0]
    first = generate(generator, settings.layout, [i % 6 for i in range(64)], 16, cfg_scale=2.0, temperature=1.0,
                     top_k=8, seed=0)
    assert np.array_equal(ids[:64], first.numpy())   # the first chunk's first batch of 64, as the generator drew it
    recipe = DraftRecipe(pictures=128, steps=6, batch=8, hidden=32, heads=2, eval_every=3, save_every=3)
    work = train(folder, work=tmp_path / "w", recipe=recipe, steps=3, progress=False)
    work = train(folder, work=work, recipe=recipe, progress=False)   # resumes
    state = torch.load(work / "checkpoint.pt")
    assert state["step"] == 6 and [e["step"] for e in state["log"]] == list(range(1, 7))
    assert len(state["log"][-1]["agreement_by_row"]) == 4 and all(0 <= a <= 1 for a in state["log"][-1]["agreement_by_row"])
    out = export(folder, work=work, out=tmp_path / "draft")
    assert "greedy acceptance" in (out / "README.md").read_text()
    # The exported draft proposes for the generator through the engine; the output stays the generator's.
    draft = DraftLM("d", LlamaForCausalLM.from_pretrained(out).eval())
    request = SpecRequest([settings.layout.class_token(2)], 16, draft="d", window=3, request_id="r", grid=4,
                          guidance=Guidance((settings.layout.unconditional,), 2.0, 32))
    got = run_batch(Target(generator, slots=2), {"d": in_process_server("d", draft)}, [request])[0]
    assert got.token_ids == generate(generator, settings.layout, [2], 16, cfg_scale=2.0)[0].tolist()
