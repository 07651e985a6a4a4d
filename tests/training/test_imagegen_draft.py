"""The image generator's draft: streams the generator samples, a tiny training run that resumes,
greedy acceptance by grid row, and the export the engine drafts with."""

import json

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.imagegen import GENERATOR_FILE, GeneratorSettings, generate, load_generator
from specserve.replicas.request import Guidance, SpecRequest
from specserve.replicas.target import Target
from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer
from specserve.training import imagegen_draft
from specserve.training.imagegen_draft import DraftRecipe, export, streams, train


def tiny_generator_folder(tmp_path):
    torch.manual_seed(0)
    VQTokenizer(VQConfig(channels=8, codebook_size=32, code_dim=4)).eval().save(tmp_path / "vq")
    settings = GeneratorSettings(codebook_size=32, classes=6, grid=4, tokenizer="../vq", cfg_scale=2.0, top_k=8)
    config = LlamaConfig(vocab_size=settings.layout.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    folder = tmp_path / "gen"
    model.save_pretrained(folder)
    (folder / GENERATOR_FILE).write_text(json.dumps(settings.__dict__))
    return folder


def test_the_draft_learns_from_the_generators_own_pictures_and_drafts_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(imagegen_draft, "STREAM_CHUNK", 64)
    folder = tiny_generator_folder(tmp_path)
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
