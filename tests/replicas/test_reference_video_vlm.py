"""The reference video model (``smollm2-vlm-video``: the reference VLM taught clips, its language
model adapted) answers from every frame of a clip, and the engine's speculative answers equal its
own greedy ``generate`` in float32, its own draft (``smollm2-vlm-video-draft``) reading the frames
and its own Sparrow head (``smollm2-vlm-video-sparrow``) drafting with the text-anchored window."""

import pytest
import torch
from specserve.data.synthetic_clips import clip_example
from specserve.data.synthetic_images import TEST_SEED, normalise_answer
from specserve.replicas.engine import GenerateRequest, SpecEngine
from specserve.replicas.model_store import load_causal_lm
from specserve.replicas.vlm import REFERENCE_VIDEO_VLM

from equality import own_vlm_answer

pytestmark = [pytest.mark.reference, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(REFERENCE_VIDEO_VLM, dtype="float32", device="cpu",
                           ensembles={"video": {"model": "smollm2-vlm-video-draft", "views": ["multimodal"]},
                                      "pictures": {"model": "smollm2-vlm-draft", "views": ["multimodal"]}},
                           draft_models=["smollm2-vlm-video-sparrow", "smollm2-vlm-sparrow"])


def test_a_sequence_is_named_frame_by_frame_and_equals_the_models_own(engine):
    right = 0
    for n in range(6):
        clip = clip_example(TEST_SEED + 7_000 + n, "sequence")
        out = engine.generate(GenerateRequest(clip.question, max_tokens=32, draft="prompt-lookup", window=3,
                                              images=clip.frames))
        if n < 2:   # lossless: the model's own answer
            assert out["token_ids"] == own_vlm_answer(engine, clip.frames, clip.question, 32)
        right += normalise_answer(out["text"]) == normalise_answer(clip.answer)
    assert right >= 4, f"{right} of 6 sequences named right"


def test_the_language_model_is_the_targets_with_the_adapters_folded_in(engine):
    text = load_causal_lm(dtype="float32", device="cpu").model
    body = engine.loaded.model.model.language_model
    assert torch.equal(body.embed_tokens.weight, text.model.embed_tokens.weight)   # the drafts' shared rows
    moved = (body.layers[0].self_attn.q_proj.weight - text.model.layers[0].self_attn.q_proj.weight).abs().max()
    assert 0 < moved < 0.1 * text.model.layers[0].self_attn.q_proj.weight.abs().max()


def clip_answers_drafted(engine, drafts: tuple[str, str], first_seed: int) -> tuple[float, float]:
    """Each draft's mean accepted length over three 4-frame sequences, every answer the model's own."""
    accepted = {draft: [] for draft in drafts}
    for n in range(3):
        clip = clip_example(first_seed + n, "sequence", frames=4)
        own = own_vlm_answer(engine, clip.frames, clip.question, 32)
        for draft in drafts:
            out = engine.generate(GenerateRequest(clip.question, max_tokens=32, draft=draft, window=4,
                                                  images=clip.frames))
            assert out["token_ids"] == own, (draft, n)
            accepted[draft].append(out["spec"]["mean_accepted_len"])
    return tuple(sum(v) / len(v) for v in accepted.values())


def test_its_own_draft_drafts_its_clip_answers_where_the_picture_draft_does_not(engine):
    """The video model's draft learned its answers to clips: reading the frames' image rows it
    drafts a sequence's answer several tokens a step, where the draft taught single pictures does
    not, and the answer stays the model's own."""
    video, pictures = clip_answers_drafted(engine, ("video", "pictures"), TEST_SEED + 7_100)
    assert video > 2.0 and video > pictures + 0.5, (video, pictures)


def test_its_own_sparrow_head_drafts_a_clips_answer_through_the_window_where_the_picture_head_does_not(engine):
    """Trained on the video model's answers to clips, its head drafts a sequence's answer several
    tokens a step without attending to a frame (VATA), where the head trained on the picture VLM's
    answers does not; the answer stays the model's own."""
    heads = ("smollm2-vlm-video-sparrow", "smollm2-vlm-sparrow")
    assert all(engine.drafts[name].windowed for name in heads)
    video, pictures = clip_answers_drafted(engine, heads, TEST_SEED + 7_200)
    assert video > 2.0 and video > pictures + 0.5, (video, pictures)
