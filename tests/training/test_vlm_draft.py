"""The reference VLM's matching draft: its corpus is the VLM's own answers, states and picture
rows as served; training lowers the held-out KL; the export loads by path and drafts the VLM's
own answers through the multimodal view."""

import json

import pytest
import torch
from specserve.data.synthetic_images import CATEGORIES, TEST_SEED, example
from specserve.replicas.engine import GenerateRequest, SpecEngine
from specserve.replicas.pictures import image_store
from specserve.replicas.vlm import image_processor, load_vlm
from specserve.training import vlm_draft

pytestmark = [pytest.mark.reference, pytest.mark.slow]

PICTURES = 8   # one per category


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vlm-draft")


@pytest.fixture(scope="module")
def corpus(work):
    return vlm_draft.answer_corpus(PICTURES, work, progress=False)


def test_the_corpus_holds_the_vlms_answers_its_states_there_and_the_served_pictures_rows(corpus, work):
    assert sorted(r["category"] for r in corpus) == sorted(CATEGORIES)
    vlm = load_vlm("smollm2-vlm", dtype="bfloat16", device="cpu").model
    output = vlm.lm_head.weight.float()
    agree = total = 0
    for row in corpus:
        assert len(row["final"]) == len(row["answer"]) > 0
        # The teacher's states at the positions that predict the answer: their argmax is the
        # answer (the few near-ties bfloat16 may round the other way aside).
        agree += int((row["final"].float() @ output.T).argmax(-1).eq(torch.tensor(row["answer"])).sum())
        total += len(row["answer"])
    assert agree >= 0.9 * total, f"{agree} of {total} answer tokens are the states' argmax"
    # What the draft reads in training is what the multimodal view feeds it, served.
    store = image_store(vlm, image_processor(vlm.config))
    row = corpus[2]
    served = store.rows(torch.tensor(store.register(example(row["seed"], row["category"]).image)))
    # Equal up to bfloat16 rounding: the corpus ran its pictures as a batch, the store one alone,
    # and where bfloat16 is not native the batched products round differently in the last bits.
    gap = (served.float() - row["rows"].float()).abs()
    assert float(gap.max()) <= 0.1 and float(gap.mean()) <= 1e-2, (float(gap.max()), float(gap.mean()))
    with pytest.raises(ValueError, match="another work folder"):
        vlm_draft.answer_corpus(PICTURES + 1, work, progress=False)


def test_training_lowers_the_held_out_kl_and_the_export_drafts_the_vlms_own_answers(corpus, work, tmp_path):
    vlm_draft.train(pictures=PICTURES, steps=4, batch=4, validate_every=2, work=work, progress=False)
    before = json.loads((work / "base_validation.json").read_text())["all"]["kl"]
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines()]
    after = min(r["validation"]["all"]["kl"] for r in log if "validation" in r)
    assert after < before
    out = vlm_draft.export(work=work, out=tmp_path / "draft")
    head = set(json.loads((out / "config.json").read_text())["head_token_ids"])
    assert {t for r in corpus for t in r["answer"]} <= head
    assert "| all |" in (out / "README.md").read_text()

    engine = SpecEngine.load("smollm2-vlm", dtype="float32", device="cpu",
                             ensembles={"matched": {"model": str(out), "views": ["multimodal"]}})
    for category in ("describe",):
        ex = example(TEST_SEED + 11, category)
        said = {d: engine.generate(GenerateRequest(ex.question, max_tokens=32, draft=d, window=3,
                                                   images=(ex.image,)))["token_ids"] for d in ("none", "matched")}
        assert said["matched"] == said["none"], category


def test_the_video_recipe_holds_the_video_models_answers_to_clips_and_their_frames_rows(tmp_path):
    """Clips are asked as the video model reads them (each frame a picture): a clip's rows are its
    frames' rows in order, and the teacher's states predict its own answer."""
    from dataclasses import replace

    from specserve.data.synthetic_clips import clip_example

    recipe = replace(vlm_draft.VIDEO, categories=("shape", "sequence"))
    corpus = vlm_draft.answer_corpus(2, tmp_path, progress=False, recipe=recipe)
    assert sorted(r["category"] for r in corpus) == ["sequence", "shape"]
    vlm = load_vlm("smollm2-vlm-video", dtype="bfloat16", device="cpu").model
    store = image_store(vlm, image_processor(vlm.config))
    for row in (r for r in corpus if r["category"] == "sequence"):
        frames = clip_example(row["seed"], "sequence").frames
        assert row["rows"].shape[0] == 64 * len(frames)
        assert row["prompt"].count(vlm_draft._placeholder(recipe.teacher)) == 64 * len(frames)
        served = torch.cat([store.rows(torch.tensor(store.register(f))) for f in frames])
        assert float((served.float() - row["rows"].float()).abs().mean()) <= 1e-2
        predicted = (row["final"].float() @ vlm.lm_head.weight.float().T).argmax(-1)
        assert predicted.eq(torch.tensor(row["answer"])).float().mean() >= 0.9
    # A folder of one teacher's answers is not another's.
    with pytest.raises(ValueError, match="smollm2-vlm-video's answers to 2 questions .*another work folder"):
        vlm_draft.answer_corpus(2, tmp_path, progress=False, recipe=replace(recipe, teacher="smollm2-vlm"))
