"""Sparrow's head for the reference VLM: IVSB feeds a picture's positions the anchor at every
unrolled step; the states are the VLM's own at its second-to-last and middle layers; training
lowers the held-out KL, and the export drafts the VLM's answers through the text-anchored window
with the output unchanged."""

import json

import pytest
import torch

from specserve.data.synthetic_images import TEST_SEED, example
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.hsr_head import HSRConfig, build_hsr_head
from specserve.replicas.engine import GenerateRequest, SpecEngine
from specserve.training import sparrow_head, vlm_draft
from specserve.training.hsr_train import unrolled_outputs
from tiny_models import tiny_model

PICTURES = 8   # one per category


def test_ivsb_feeds_a_pictures_positions_the_anchor_at_every_unrolled_step():
    target = tiny_model("llama", seed=0, layers=3)
    head = build_hsr_head(target, list(range(target.config.vocab_size)))
    tokens = torch.tensor([[3, 4, 9, 9, 9, 9, 5, 6, 7, 8]])
    image = tokens == 9
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, tokens.shape[1], hidden, generator=generator)
    anchor = torch.randn(1, tokens.shape[1], hidden, generator=generator)
    # The states that would feed the picture's positions (row p feeds position p + 1) are replaced.
    moved = features.clone()
    moved[0, 1:5] += 1.0
    with torch.no_grad():
        bridged = [unrolled_outputs(head, tokens, f, 3, anchor, image) for f in (features, moved)]
        plain = [unrolled_outputs(head, tokens, f, 3) for f in (features, moved)]
        other = unrolled_outputs(head, tokens, features, 3, anchor + 1.0, image)
    for step in range(3):
        assert torch.equal(bridged[0][step], bridged[1][step])
        assert not torch.allclose(plain[0][step], plain[1][step])
        # Text positions after the picture attend to the anchor's keys.
        assert not torch.allclose(other[step][0, 5:], bridged[0][step][0, 5:])


def test_a_head_trained_with_ivsb_drafts_with_the_window():
    target = tiny_model("llama", seed=0, layers=3)
    head = build_hsr_head(target, list(range(target.config.vocab_size)))
    assert not draft_from_model("plain", head).windowed
    assert draft_from_model("plain", head, windowed=True).windowed
    head.config.visual_anchor_layer = 2
    assert draft_from_model("sparrow", head).windowed
    assert HSRConfig.from_dict(head.config.to_dict()).visual_anchor_layer == 2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().mean() / want.float().abs().mean())


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    return tmp_path_factory.mktemp("answers")


@pytest.fixture(scope="module")
def corpus(answers):
    return sparrow_head.states_corpus(vlm_draft.answer_corpus(PICTURES, answers, progress=False), answers,
                                      progress=False)


