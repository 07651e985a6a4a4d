"""Tiny random causal LMs built from configs, for tests that need no trained weights.

Greedy equality holds for any weights, so random ones test the machinery; a small vocabulary
keeps distribution tests cheap. ``scale`` sharpens the output layer so that random models have
confident, non-trivial next-token distributions instead of near-uniform ones.

``SPECSERVE_TEST_DEVICE=cuda`` builds them on that device, so the lossless tests (greedy
equality, the distribution tests) check the engine's device paths too (the padded layout, the
samplers' generators); the default is the CPU.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from specserve.replicas.drafts.pruned_head import PrunedHeadConfig, PrunedHeadLlamaForCausalLM

VOCAB = 96
ARCHITECTURES = ("llama", "gpt2", "qwen2")
DEVICE = torch.device(os.environ.get("SPECSERVE_TEST_DEVICE", "cpu"))


def tiny_config(arch: str, layers: int = 2, hidden: int = 64):
    if arch == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")


def tiny_model(arch: str, seed: int, layers: int = 2, hidden: int = 64, scale: float = 8.0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers, hidden), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model.to(DEVICE).eval()


def perturbed(model, seed: int, noise: float = 0.5):
    """A draft that agrees with the target often but not always: its weights plus noise."""
    draft = tiny_model(model.config.model_type, seed=0)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen).to(param.device) * noise * param.std())
    return draft


def rounded_to_int8_rows(model) -> None:
    """Every linear's weight replaced, in place, by the int8 rows ``quantization: int8`` multiplies
    with (``int8_linear.quantize_rows``): the module path then computes what the int8 path does."""
    from specserve.replicas.model.int8_linear import quantize_rows

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(q.float() * scale[:, None])


IMAGE_TOKEN = 3          # the tiny VLM's image placeholder (an id of its vocabulary)
TINY_IMAGE_SIZE = 32     # 8 px patches: 16 image tokens a picture


def tiny_llava(seed: int, scale: float = 8.0):
    """A LLaVA-class VLM: a one-layer SigLIP tower, LLaVA's projector and the tiny Llama."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=TINY_IMAGE_SIZE, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, vision_use_head=False)
    config = LlavaConfig(vision_config=vision, text_config=tiny_config("llama"), image_token_index=IMAGE_TOKEN,
                         image_seq_length=(TINY_IMAGE_SIZE // 8) ** 2, vision_feature_select_strategy="full",
                         vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = None   # compared over a fixed length, as the engine runs here
    return model.to(DEVICE).eval()


def tiny_idefics3(seed: int, scale: float = 8.0):
    """An Idefics3-class VLM (SmolVLM's architecture): a one-layer tower, a pixel-shuffle connector
    (4 x 4 patches shuffled by 2: 4 image tokens a picture) and the tiny Llama."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    vision = {"image_size": TINY_IMAGE_SIZE, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    config = Idefics3Config(vision_config=vision, text_config=tiny_config("llama").to_dict(),
                            image_token_id=IMAGE_TOKEN, scale_factor=2)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = None
    return model.to(DEVICE).eval()


VLM_FOLDER_KINDS = ("llava", "llava-next", "llava-onevision", "idefics3", "idefics3-tiles", "qwen2-vl", "qwen2.5-vl")


def tiny_vlm_folder(kind: str, folder, seed: int = 0):
    """A VLM of class ``kind`` with random weights over the reference tokenizer, written as
    ``save_pretrained`` writes one (config, weights, the processor with its chat template): a
    folder a user would point specserve at. Returns the folder."""
    from pathlib import Path

    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              LlavaForConditionalGeneration)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from specserve.replicas.model_store import load_tokenizer_and_config
    from specserve.replicas.vlm import CHAT_TEMPLATE, IMAGE_PLACEHOLDER, build_processor, reference_vlm_config

    tokenizer, _ = load_tokenizer_and_config()
    torch.manual_seed(seed)
    if kind == "llava":
        text = tiny_config("llama")
        text.vocab_size = len(tokenizer)
        config = reference_vlm_config(text, image_size=TINY_IMAGE_SIZE, patch_size=8, hidden_size=32, layers=1,
                                      heads=2, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER))
        processor, model = build_processor(tokenizer, config), LlavaForConditionalGeneration(config)
    elif kind in ("idefics3", "idefics3-tiles"):
        # SmolVLM's processor: 32 px tiles, 16 patches shuffled by 2 into 4 image tokens each; a
        # picture resized to 32 px (one tile: the global image alone) or, with tiles, to 64 px
        # (up to 2 x 2 tiles beside the global image).
        longest = 2 * TINY_IMAGE_SIZE if kind == "idefics3-tiles" else TINY_IMAGE_SIZE
        processor = Idefics3Processor(Idefics3ImageProcessorPil(size={"longest_edge": longest},
                                                                max_image_size={"longest_edge": TINY_IMAGE_SIZE}),
                                      tokenizer, image_seq_len=4,
                                      chat_template=CHAT_TEMPLATE.replace(IMAGE_PLACEHOLDER, "<image>"))
        text = tiny_config("llama").to_dict()
        text["vocab_size"] = len(processor.tokenizer)   # the processor's marker tokens added
        vision = {"image_size": TINY_IMAGE_SIZE, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 1, "num_attention_heads": 2}
        config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                                image_token_id=processor.tokenizer.convert_tokens_to_ids("<image>"))
        model = Idefics3ForConditionalGeneration(config)
    elif kind in ("qwen2-vl", "qwen2.5-vl"):
        processor, model = _tiny_qwen2_vl_folder_parts(tokenizer, kind)
    elif kind in ("llava-next", "llava-onevision"):
        processor, model = _tiny_any_res_folder_parts(tokenizer, kind)
    else:
        raise ValueError(f"unknown VLM class {kind!r}; choose from {VLM_FOLDER_KINDS}")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # a peaked output, so that greedy ties are rare
        for name, param in model.named_parameters():   # pictures loud enough to change the answer
            if any(part in name for part in ("projector", "connector", "merger")) and name.endswith("weight"):
                param.mul_(30.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder = Path(folder)
    model.to(torch.float32).save_pretrained(folder)
    processor.save_pretrained(folder)
    if kind.startswith("qwen"):   # as the class's own processor names itself in a folder
        _rename_processor(folder, "Qwen2_5_VLProcessor" if kind == "qwen2.5-vl" else "Qwen2VLProcessor",
                          "Qwen2VLImageProcessor")
    elif kind == "llava-onevision":
        _rename_processor(folder, "LlavaOnevisionProcessor", "LlavaOnevisionImageProcessor")
    return folder


def _tiny_any_res_folder_parts(tokenizer, kind: str):
    """A LLaVA-NeXT or LLaVA-OneVision class VLM (any-res: a picture as 32 px tiles on the best of a
    few grids, plus the whole picture; its features unpadded to the picture's aspect ratio, a
    newline row end after each row) over a one-layer SigLIP tower (8 px patches: 16 tokens a
    tile) and the reference tokenizer, and its processor (OneVision's without its video part)."""
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor,
                              LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipVisionConfig)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    from specserve.replicas.vlm import CHAT_TEMPLATE, IMAGE_PLACEHOLDER, ImageOnlyLlavaOnevisionProcessor

    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    text = tiny_config("llama")
    text.vocab_size = len(tokenizer)
    vision = SiglipVisionConfig(image_size=TINY_IMAGE_SIZE, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, vision_use_head=False)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    common = dict(vision_config=vision, text_config=text, image_token_index=image_id, image_grid_pinpoints=pinpoints,
                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                  tie_word_embeddings=text.tie_word_embeddings)
    if kind == "llava-next":
        image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TINY_IMAGE_SIZE},
                                                     crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
                                                     image_grid_pinpoints=pinpoints)
        processor = LlavaNextProcessor(image_processor, tokenizer, patch_size=8, vision_feature_select_strategy="full",
                                       chat_template=CHAT_TEMPLATE, image_token=IMAGE_PLACEHOLDER)
        return processor, LlavaNextForConditionalGeneration(LlavaNextConfig(**common))
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
                                                      image_grid_pinpoints=pinpoints)
    processor = ImageOnlyLlavaOnevisionProcessor(image_processor, tokenizer, num_image_tokens=16,
                                                 vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE,
                                                 image_token=IMAGE_PLACEHOLDER)
    return processor, LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(**common))


