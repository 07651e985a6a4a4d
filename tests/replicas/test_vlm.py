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
from specserve.replicas.model import image_tokens
from specserve.replicas.captions import CAPTION_TOKENS, Captions, caption_view
from specserve.replicas.model.image_tokens import VIRTUAL_BASE, draft_view, placeholder_for, pooled_view
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.pictures import image_prompt_ids, image_store
from specserve.replicas.vlm import language_model, tokens_per_image
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
    expanded = [t for i in text_ids for t in ([i] * tokens_per_image(model.config) if i == IMAGE_TOKEN else [i])]
    ids = torch.tensor([expanded], device=model.device)
    pixels = store.prepare(image).pixels[None].to(model.device)
    out = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_image_tokens_are_virtual_ids_named_by_the_picture(vlm):
    _, _, store = vlm
    a, b = store.register(picture(1)), store.register(picture(2))
    assert len(a) == tokens_per_image(vlm[0].config) and all(t >= VIRTUAL_BASE for t in a)
    assert a == store.register(picture(1)) and a != b   # the content names the ids
    prompt = image_prompt_ids([5, IMAGE_TOKEN, 6], [picture(1)], store.register, IMAGE_TOKEN)
    assert prompt == [5, *a, 6]
    assert draft_view(prompt, IMAGE_TOKEN) == [5] + [IMAGE_TOKEN] * len(a) + [6]
    assert placeholder_for(store, prompt) == IMAGE_TOKEN and placeholder_for(store, [5, 6]) is None
    with pytest.raises(ValueError, match="placeholder"):
        image_prompt_ids([5, 6], [picture(1)], store.register, IMAGE_TOKEN)


def test_the_prompts_perplexity_scores_its_words_and_not_its_pictures_image_tokens(vlm):
    """The router's prompt perplexity, scored in the prefill: a row that predicts an image token
    (a picture's row, no word of the vocabulary) is left out, not indexed into the output layer."""
    _, lm, store = vlm
    prompt = image_prompt_ids(TEXT, [picture(1)], store.register, IMAGE_TOKEN)
    done = Target(lm, images=store).prefill(0, prompt[:-1], len(prompt), prompt[-1], score_rows=len(prompt))
    words = [t for t in prompt[1:] if t < VIRTUAL_BASE]
    assert done.scored == len(words) < len(prompt) - 1
    assert 0 < done.nll < float("inf")


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


def test_every_window_and_tree_policy_keeps_image_requests_lossless(vlm):
    """The deployment's policies adapt VLM requests as they do text ones (SAGE's and ADT-Tree's
    trees included): the output is the VLM's own whichever adapts the window or tree."""
    from specserve.policies.registry import POLICIES, TREE_POLICY_NAMES, build_policy

    model, lm, store = vlm
    prompt = image_prompt_ids(TEXT, [picture(11)], store.register, IMAGE_TOKEN)
    expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
    drafts = {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())}
    drafted = {}
    for name in POLICIES:
        speculation = {"tree": TreeShape(3, 2, 6)} if name in TREE_POLICY_NAMES else {"window": 3}
        request = SpecRequest(prompt, NEW_TOKENS, GREEDY, "prompt-lookup", request_id=name,
                              image_placeholder=IMAGE_TOKEN, **speculation)
        got = run_batch(Target(lm, images=store), drafts, [request], policy=build_policy(name))[0]
        assert got.token_ids == expected, name
        drafted[name] = got.stats.accepted
    # Policies that learn from measured step times (q-learning, load-aware) may turn speculation
    # off for a whole request; the rest must have drafted, or the test means nothing.
    assert sum(1 for accepted in drafted.values() if accepted > 0) >= len(POLICIES) // 2, drafted


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
    assert not set(first[before:before + tokens_per_image(model.config)]) & set(target.kv.tokens[0])   # picture 5's are gone
    again = run(other)
    assert again.token_ids == got.token_ids and store.encoded_images == encoded + 1