@pytest.mark.reference
@pytest.mark.slow
def test_the_states_are_the_vlms_own_at_its_second_to_last_and_middle_layers(corpus):
    from specserve.replicas.vlm import image_processor, load_vlm

    vlm = load_vlm("smollm2-vlm", dtype="bfloat16", device="cpu").model
    placeholder = vlm_draft._placeholder()
    row = corpus[3]
    ids = torch.tensor([row["prompt"] + row["answer"]])
    pixels = image_processor(vlm.config)([example(row["seed"], row["category"]).image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = vlm.model(input_ids=ids, pixel_values=pixels.to(vlm.dtype), output_hidden_states=True).hidden_states
    layers = vlm.config.text_config.num_hidden_layers
    assert row["states"].shape == (ids.shape[1], vlm.config.text_config.hidden_size)
    assert row["anchor"].shape[0] == int((ids == placeholder).sum()) == 64
    # Equal up to bfloat16 rounding: the corpus ran the picture's served rows batched with others,
    # and bfloat16 products may round a row differently in another batch (over 30 layers that
    # reaches a few percent on some CPUs). So each is the nearest of the neighbouring layers' too.
    anchor, image = sparrow_head.anchor_layer(layers), ids[0] == placeholder
    near = {k: relative_error(row["states"], hidden[k][0]) for k in (-3, -2, -1)}
    assert near[-2] < 0.1 and near[-2] < min(near[-3], near[-1]) / 2, near
    mid = {k: relative_error(row["anchor"], hidden[k][0][image]) for k in (anchor - 1, anchor, anchor + 1)}
    assert mid[anchor] < 0.1 and mid[anchor] < min(mid[anchor - 1], mid[anchor + 1]) / 2, mid
    assert relative_error(hidden[anchor][0][image], hidden[-2][0][image]) > 0.1


@pytest.mark.reference
@pytest.mark.slow
def test_training_lowers_the_held_out_kl_and_the_export_drafts_windowed_the_vlms_own_answers(corpus, answers, tmp_path):
    work = tmp_path / "work"
    sparrow_head.train(ivsb=True, pictures=PICTURES, steps=4, batch=4, validate_every=2, work=work, answers=answers,
                       progress=False)
    before = json.loads((work / "base_validation.json").read_text())["kl"]
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines()]
    after = min(sum(r["validation"]["kl"]) for r in log if "validation" in r)
    assert after < sum(before)
    out = sparrow_head.export(ivsb=True, work=work, out=tmp_path / "head")
    config = json.loads((out / "config.json").read_text())
    assert config["visual_anchor_layer"] == 15
    assert {t for r in corpus for t in r["answer"]} <= set(config["head_token_ids"])
    assert "| 1 |" in (out / "README.md").read_text()

    engine = SpecEngine.load("smollm2-vlm", dtype="float32", device="cpu", draft_models=[str(out)])
    assert engine.drafts[out.name].windowed
    ex = example(TEST_SEED + 11, "describe")
    said = {d: engine.generate(GenerateRequest(ex.question, max_tokens=24, draft=d, window=3, images=(ex.image,)))
            for d in ("none", out.name)}
    assert said[out.name]["token_ids"] == said["none"]["token_ids"]
    assert said[out.name]["spec"]["acceptance_rate"] > 0


@pytest.mark.reference
@pytest.mark.slow
def test_the_video_recipe_reads_a_clips_frames_as_the_video_model_does_and_exports_its_own_head(tmp_path):
    """A clip's states are the video model's own over every frame (the anchor covers each frame's
    image tokens); the head trained on them starts from the picture head and says whose it is."""
    from dataclasses import replace

    from specserve.data.synthetic_clips import clip_example
    from specserve.replicas.vlm import image_processor, load_vlm

    recipe = replace(sparrow_head.VIDEO, answers=replace(vlm_draft.VIDEO, categories=("shape", "sequence")))
    answers = tmp_path / "answers"
    corpus = sparrow_head.states_corpus(vlm_draft.answer_corpus(2, answers, progress=False, recipe=recipe.answers),
                                        answers, progress=False)
    vlm = load_vlm("smollm2-vlm-video", dtype="bfloat16", device="cpu").model
    placeholder = vlm_draft._placeholder(recipe.answers.teacher)
    layers = vlm.config.text_config.num_hidden_layers
    (row,) = [r for r in corpus if r["category"] == "sequence"]
    frames = clip_example(row["seed"], "sequence").frames
    ids = torch.tensor([row["prompt"] + row["answer"]])
    pixels = image_processor(vlm.config)(list(frames), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = vlm.model(input_ids=ids, pixel_values=pixels.to(vlm.dtype), output_hidden_states=True).hidden_states
    image = ids[0] == placeholder
    assert row["anchor"].shape[0] == int(image.sum()) == 64 * len(frames) > 64
    assert relative_error(row["states"], hidden[-2][0]) < 1e-2
    assert relative_error(row["anchor"], hidden[sparrow_head.anchor_layer(layers)][0][image]) < 1e-2

    # The head starts from the picture head's layers (under the video answers' vocabulary).
    from specserve.replicas.model_store import load_causal_lm

    picture_head = load_causal_lm(recipe.base(True), dtype="float32", device="cpu").model.state_dict()
    started = sparrow_head.build_head(vlm_draft.head_tokens(corpus, recipe.base(True)), True, recipe.base(True))
    assert all(torch.equal(v, picture_head[k].float()) for k, v in started.state_dict().items()
               if k not in ("lm_head.weight", "embed_tokens.weight"))

    work = tmp_path / "work"
    sparrow_head.train(ivsb=True, pictures=2, steps=2, batch=1, validate_every=1, work=work, answers=answers,
                       progress=False, recipe=recipe)
    out = sparrow_head.export(ivsb=True, work=work, out=tmp_path / "head", recipe=recipe)
    training = json.loads((out / "training.json").read_text())
    assert (training["base"], training["teacher"]) == ("smollm2-vlm-sparrow", "smollm2-vlm-video")
    assert training["categories"] == ["shape", "sequence"]
    assert {t for r in corpus for t in r["answer"]} <= set(json.loads((out / "config.json").read_text())["head_token_ids"])
    card = (out / "README.md").read_text()
    assert "video model `smollm2-vlm-video`" in card and "sparrow-head --video`" in card
