"""Training the reference VLM: rows learn only the answer, a step runs, the exported tower and
projector load back into a VLM whose language model is the target's, and a second stage starts
from an export."""

import pytest
import torch
from specserve.replicas.model_store import load_causal_lm, load_tokenizer_and_config
from specserve.replicas.vlm import load_vlm, reference_vlm_config, tokens_per_image
from specserve.training.vlm_train import PictureStream, VLMRecipe, answer_loss, collate, export, stages, train

pytestmark = [pytest.mark.reference, pytest.mark.slow]


def test_a_row_labels_only_the_answer_and_its_end():
    tokenizer, text_config = load_tokenizer_and_config()
    config = reference_vlm_config(text_config)
    stream = PictureStream(tokenizer, config, start=0)
    ids, labels, pixels = stream.row(3)
    assert ids.count(config.image_token_index) == tokens_per_image(config)
    answer = [t for t in labels if t != -100]
    assert ids[-len(answer):] == answer and answer[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert pixels.shape == (1, 3, 96, 96)
    batch = collate([stream.row(3), stream.row(4)], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["pixel_values"].shape == (2, 3, 96, 96)


def test_a_clip_row_shows_its_frames_as_consecutive_pictures():
    from specserve.data.synthetic_clips import clip_example

    tokenizer, text_config = load_tokenizer_and_config()
    config = reference_vlm_config(text_config)
    stream = PictureStream(tokenizer, config, start=0, categories=("shape", "moves"))
    ids, labels, pixels = stream.row(1)
    frames = len(clip_example(1, "moves").frames)
    assert ids.count(config.image_token_index) == frames * tokens_per_image(config)
    assert pixels.shape == (frames, 3, 96, 96)
    answer = tokenizer.decode([t for t in labels if t != -100], skip_special_tokens=True)
    assert answer == clip_example(1, "moves").answer
    batch = collate([stream.row(0), stream.row(1)], tokenizer.pad_token_id)   # a picture, then a clip
    assert batch["pixel_values"].shape == (1 + frames, 3, 96, 96)


def test_a_step_trains_the_export_loads_back_and_a_second_stage_starts_from_it(tmp_path):
    work = train(steps=1, batch=2, work=tmp_path / "work", progress=False,
                 recipe=VLMRecipe(eval_every=100, eval_per_category=1, warmup_steps=1))
    state = torch.load(work / "checkpoint.pt")
    assert state["step"] == 1 and "accuracy" in state["log"][-1]
    out = export(work=work, out=tmp_path / "vlm")
    vlm = load_vlm(str(out), dtype="float32", device="cpu").model
    loaded = vlm.state_dict()
    for name, weight in state["weights"].items():   # stored in bfloat16
        assert torch.equal(loaded[name], weight.to(torch.bfloat16).float()), name
    text = load_causal_lm(dtype="float32", device="cpu").model
    assert torch.equal(vlm.model.language_model.layers[0].self_attn.q_proj.weight,
                       text.model.layers[0].self_attn.q_proj.weight)

    # The second stage (``--fine-tune``) starts from the export and keeps the first in its log.
    second = VLMRecipe(steps=1, batch=2, lr=0.0, warmup_steps=1, eval_every=100, eval_per_category=1,
                       categories=("caption", "describe"))
    work = train(work=tmp_path / "two", progress=False, recipe=second, start_from=out)
    state = torch.load(work / "checkpoint.pt")
    for name, weight in state["weights"].items():   # lr 0: the step kept the export's weights
        assert torch.equal(weight.to(torch.bfloat16).float(), loaded[name]), name
    assert len(stages({"stages": [*state["earlier"], {}]})) == 2 and state["earlier"][0]["steps"] == 1
    tokenizer, text_config = load_tokenizer_and_config()
    stream = PictureStream(tokenizer, reference_vlm_config(text_config), 0, second.categories)
    asked = {tokenizer.decode(stream.row(seed)[0]).split("<|im_start|>user")[-1] for seed in (0, 1)}
    assert any("caption" in a for a in asked) and any("Describe" in a for a in asked)


def test_every_row_weighs_the_same_whatever_its_answers_length():
    """Row 0 answers in one token (loss log 4 under uniform logits), row 1 in three tokens it gets
    right with certainty: per row the mean is (log 4 + 0) / 2, per token log 4 / 4."""
    logits = torch.zeros(2, 5, 4)
    labels = torch.full((2, 5), -100)
    labels[0, 4] = 1
    labels[1, 2:5] = torch.tensor([2, 3, 0])
    for position, token in ((1, 2), (2, 3), (3, 0)):
        logits[1, position, token] = 1e4
    log4 = torch.log(torch.tensor(4.0))
    assert torch.isclose(answer_loss(logits, labels), log4 / 2)
    assert torch.isclose(answer_loss(logits, labels, per_row=False), log4 / 4)
    with pytest.raises(ValueError, match="row-mean or token-mean"):
        train(steps=1, recipe=VLMRecipe(loss="mean"), progress=False)


def test_clips_of_several_frame_counts_are_scored_together():
    """Held-out clips differ in frame count, so in prompt length: each is scored in a batch of its
    own length (a padded batch would be scored on the padding)."""
    from specserve.data.synthetic_clips import clip_example
    from specserve.data.synthetic_images import TEST_SEED
    from specserve.training.vlm_train import evaluate

    first = TEST_SEED + 9 * 100_000   # where ``evaluate`` draws the ``moves`` clips from
    assert len({len(clip_example(first + i, "moves").frames) for i in range(4)}) > 1
    vlm = load_vlm("smollm2-vlm", dtype="float32", device="cpu")
    accuracy = evaluate(vlm.model, vlm.tokenizer.tokenizer, 4, categories=("moves",))
    assert set(accuracy) == {"moves", "mix"} and accuracy["moves"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_a_stage_with_adapters_exports_them_and_the_load_folds_them_into_the_language_model(tmp_path):
    from safetensors.torch import load_file
    from specserve.replicas.vlm import TEXT_LORA

    recipe = VLMRecipe(steps=1, batch=2, eval_every=100, eval_per_category=1, warmup_steps=1, lora_rank=2,
                       lora_alpha=4.0, lora_lr=1e-2, categories=("shape", "moves"))
    work = train(work=tmp_path / "work", progress=False, recipe=recipe)
    first = torch.load(work / "checkpoint.pt")["weights"]
    train(steps=3, work=work, progress=False, recipe=recipe)   # resumed: the adapters go on from step 1
    state = torch.load(work / "checkpoint.pt")
    key = "model.language_model.layers.3.mlp.down_proj.lora.B"
    assert state["step"] == 3 and first[key].abs().max() > 0 and not torch.equal(state["weights"][key], first[key])
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [pytest.approx(recipe.lr * 0.5),
                                                                   pytest.approx(recipe.lora_lr * 0.5)]
    with pytest.raises(ValueError, match="LoRA rank 2"):
        train(steps=4, work=work, progress=False, recipe=VLMRecipe(eval_every=100, lora_rank=4))
    out = export(work=work, out=tmp_path / "vlm")
    with pytest.raises(ValueError, match="adapts its language model"):
        train(work=tmp_path / "later", progress=False, recipe=recipe, start_from=out)
    adapters = load_file(out / TEXT_LORA)
    a, b = adapters["layers.3.mlp.down_proj.lora_A"].float(), adapters["layers.3.mlp.down_proj.lora_B"].float()
    assert a.shape[0] == b.shape[1] == 2 and b.abs().max() > 0   # one step at lr 1e-2 moved B from zero
    vlm = load_vlm(str(out), dtype="float32", device="cpu").model
    text = load_causal_lm(dtype="float32", device="cpu").model
    expected = text.model.layers[3].mlp.down_proj.weight + 2.0 * (b @ a)
    torch.testing.assert_close(vlm.model.language_model.layers[3].mlp.down_proj.weight, expected)
    assert torch.equal(vlm.lm_head.weight, text.lm_head.weight)   # the output rows stay the target's

    # A stage without adapters leaves none behind in the folder it overwrites (its checkpoint: this
    # one's less the adapters).
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save({**state, "weights": {k: v for k, v in state["weights"].items() if ".lora." not in k},
                "recipe": {**state["recipe"], "lora_rank": 0}}, plain / "checkpoint.pt")
    export(work=plain, out=out)
    assert not (out / TEXT_LORA).exists()
    reloaded = load_vlm(str(out), dtype="float32", device="cpu").model
    assert torch.equal(reloaded.model.language_model.layers[3].mlp.down_proj.weight,
                       text.model.layers[3].mlp.down_proj.weight)