ALL_VIEWS = ("multimodal", "text-only", "pooled")
VIEW_CASES = [((view,), "adaptive") for view in ALL_VIEWS] + [(ALL_VIEWS, "adaptive"), (ALL_VIEWS, "static")]


@pytest.mark.parametrize("views, weights", VIEW_CASES, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_tabed_views_and_their_ensembles_equal_plain(vlm, views, weights):
    """TABED's views of a VLM request as rows of one draft forward (one view alone, or mixed): the
    multimodal view reads the pictures through the target's image store, the pooled view their
    averaged blocks; whatever the mix, the output is the target's."""
    model, lm, store = vlm
    near = perturbed(lm, seed=1)
    server = in_process_server("near", DraftLM("near", near), ensemble={"views": views, "weights": weights},
                               images=store)
    accepted = 0
    for seed in (1, 2):
        prompt = image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN)
        expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        request = SpecRequest(prompt, NEW_TOKENS, GREEDY, "near", 3, request_id=f"{seed}", image_placeholder=IMAGE_TOKEN)
        got = run_batch(Target(lm, images=store), {"near": server}, [request])[0]
        assert got.token_ids == expected, f"{views} {weights} picture {seed}"
        accepted += got.stats.accepted
    assert accepted > 0


def test_the_pooled_view_averages_blocks_of_the_patch_grid(vlm):
    model, lm, store = vlm
    prompt = image_prompt_ids([5, IMAGE_TOKEN, 6], [picture(7)], store.register, IMAGE_TOKEN)
    pooled = pooled_view(prompt, store.pooled)
    assert len(pooled) == 2 + store.pooled and pooled[0] == 5 and pooled[-1] == 6
    rows = store.rows(torch.tensor(prompt[1:-1])).view(4, 4, -1)   # the tiny tower's 4 x 4 grid
    means = store.rows(torch.tensor(pooled[1:-1]))
    assert torch.allclose(means[0], rows[:2, :2].reshape(-1, rows.shape[-1]).mean(0))
    assert torch.allclose(means[3], rows[2:, 2:].reshape(-1, rows.shape[-1]).mean(0))


@pytest.fixture()
def captioned(vlm):
    """A store of its own whose captions the tiny VLM writes: its "tokenizer" reads and writes ids
    as decimal words (the tiny vocabulary has no text)."""
    model, lm, _ = vlm
    store = image_store(model, SiglipImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}))
    store.captions = Captions(lambda text: [int(w) for w in text.split() if w.isdigit()],
                              lambda ids: " ".join(map(str, ids)), [5, IMAGE_TOKEN, 9], IMAGE_TOKEN)
    return model, lm, store


@pytest.mark.parametrize("views", [("caption",), (*ALL_VIEWS, "caption")], ids="+".join)
def test_the_caption_view_reads_the_vlms_own_caption_and_stays_lossless(captioned, views):
    """The first request showing a picture has the VLM caption it beside (an internal request:
    its greedy answer to the caption prompt), the view reading the placeholder until then; a
    second request finds the caption written; the output is the target's either way."""
    model, lm, store = captioned
    server = in_process_server("near", DraftLM("near", perturbed(lm, seed=1)), ensemble={"views": views},
                               images=store)
    captions = store.captions
    assert captions.readers == {"near"}
    prompt = image_prompt_ids(TEXT, [picture(9)], store.register, IMAGE_TOKEN)
    (digest,) = captions.digests(prompt)
    assert caption_view(prompt, captions, IMAGE_TOKEN) == draft_view(prompt, IMAGE_TOKEN)   # none written yet
    expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
    caption_prompt = image_prompt_ids([5, IMAGE_TOKEN, 9], [picture(9)], store.register, IMAGE_TOKEN)
    written = speculative_generate(Target(lm, images=store), None, caption_prompt, CAPTION_TOKENS, GREEDY).token_ids
    for n in (1, 2):
        request = SpecRequest(prompt, NEW_TOKENS, GREEDY, "near", 3, request_id=f"r{n}", image_placeholder=IMAGE_TOKEN)
        (got,) = run_batch(Target(lm, slots=2, images=store), {"near": server}, [request])   # the caption: not returned
        assert got.token_ids == expected, f"request {n}"
        assert captions.written_captions == 1   # once per picture
    assert captions.get(digest) == written   # the VLM's own greedy caption
    view = caption_view(prompt, captions, IMAGE_TOKEN)
    at = TEXT.index(IMAGE_TOKEN)
    assert view == [*TEXT[:at], *written, *TEXT[at + 1:]]