def folder_generate_clip(folder, frames, question: str, new_tokens: int, fps: float | None = None) -> list[int]:
    """A Qwen2-VL (or Qwen2.5-VL) folder's own greedy answer to a clip of ``fps`` frames a second
    and ``question``: its template's video part expanded to the clip's temporal patches
    (``pictures.clip_preparer``), given to its model's ``generate`` as video input with the
    patches' seconds (its video processor needs torchvision)."""
    from transformers import AutoModelForImageTextToText

    from specserve.replicas.pictures import DEFAULT_CLIP_FPS, clip_preparer
    from specserve.replicas.vlm import load_processor

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)
    content = [{"type": "video"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    units = [u.pixels for u in clip_preparer(model.config, processor.image_processor)(frames, fps).units]
    video, merge = model.config.video_token_id, processor.image_processor.merge_size
    count = sum(u.shape[0] * u.shape[1] for u in units)
    seconds = {}
    if getattr(model.config.vision_config, "tokens_per_second", None) is not None:   # Qwen2.5-VL
        seconds["second_per_grid_ts"] = torch.tensor([processor.image_processor.temporal_patch_size
                                                      / (fps or DEFAULT_CLIP_FPS)])
    ids = torch.tensor([[t for i in processor.tokenizer(text, add_special_tokens=False)["input_ids"]
                         for t in [i] * (count if i == video else 1)]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=2 * (ids == video).int(),
                         pixel_values_videos=torch.cat([u.reshape(-1, u.shape[-1] // merge ** 2) for u in units]),
                         video_grid_thw=torch.tensor([[len(units), units[0].shape[0] * merge, units[0].shape[1] * merge]]),
                         max_new_tokens=new_tokens, do_sample=False, **seconds)
    return out[0, ids.shape[1]:].tolist()


def _tiny_qwen2_vl_folder_parts(tokenizer, kind: str):
    """A Qwen2-VL (or Qwen2.5-VL) class VLM over the reference tokenizer with Qwen's picture and
    video tokens added, and its processor (``vlm.ImageOnlyQwen2VLProcessor``: no torchvision here)
    with a template that writes Qwen's markers around pictures and clips: pictures at their
    native resolution within 16-48 px a side, 4 px patches merged 2 x 2."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from specserve.replicas.vlm import (CHAT_TEMPLATE, IMAGE_PLACEHOLDER, ImageOnlyQwen2_5_VLProcessor,
                                       ImageOnlyQwen2VLProcessor)

    start, pad, end, video = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
    tokenizer.add_special_tokens({"additional_special_tokens": [start, pad, end, video]})
    image_part = "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "\n{% else %}"
    template = CHAT_TEMPLATE.replace(image_part, "{% if part['type'] == 'image' %}" + start + pad + end + "\n"
                                     "{% elif part['type'] == 'video' %}" + start + video + end + "\n{% else %}")
    image_processor = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4, merge_size=2,
                                               temporal_patch_size=2)
    processor_class = ImageOnlyQwen2_5_VLProcessor if kind == "qwen2.5-vl" else ImageOnlyQwen2VLProcessor
    processor = processor_class(image_processor, tokenizer, chat_template=template)
    text = tiny_config("qwen2").to_dict()
    text.update(vocab_size=len(tokenizer),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}
    if kind == "qwen2.5-vl":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": text["hidden_size"],
                  "window_size": 16, "fullatt_block_indexes": [1]}
    config_class, model_class = ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if kind == "qwen2.5-vl"
                                 else (Qwen2VLConfig, Qwen2VLForConditionalGeneration))
    config = config_class(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(pad),
                          video_token_id=tokenizer.convert_tokens_to_ids(video),
                          vision_start_token_id=tokenizer.convert_tokens_to_ids(start),
                          vision_end_token_id=tokenizer.convert_tokens_to_ids(end))
    model = model_class(config)
    with torch.no_grad():   # positions matter to the output (at the initial scale they barely do)
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10)
    return processor, model


def _rename_processor(folder, processor_class: str, image_processor_type: str) -> None:
    import json
    from pathlib import Path

    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(folder) / name
        if path.exists():
            config = json.loads(path.read_text())
            if "processor_class" in config:
                config["processor_class"] = processor_class
            if "image_processor_type" in config:
                config["image_processor_type"] = image_processor_type
            path.write_text(json.dumps(config, indent=2))


VISION_START, VISION_END = 10, 11   # the tiny Qwen2-VL's markers around a picture's image tokens
VIDEO_TOKEN = 12                     # its clip placeholder


def tiny_qwen2_vl(seed: int, scale: float = 8.0, kind: str = "qwen2-vl"):
    """A Qwen2-VL-class VLM (or Qwen2.5-VL's, ``kind``: its windowed tower, clips placed in time by
    2 tokens a second): a one-layer tower over 4 px patches merged 2 x 2 (a 32 px picture: 16
    image tokens) and the tiny Qwen2 with M-RoPE (sections 2, 3, 3 of its 8 frequencies). Its
    queries, keys and embeddings are scaled up so that attention, and so the output, depends on
    the positions (at the initial scale every prompt decodes one token over and over)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    text = tiny_config("qwen2").to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}
    config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    if kind == "qwen2.5-vl":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                  "out_hidden_size": text["hidden_size"], "window_size": 16, "fullatt_block_indexes": [1],
                  "tokens_per_second": 2}
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                          video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                          vision_end_token_id=VISION_END)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10)
            elif name.endswith("embed_tokens.weight"):
                param.mul_(20)
    model.generation_config.eos_token_id = None
    return model.to(DEVICE).eval()


def tiny_qwen2_vl_processor():
    """Its image processor: pictures resized to 32 px squares (the bounds allow 16-32 px)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=4, merge_size=2,
                                    temporal_patch_size=2)


def pruned_copy(model, head: list[int]) -> PrunedHeadLlamaForCausalLM:
    """``model`` itself with its output layer cut down to ``head``."""
    config = PrunedHeadConfig.from_dict({**model.config.to_dict(), "head_token_ids": head})
    pruned = PrunedHeadLlamaForCausalLM(config).eval()
    state = model.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"][head]
    pruned.load_state_dict(state)
    return pruned


def tiny_generator(layout, hidden: int, heads: int, kv_heads: int, context: int, scale: float, layers: int = 2,
                   seed: int | None = None):
    """A tiny class-conditional image generator over ``layout``'s vocabulary (random weights, the
    output layer scaled by ``scale``: peaked distributions keep greedy choices far from ties); seeded
    first when ``seed`` is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=layout.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=context, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def tiny_generator_folder(folder, grid: int = 16, seed: int = 0):
    """A tiny class-conditional image generator saved as ``imagegen.load_generator`` reads it: a
    one-layer Llama over 32 codes and 6 classes, an untrained VQ tokenizer of ``grid`` x ``grid``
    codes beside it, guidance 2 and top-k 8 as its served defaults; its context leaves room for a
    replica's start-up cost probe."""
    import json
    from pathlib import Path

    from specserve.replicas.imagegen import GENERATOR_FILE, GeneratorSettings
    from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer

    folder = Path(folder)
    torch.manual_seed(seed)
    VQTokenizer(VQConfig(channels=8, codebook_size=32, code_dim=4)).eval().save(folder / "vq")
    settings = GeneratorSettings(codebook_size=32, classes=6, grid=grid, tokenizer="../vq", cfg_scale=2.0, top_k=8)
    model = tiny_generator(settings.layout, hidden=32, heads=2, kv_heads=2, context=max(grid * grid + 8, 128),
                           scale=6.0, layers=1)
    model.save_pretrained(folder / "gen")
    (folder / "gen" / GENERATOR_FILE).write_text(json.dumps(settings.__dict__))
    return folder / "gen"


def tiny_generator_draft(generator, noise: float = 0.3, seed: int = 1):
    """A draft for a ``tiny_generator_folder`` generator: its own weights plus noise (agreeing often,
    not always), saved beside it without a tokenizer; returns the folder."""
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM.from_pretrained(generator)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    draft.save_pretrained(generator.parent / "draft")
    return generator.parent / "draft"
