"""VLM folders as users have them: saved by ``save_pretrained`` (weights, config, processor),
loaded by the class their config names, and decoded equal to the model's own ``generate`` on
the processor's own inputs (greedy, float32)."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from specserve.data.synthetic_images import example
from specserve.replicas.engine import GenerateRequest, SpecEngine
from specserve.replicas.vlm import load_processor
from tiny_models import VLM_FOLDER_KINDS, tiny_vlm_folder

NEW_TOKENS = 16
QUESTION = "What shape is this, and what colour?"

pytestmark = pytest.mark.reference   # the reference tokenizer is the folders'


@pytest.mark.parametrize("kind", VLM_FOLDER_KINDS)
def test_a_saved_vlm_folder_serves_equal_to_its_own_generate(tmp_path, kind):
    folder = tiny_vlm_folder(kind, tmp_path / kind)
    engine = SpecEngine.load(str(folder), dtype="float32", device="cpu", slots=4)
    # The second picture wide: a class that reads pictures at their own resolution gives it a grid of its own.
    pictures = [example(1, "shape").image, example(2, "shape").image.resize((64, 24))]

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)   # Qwen2-VL's without torchvision: the processor less its video part
    assert type(engine.loaded.model) is type(model)
    answers = []
    for picture in pictures:
        content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=text, images=[picture], return_tensors="pt", add_special_tokens=False)
        theirs = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        for draft, window in (("none", 0), ("prompt-lookup", 3)):
            ours = engine.generate(GenerateRequest(QUESTION, NEW_TOKENS, draft, window, images=(picture,)))
            assert ours["token_ids"] == theirs.tolist(), (kind, draft)
        answers.append(theirs.tolist())
    assert len(answers[0]) > 1 and answers[0] != answers[1], "the answer must depend on the picture"


def test_a_folder_without_torchvision_keeps_its_chat_template_however_it_was_saved(tmp_path):
    """A Qwen2-VL folder's processor, built without its video part, reads the chat template from
    ``chat_template.jinja`` or, as older processors saved it, ``chat_template.json``."""
    import json

    folder = tiny_vlm_folder("qwen2-vl", tmp_path / "qwen2-vl")
    template = (folder / "chat_template.jinja").read_text()
    assert load_processor(folder).chat_template == template
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_processor(folder).chat_template == template


@pytest.mark.parametrize("kind, fps", [("qwen2-vl", None), ("qwen2.5-vl", 2.5)])
def test_a_qwen2_vl_folder_reads_a_clip_in_process_as_its_own_generate(tmp_path, kind, fps):
    """In process, a clip's frames given for a video part decode as the folder's model does given
    the clip's temporal patches as video (Qwen2.5-VL's at the clip's frame rate); a class that
    reads clips as frames says to send pictures."""
    from tiny_models import folder_generate_clip

    folder = tiny_vlm_folder(kind, tmp_path / kind)
    engine = SpecEngine.load(str(folder), dtype="float32", device="cpu", slots=2)
    frames = [example(3, "shape").image, example(4, "shape").image, example(3, "shape").image]
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    prompt = engine.encode_messages([{"role": "user", "content": content}], clips=[frames], fps=fps)
    ours = engine.generate_ids(prompt, GenerateRequest(QUESTION, NEW_TOKENS, "prompt-lookup", 3))
    assert ours.token_ids == folder_generate_clip(folder, frames, QUESTION, NEW_TOKENS, fps)
    llava = SpecEngine.load(str(tiny_vlm_folder("llava", tmp_path / "llava")), dtype="float32", device="cpu", slots=2)
    with pytest.raises(ValueError, match="reads a clip as its frames"):
        llava.encode_messages([{"role": "user", "content": content}], clips=[frames])


def test_clips_of_one_call_each_keep_their_own_frame_rate(tmp_path):
    """Qwen2.5-VL places a clip's patches in time by its rate: two clips given two rates read as
    each does alone at its own."""
    engine = SpecEngine.load(str(tiny_vlm_folder("qwen2.5-vl", tmp_path / "qwen2.5-vl")), dtype="float32",
                             device="cpu", slots=2)
    frames = [example(3, "shape").image, example(4, "shape").image, example(5, "shape").image,
              example(6, "shape").image]
    two = [{"role": "user", "content": [{"type": "video"}, {"type": "video"}, {"type": "text", "text": QUESTION}]}]
    one = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    both = engine.encode_messages(two, clips=[frames, frames], fps=[4.0, 2.0])
    fast = engine.encode_messages(one, clips=[frames], fps=4.0)
    slow = engine.encode_messages(one, clips=[frames], fps=2.0)
    assert fast != slow   # the rate is in the ids
    clip_ids = [t for t in fast if t not in slow]
    assert clip_ids and all(t in both for t in clip_ids) and all(t in both for t in slow if t not in fast)
    first_slow = next(t for t in slow if t not in fast)
    assert both.index(clip_ids[-1]) < both.index(first_slow)   # the first clip at the first rate
    assert both != engine.encode_messages(two, clips=[frames, frames], fps=[2.0, 4.0])
    assert engine.encode_messages(two, clips=[frames, frames], fps=4.0) == engine.encode_messages(
        two, clips=[frames, frames], fps=[4.0, 4.0])
    with pytest.raises(ValueError, match="2 clips"):
        engine.encode_messages(two, clips=[frames, frames], fps=[2.0])