def test_captions_are_written_only_for_requests_drafted_through_a_caption_view(captioned):
    model, lm, store = captioned
    drafts = {name: in_process_server(name, DraftLM(name, perturbed(lm, seed=1)), ensemble={"views": views},
                                      images=store)
              for name, views in (("captioning", ("caption",)), ("pictures", ("multimodal",)))}
    prompt = image_prompt_ids(TEXT, [picture(10)], store.register, IMAGE_TOKEN)
    for draft in ("none", "pictures"):
        request = SpecRequest(prompt, 4, GREEDY, draft, 0 if draft == "none" else 3, request_id=draft,
                              image_placeholder=IMAGE_TOKEN)
        run_batch(Target(lm, images=store), drafts, [request])
    assert store.captions.written_captions == 0 and store.captions.get(store.captions.digests(prompt)[0]) is None
    request = SpecRequest(prompt, 4, GREEDY, "captioning", 3, request_id="captioning", image_placeholder=IMAGE_TOKEN)
    run_batch(Target(lm, images=store), drafts, [request])
    assert store.captions.written_captions == 1


def test_picture_views_need_the_targets_image_store(vlm):
    with pytest.raises(ValueError, match="read pictures"):
        in_process_server("near", DraftLM("near", perturbed(vlm[1], seed=1)), ensemble={"views": ("multimodal",)})


@pytest.mark.slow
def test_sampled_output_through_the_mixed_views_follows_the_vlm(vlm):
    """Sampling (t = 1): the first two tokens after a picture, drafted by the three views' mix and
    verified against it, are distributed as the VLM's own (chi-square against its exact joint,
    computed by its forward with the pixels)."""
    from chi_square import chi_square_pvalue
    from specserve.replicas.sampling import logits_to_probs
    from tiny_models import VOCAB

    model, lm, store = vlm
    params = SamplingParams(temperature=1.0)
    prompt = image_prompt_ids(TEXT, [picture(8)], store.register, IMAGE_TOKEN)
    # The language model over the prompt's embeddings, the picture's rows in its image tokens (the
    # rows plain decoding reads, equal to the VLM's own generate above): a second token equal to
    # the placeholder id is text there, which the VLM's forward would take for a picture's slot.
    weight = lm.get_input_embeddings().weight
    with torch.inference_mode():
        embeds = image_tokens.embed(torch.tensor([prompt]), weight, store)
        first = logits_to_probs(lm(inputs_embeds=embeds).logits[0, -1], params)
        rows = torch.cat([embeds.expand(VOCAB, -1, -1), weight[torch.arange(VOCAB)][:, None]], dim=1)
        second = logits_to_probs(lm(inputs_embeds=rows).logits[:, -1], params)
    joint = first[:, None] * second
    server = in_process_server("near", DraftLM("near", perturbed(lm, seed=1)), ensemble={"views": ALL_VIEWS},
                               images=store)
    requests = [SpecRequest(prompt, 3, SamplingParams(1.0, seed=seed), "near", 2, request_id=f"s{seed}",
                            image_placeholder=IMAGE_TOKEN) for seed in range(3000)]
    gens = run_batch(Target(lm, slots=16, images=store), {"near": server}, requests)
    counts = torch.zeros(VOCAB, VOCAB)
    for gen in gens:
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
    assert chi_square_pvalue(counts, joint) > 1e-3
    assert sum(gen.stats.accepted for gen in gens) > 150


