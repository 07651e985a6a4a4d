"""VLM targets: pictures' image tokens travel as virtual ids (``image_tokens``), and speculative
output equals the VLM's own greedy output (Hugging Face ``generate`` with the pixels), for chains
and trees, model-free drafts and a draft LM reading the text-only view."""

import pytest
import torch
from specserve.data.synthetic_images import example
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.engine import in_process_server, run_batch, speculative_generate
from specserve.replicas.image_tokens import VIRTUAL_BASE, draft_view, placeholder_for
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.vlm import image_prompt_ids, image_store, language_model
from tiny_models import IMAGE_TOKEN, TINY_IMAGE_SIZE, perturbed, tiny_llava
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

GREEDY = SamplingParams()
NEW_TOKENS = 30
# Text around one picture, repetitive enough that prompt lookup has n-grams to copy.
TEXT = [5, 6, 7, 8, IMAGE_TOKEN, 5, 6, 7, 9, 10, 5, 6, 7]


@pytest.fixture(scope="module")
def vlm():
    model = tiny_llava(seed=0)
    store = image_store(model, SiglipImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}))
    return model, language_model(model), store


def picture(seed: int):
    return example(seed, "shape").image


def hf_greedy(model, store, text_ids: list[int], image) -> list[int]:
    """The VLM's own greedy continuation: placeholders expanded, pixels through its forward."""
    expanded = [t for i in text_ids for t in ([i] * store.tokens_per_image if i == IMAGE_TOKEN else [i])]
    ids = torch.tensor([expanded], device=model.device)
    pixels = store.prepare(image)[None].to(model.device)
    out = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_image_tokens_are_virtual_ids_named_by_the_picture(vlm):
    _, _, store = vlm
    a, b = store.register(picture(1)), store.register(picture(2))
    assert len(a) == store.tokens_per_image and all(t >= VIRTUAL_BASE for t in a)
    assert a == store.register(picture(1)) and a != b   # the content names the ids
    prompt = image_prompt_ids([5, IMAGE_TOKEN, 6], [picture(1)], store.register, IMAGE_TOKEN)
    assert prompt == [5, *a, 6]
    assert draft_view(prompt, IMAGE_TOKEN) == [5] + [IMAGE_TOKEN] * len(a) + [6]
    assert placeholder_for(store, prompt) == IMAGE_TOKEN and placeholder_for(store, [5, 6]) is None
    with pytest.raises(ValueError, match="placeholder"):
        image_prompt_ids([5, 6], [picture(1)], store.register, IMAGE_TOKEN)


def test_plain_decoding_equals_the_vlms_own_generate(vlm):
    model, lm, store = vlm
    for seed in (1, 2):
        prompt = image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN)
        got = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        assert got == hf_greedy(model, store, TEXT, picture(seed)), f"picture {seed}"


def test_the_answer_depends_on_the_picture(vlm):
    model, lm, store = vlm
    outputs = {tuple(speculative_generate(Target(lm, images=store), None,
                                          image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN),
                                          NEW_TOKENS, GREEDY).token_ids) for seed in (1, 2, 3)}
    assert len(outputs) > 1


@pytest.mark.parametrize("speculation", [{"window": 3}, {"window": 6}, {"tree": TreeShape(3, 2, 6)}], ids=str)
def test_speculative_equals_plain_on_image_prompts(vlm, speculation):
    model, lm, store = vlm
    drafts = {"prompt-lookup": PromptLookupDraft(), "suffix": SuffixDraft(),
              # A draft LM over the text model's weights plus noise: it reads the placeholder
              # where the picture was (an id past its vocabulary would fail its embedding).
              "near": DraftLM("near", perturbed(lm, seed=1))}
    accepted = 0
    for seed in (1, 2):
        prompt = image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN)
        expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        for name, draft in drafts.items():
            got = speculative_generate(Target(lm, images=store), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
            assert got.token_ids == expected, f"{name} {speculation} picture {seed}"
            accepted += got.stats.accepted
    assert accepted > 0


def test_image_and_text_requests_batched_equal_each_alone(vlm):
    model, lm, store = vlm
    image_prompt = image_prompt_ids(TEXT, [picture(4)], store.register, IMAGE_TOKEN)
    text_prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    requests = [SpecRequest(image_prompt, NEW_TOKENS, GREEDY, "prompt-lookup", 3, request_id="image",
                            image_placeholder=IMAGE_TOKEN),
                SpecRequest(text_prompt, NEW_TOKENS, GREEDY, "prompt-lookup", 3, request_id="text")]
    drafts = {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())}
    together = run_batch(Target(lm, slots=2, images=store), drafts, requests)
    for request, got in zip(requests, together):
        alone = run_batch(Target(lm, slots=1, images=store), drafts, [request])[0]
        assert got.token_ids == alone.token_ids, request.request_id


def test_the_prefix_cache_keys_on_the_picture(vlm):
    """One slot: a prompt showing another picture reuses only the text before it; the same
    picture again reuses the image tokens too, and its tower does not run again."""
    model, lm, store = vlm
    target = Target(lm, slots=1, images=store)
    first = image_prompt_ids(TEXT, [picture(5)], store.register, IMAGE_TOKEN)
    other = image_prompt_ids(TEXT, [picture(6)], store.register, IMAGE_TOKEN)
    before = TEXT.index(IMAGE_TOKEN)

    def run(prompt):
        request = SpecRequest(prompt, NEW_TOKENS, GREEDY, request_id=str(len(prompt)), image_placeholder=IMAGE_TOKEN)
        return run_batch(target, {}, [request])[0]

    run(first)
    encoded = store.encoded_images
    got = run(other)
    assert target.kv.tokens[0][:len(other)] == other and got.token_ids == hf_greedy(model, store, TEXT, picture(6))
    assert store.encoded_images == encoded + 1
    assert not set(first[before:before + store.tokens_per_image]) & set(target.kv.tokens[0])   # picture 5's are gone
    again = run(other)
    assert again.token_ids == got.token_ids and store.encoded_images == encoded + 1