@pytest.fixture(scope="module")
def hsr_head(vlm):
    from tiny_hsr import trained_hsr_head

    return trained_hsr_head(vlm[1], steps=120)


def test_the_windowed_hsr_draft_caches_text_anchors_only(vlm, hsr_head):
    """Sparrow's VATA: the head's cache holds the text positions of a VLM prompt, never its image
    tokens; the full-attention head holds every position."""
    from specserve.replicas.drafts.hsr_draft import HSRDraft

    model, lm, store = vlm
    prompt = image_prompt_ids([5, 6, IMAGE_TOKEN, 7, IMAGE_TOKEN, 8, 9, 5, 6], [picture(9), picture(10)],
                              store.register, IMAGE_TOKEN)
    context = draft_view(prompt, IMAGE_TOKEN)
    with torch.inference_mode():
        embeds = image_tokens.embed(torch.tensor([prompt]), lm.get_input_embeddings().weight, store)
        states = lm(inputs_embeds=embeds, output_hidden_states=True).hidden_states[-2][0]
    root = len(context) - 1
    for windowed, want in ((False, list(range(1, root + 1))),
                           (True, [p for p in range(1, root + 1) if context[p] != IMAGE_TOKEN])):
        draft = HSRDraft("hsr", hsr_head, windowed=windowed)
        proposal = draft.propose(context, 3, GREEDY, None, features=states[:root], features_start=0,
                                 image_placeholder=IMAGE_TOKEN)
        assert len(proposal.tokens) == 3
        assert draft.session.cached == want and draft.session.cache_len == len(want)


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "windowed"])
@pytest.mark.parametrize("speculation", [{"window": 3}, {"tree": TreeShape(3, 2, 6)}], ids=["chain", "tree"])
def test_hsr_drafts_on_image_prompts_equal_plain(vlm, hsr_head, windowed, speculation):
    from specserve.replicas.drafts.hsr_draft import HSRDraft

    model, lm, store = vlm
    accepted = 0
    for seed in (1, 2):
        prompt = image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN)
        expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        got = speculative_generate(Target(lm, images=store), HSRDraft("hsr", hsr_head, windowed=windowed), prompt,
                                   NEW_TOKENS, GREEDY, **speculation)
        assert got.token_ids == expected, f"picture {seed}"
        accepted += got.stats.accepted
    assert accepted > 0


def test_an_idefics3_class_vlm_decodes_as_its_own_generate_and_speculates_losslessly():
    """SmolVLM's architecture (Idefics3: a pixel-shuffle connector, pictures as a 5-D batch): the
    same image tokens and store; plain decoding equals its generate, drafts equal plain."""
    from tiny_models import tiny_idefics3

    model = tiny_idefics3(seed=0)
    store = image_store(model, SiglipImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}))
    lm = language_model(model)
    near = perturbed(lm, seed=1)
    for seed in (1, 2):
        prompt = image_prompt_ids(TEXT, [picture(seed)], store.register, IMAGE_TOKEN)
        expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        expanded = [t for i in TEXT for t in ([i] * tokens_per_image(model.config) if i == IMAGE_TOKEN else [i])]
        ids = torch.tensor([expanded], device=model.device)
        hf = model.generate(input_ids=ids, pixel_values=store.prepare(picture(seed)).pixels[None, None].to(model.device),
                            attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert expected == hf[0, ids.shape[1]:].tolist(), f"picture {seed}"
        for draft, speculation in ((PromptLookupDraft(), {"window": 3}), (PromptLookupDraft(), {"tree": TreeShape(3, 2, 6)}),
                                   (DraftLM("near", near), {"window": 3})):
            got = speculative_generate(Target(lm, images=store), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
            assert got.token_ids == expected, f"{draft.name} {speculation} picture {seed}"
        server = in_process_server("near", DraftLM("near", near), ensemble={"views": ALL_VIEWS}, images=store)
        request = SpecRequest(prompt, NEW_TOKENS, GREEDY, "near", 3, request_id=f"i{seed}", image_placeholder=IMAGE_TOKEN)
        assert run_batch(Target(lm, images=store), {"near": server}, [request])[0].token_ids == expected


@pytest.mark.reference
def test_an_idefics3_processors_prompt_and_pixels_are_followed():
    """SmolVLM's processor (Idefics3's, built here over the reference tokenizer): a picture's image
    tokens sit between the markers the processor puts around its global image, and its pixels are
    the processor's, so the prompt is the processor's own with the image tokens as picture ids."""
    from PIL import Image
    from types import SimpleNamespace

    from specserve.replicas.model.image_tokens import picture_ids
    from specserve.replicas.model_store import load_tokenizer_and_config
    from specserve.replicas.pictures import picture_markers, picture_preparer, pixel_preparer
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    tokenizer, _ = load_tokenizer_and_config()
    processor = Idefics3Processor(Idefics3ImageProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 16}),
                                  tokenizer, image_seq_len=4)
    image_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    before, after = picture_markers(processor)
    assert before[0] == after[-1] == tokenizer.convert_tokens_to_ids(processor.fake_image_token) and image_id not in before
    text = f"Look: {processor.image_token} and {processor.image_token} - which is red?"
    images = [Image.new("RGB", (40, 30), (200, 10, 10)), Image.new("RGB", (20, 36), (10, 10, 200))]
    theirs = processor(text=text, images=images, add_special_tokens=False, do_image_splitting=False, return_tensors="pt")
    prepare = pixel_preparer(SimpleNamespace(image_seq_length=4), processor.image_processor)
    pixels = [prepare(image) for image in images]
    for mine, expected in zip(pixels, theirs["pixel_values"][0]):
        assert torch.equal(mine.pixels, expected)
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = image_prompt_ids(text_ids, pixels, lambda p: [*before, *picture_ids(p), *after], image_id)
    assert [image_id if t >= VIRTUAL_BASE else t for t in ours] == theirs["input_ids"][0].tolist()

    # The processor's own setting splits pictures: each is its tiles and global image among the
    # markers the processor writes (rows and columns), token for token.
    tiled = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    prepared = [picture_preparer(processor, SimpleNamespace(image_seq_length=4))(image) for image in images]
    assert all(len(p.units) > 1 for p in prepared)
    units = [u.pixels for p in prepared for u in p.units]
    assert torch.equal(torch.stack(units), tiled["pixel_values"][0])
    ours = image_prompt_ids(text_ids, prepared, lambda p: p.ids(picture_ids), image_id)
    assert [image_id if t >= VIRTUAL_BASE else t for t in ours] == tiled["input_ids"][0].tolist()


def test_a_qwen2_vl_class_vlm_decodes_as_its_own_generate_and_speculates_losslessly():
    """Qwen2-VL's class: pictures at their native resolution (grids of their own), flattened
    patches, a merger, and M-RoPE positions (a picture's tokens at (t, h, w) of its grid, the text
    after it resumed at the grid's longer side). Plain decoding equals its
    generate with the pixels and grids, through our forward's flat and padded layouts and through
    the model's own; drafts, chains and trees equal plain; an image request batched with a text
    request equals each alone."""
    from specserve.replicas.model.image_tokens import Grid
    from tiny_models import VISION_END, VISION_START, tiny_qwen2_vl, tiny_qwen2_vl_processor

    from PIL import Image

    model = tiny_qwen2_vl(seed=0)
    processor = tiny_qwen2_vl_processor()
    store = image_store(model, processor)
    odd = Image.new("RGB", (40, 24), (200, 10, 10))   # native resolution: whole merged patches within the bounds
    theirs = processor(odd, return_tensors="pt")
    _, height, width = theirs["image_grid_thw"][0].tolist()
    mine = store.prepare(odd)
    assert mine.pixels.shape[:2] == (height // 2, width // 2) and height != width
    assert torch.equal(mine.pixels.reshape(theirs["pixel_values"].shape), theirs["pixel_values"])
    assert mine.grid == Grid(height * width // 4, width // 2)
    lm = language_model(model)
    near = perturbed(lm, seed=1)
    around = [VISION_START, IMAGE_TOKEN, VISION_END]
    wide, tall = (48, 24), (16, 40)   # 2 x 5 and 5 x 2 image tokens at their native resolution
    cases = {"two pictures": ([5, 6, *around, 7, 8, 5, 6, *around, 9], (picture(1), picture(2).resize(wide))),
             "a prefill past the flat layout": ([5, *around * 5, 7, 5, 6],
                                                (picture(3), picture(4).resize(tall), picture(5).resize(wide),
                                                 picture(6), picture(7).resize(tall)))}
    for case, (text, pictures) in cases.items():
        prompt = image_prompt_ids(text, pictures, store.register, IMAGE_TOKEN)
        expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
        prepared = [store.prepare(p).pixels for p in pictures]
        counts = iter([p.shape[0] * p.shape[1] for p in prepared])
        ids = torch.tensor([[t for i in text for t in ([i] * next(counts) if i == IMAGE_TOKEN else [i])]],
                           device=model.device)
        grid = torch.tensor([[1, p.shape[0] * 2, p.shape[1] * 2] for p in prepared], device=model.device)
        pixels = torch.cat([p.reshape(-1, p.shape[-1] // 4) for p in prepared])
        hf = model.generate(input_ids=ids, pixel_values=pixels.to(model.device),
                            image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                            attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert expected == hf[0, ids.shape[1]:].tolist(), case
        own = Target(lm, images=store)
        own.kv._fast = None   # the model's own forward, given (t, h, w) position rows
        assert speculative_generate(own, None, prompt, NEW_TOKENS, GREEDY).token_ids == expected, case
        for draft, speculation in ((PromptLookupDraft(), {"window": 3}), (PromptLookupDraft(), {"tree": TreeShape(3, 2, 6)}),
                                   (DraftLM("near", near), {"window": 3}), (DraftLM("near", near), {"tree": TreeShape(3, 2, 6)})):
            got = speculative_generate(Target(lm, images=store), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
            assert got.token_ids == expected, f"{case}: {draft.name} {speculation}"
    requests = [SpecRequest(prompt, NEW_TOKENS, GREEDY, "prompt-lookup", 3, request_id="image",
                            image_placeholder=IMAGE_TOKEN),
                SpecRequest([5, 6, 7, 8, 9, 5, 6, 7], NEW_TOKENS, GREEDY, "prompt-lookup", 3, request_id="text")]
    drafts = {"prompt-lookup": in_process_server("prompt-lookup", PromptLookupDraft())}
    together = run_batch(Target(lm, slots=2, images=store), drafts, requests)
    for request, got in zip(requests, together):
        assert got.token_ids == run_batch(Target(lm, slots=1, images=store), drafts, [request])[0].token_ids



@pytest.mark.parametrize("kind, fps, times", [("qwen2-vl", None, [0, 1, 2]), ("qwen2.5-vl", 2.5, [0, 1, 3])])
def test_a_qwen2_vl_class_vlm_reads_a_clip_as_temporal_patches_as_its_own_generate_does(kind, fps, times):
    """A clip on Qwen2-VL's and Qwen2.5-VL's classes: two frames a temporal patch (the last frame
    repeated to fill the last patch, as its video processor does), each patch a unit on the
    frames' grid, the patches a time step apart in M-RoPE (Qwen2.5-VL: 2 tokens a second at the
    clip's 2.5 frames a second, 1.6 steps a patch). Plain decoding equals the model's own generate
    given the same patches as its video input, with a picture and text around; drafts equal plain."""
    from PIL import Image

    from tiny_models import VIDEO_TOKEN, VISION_END, VISION_START, tiny_qwen2_vl, tiny_qwen2_vl_processor

    model = tiny_qwen2_vl(seed=0, kind=kind)
    processor = tiny_qwen2_vl_processor()
    store = image_store(model, processor)
    lm = language_model(model)
    # A moving square: what the model reads depends on every frame (5 frames: 3 patches).
    frames = [Image.new("RGB", (48, 24), (20, 20, 20)) for _ in range(5)]
    for k, frame in enumerate(frames):
        frame.paste((230, 40 * k, 10), (8 * k, 4, 8 * k + 12, 16))
    clip = store.clip(frames, fps)
    assert len(clip.units) == 3 and [u.continues for u in clip.units] == [False, True, True]
    assert [u.advance for u in clip.units[1:]] == [b - a for a, b in zip(times, times[1:])]
    still = store.clip([frames[0], frames[0]]).units[0]
    assert torch.equal(still.pixels, store.prepare(frames[0]).pixels)   # a still picture holds its frame twice
    around = [VISION_START, VIDEO_TOKEN, VISION_END]
    text = [5, 6, *around, 7, 8, VISION_START, IMAGE_TOKEN, VISION_END, 9]
    prompt = image_prompt_ids(image_prompt_ids(text, [picture(1)], store.register, IMAGE_TOKEN),
                              [frames], lambda shown: store.register_clip(shown, fps), VIDEO_TOKEN)
    expected = speculative_generate(Target(lm, images=store), None, prompt, NEW_TOKENS, GREEDY).token_ids
    units = [u.pixels for u in clip.units]
    image = store.prepare(picture(1)).pixels
    counts = {VIDEO_TOKEN: sum(u.shape[0] * u.shape[1] for u in units), IMAGE_TOKEN: image.shape[0] * image.shape[1]}
    ids = torch.tensor([[t for i in text for t in [i] * counts.get(i, 1)]], device=model.device)
    flat = lambda p: p.reshape(-1, p.shape[-1] // 4)   # noqa: E731 - merged tokens back to patches
    types = (ids == IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int()   # text 0, picture 1, video 2
    hf_grids = (torch.tensor([[1, image.shape[0] * 2, image.shape[1] * 2]], device=model.device),
                torch.tensor([[len(units), units[0].shape[0] * 2, units[0].shape[1] * 2]], device=model.device))
    seconds = {} if fps is None else {"second_per_grid_ts": torch.tensor([2 / fps])}
    hf = model.generate(input_ids=ids, pixel_values=flat(image).to(model.device), image_grid_thw=hf_grids[0],
                        pixel_values_videos=torch.cat([flat(u) for u in units]).to(model.device),
                        video_grid_thw=hf_grids[1],
                        mm_token_type_ids=types, **seconds,
                        attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert expected == hf[0, ids.shape[1]:].tolist()
    # The prompt's last logits too, which move with every position (greedy tokens may not).
    from specserve.replicas.model.batch_kv import Feed

    ours = Target(lm, images=store).kv.forward([Feed(0, prompt, 1)])[0][-1]
    with torch.inference_mode():
        theirs = model(input_ids=ids, pixel_values=flat(image).to(model.device), image_grid_thw=hf_grids[0],
                       pixel_values_videos=torch.cat([flat(u) for u in units]).to(model.device),
                       video_grid_thw=hf_grids[1], mm_token_type_ids=types, **seconds).logits[0, -1]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    reversed_clip = image_prompt_ids(image_prompt_ids(text, [picture(1)], store.register, IMAGE_TOKEN),
                                     [frames[::-1]], lambda shown: store.register_clip(shown, fps), VIDEO_TOKEN)
    backwards = Target(lm, images=store).kv.forward([Feed(0, reversed_clip, 1)])[0][-1]
    assert (backwards - ours).abs().max() > 1e-3   # the answer reads the frames' order (float noise: ~1e-6)
    for draft, speculation in ((PromptLookupDraft(), {"window": 3}), (PromptLookupDraft(), {"tree": TreeShape(3, 2, 6)})):
        got = speculative_generate(Target(lm, images=store), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
        assert got.token_ids == expected, f"{draft.name} {speculation}"


def test_qwen2_vl_classes_read_a_clip_as_temporal_patches_others_as_frames():
    """Qwen2-VL's and Qwen2.5-VL's classes read clips as temporal patches; a class without temporal
    patches has no clip reader. Qwen2.5-VL's frame rate bounds: a rate that spreads the patches
    past the grid's longer side, or more than an id's advance can say, is refused."""
    from PIL import Image
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    from specserve.replicas.pictures import DEFAULT_CLIP_FPS, clip_preparer
    from tiny_models import tiny_qwen2_vl_processor

    qwen = tiny_qwen2_vl_processor()
    assert clip_preparer(Qwen2VLConfig(), qwen) is not None
    assert clip_preparer(tiny_llava(seed=0).config, SiglipImageProcessorPil()) is None
    prepare = clip_preparer(Qwen2_5_VLConfig(vision_config={"tokens_per_second": 2}), qwen)
    frames = [Image.new("RGB", (32, 32), (10 * k, 0, 0)) for k in range(4)]   # 4 x 4 tokens, 2 patches
    assert DEFAULT_CLIP_FPS == 2.0 and [u.advance for u in prepare(frames).units[1:]] == [2]
    assert [u.advance for u in prepare(frames, 1.5).units[1:]] == [2]           # 8/3 steps, rounded down
    with pytest.raises(ValueError, match=r"reaches time step 4 .* past the 3 its longer side allows: send a shorter clip"):
        prepare(frames, 1.0)
    for fps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="frame rate"):
            prepare(frames, fps)
    assert [u.advance for u in clip_preparer(Qwen2VLConfig(), qwen)(frames, 0.01).units[1:]] == [1]

def test_a_unit_that_does_not_fit_the_vision_tower_is_refused_as_it_arrives(vlm):
    """Units come from the ingress: one whose grid or pixels do not fit this VLM is a ValueError
    when added (its request fails alone), never a failed encode inside a shared step."""
    from specserve.replicas.model.image_tokens import Grid, PictureUnit
    from tiny_models import tiny_qwen2_vl, tiny_qwen2_vl_processor

    _, _, store = vlm
    good = store.prepare(picture(1))
    assert store.add(good) == store.register(picture(1))
    bad = [PictureUnit(good.pixels, Grid.of(good.grid.count + 1)),                 # another grid
           PictureUnit(good.pixels[:, :8], good.grid),                             # another size
           PictureUnit(good.pixels * float("nan"), good.grid),                     # not numbers
           PictureUnit(good.pixels.to(torch.int32), good.grid),
           PictureUnit(good.pixels[None].expand(2, -1, -1, -1), good.grid, (32, 32)),   # tiles for a whole-picture class
           good.pixels]                                                            # not a unit
    for unit in bad:
        with pytest.raises(ValueError):
            store.add(unit)
    qwen = image_store(tiny_qwen2_vl(seed=0), tiny_qwen2_vl_processor())
    patches = qwen.prepare(picture(2).resize((48, 24)))
    assert patches.grid == Grid(10, 5)
    qwen.add(patches)
    for unit in (PictureUnit(patches.pixels, Grid(10, 2)), PictureUnit(patches.pixels[..., :-1], patches.grid),
                 PictureUnit(patches.pixels, patches.grid, continues=True, advance=2.5),
                 PictureUnit(patches.pixels, patches.grid, continues=True, advance=300)):
        with pytest.raises(ValueError):
            qwen.add(unit)


def test_two_pictures_of_one_digest_are_refused_not_confused(vlm, monkeypatch):
    """A digest names 31-39 bits of a picture: should two pictures share one, the second is
    refused as it arrives (its request fails alone) rather than read as the first."""
    from specserve.replicas.model import image_tokens

    _, _, store = vlm
    first, second = store.prepare(picture(1)), store.prepare(picture(2))
    monkeypatch.setattr(image_tokens, "picture_digest", lambda unit: 12345)
    ids = store.add(first)
    assert store.add(first) == ids   # the same picture again
    with pytest.raises(ValueError, match="collision"):
        store.add(second)
