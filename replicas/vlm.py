"""Vision-language targets: a language model that reads image tokens, and the reference VLM.

A VLM here is a Hugging Face image-text-to-text model of the LLaVA (with LLaVA-NeXT's and
LLaVA-OneVision's any-res), Idefics3 (SmolVLM) or Qwen2-VL (Qwen2.5-VL) class, loaded by the
class its folder's config names: a vision tower turns a picture into a grid of vectors (its
image tokens), a projector (Idefics3: a pixel shuffle and a linear map) maps them into the
language model's embedding space, and they take the places of as many placeholder tokens in
the prompt. After prefill the language model decodes text as any target does.

A picture is read as its folder's processor reads it (``pictures.py``). Without torchvision, a
processor that names a video processor is built without it (``image_only_processor``).

The reference VLM (``smollm2-vlm`` in the zoo) is LLaVA-class: a SigLIP vision tower (96 px, 12 px
patches: 64 image tokens) and LLaVA's two-layer projector, trained from scratch on pictures drawn
here (``data/synthetic_images.py``, ``training/vlm_train.py``), feeding the reference target,
frozen. Its zoo folder stores only the vision tower and projector and names the target in
``text_from``; loading copies the target's own weights in, as the zoo drafts share the target's
embeddings. The video model (``smollm2-vlm-video``) also stores low-rank deltas to the language
model (``TEXT_LORA``), folded into the copied weights at load; embeddings and output rows stay
the target's. The placeholder is the target's unused special token ``<empty_output>``: the language
model's vocabulary stays the target's, so every text draft still fits it (a new ``<image>`` token
would grow the tied embedding and output rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer,
                          LlavaConfig, LlavaForConditionalGeneration, LlavaOnevisionProcessor, LlavaProcessor,
                          Qwen2_5_VLProcessor, Qwen2Config, Qwen2VLProcessor, SiglipVisionConfig)
from transformers import logging as transformers_logging
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
from transformers.utils import is_torchvision_available

from specserve.replicas.model_store import (LoadedModel, default_device, load_causal_lm, load_tokenizer_and_config,
                                            resolve_dtype, resolve_model_path)

IMAGE_PLACEHOLDER = "<empty_output>"
REFERENCE_VLM = "smollm2-vlm"
# The reference VLM taught clips as well (``zoo vlm --clips``): a target of its own, so that the
# drafts trained on ``REFERENCE_VLM``'s answers stay matched to it.
REFERENCE_VIDEO_VLM = "smollm2-vlm-video"
# A folder's low-rank deltas to the language model ``text_from`` names (``training/lora.py``), and
# the config field holding their rank and alpha.
TEXT_LORA = "text_lora.safetensors"
# The classes whose processors hold a video processor (torchvision's).
VIDEO_PROCESSOR_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")

# ChatML as the reference target's own template writes it (its default system turn included), with
# a content list's image parts as the placeholder, each on a line of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "\n{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reference_vlm_config(text_config, image_size: int = 96, patch_size: int = 12, hidden_size: int = 256,
                         layers: int = 4, heads: int = 4, image_token_id: int = 16) -> LlavaConfig:
    """LLaVA over a small SigLIP tower; every patch is an image token (no CLS: strategy "full")."""
    vision = SiglipVisionConfig(image_size=image_size, patch_size=patch_size, hidden_size=hidden_size,
                                intermediate_size=4 * hidden_size, num_hidden_layers=layers,
                                num_attention_heads=heads, vision_use_head=False)
    return LlavaConfig(vision_config=vision, text_config=text_config, image_token_index=image_token_id,
                       image_seq_length=(image_size // patch_size) ** 2, vision_feature_select_strategy="full",
                       vision_feature_layer=-1, tie_word_embeddings=text_config.tie_word_embeddings)


def tokens_per_image(config) -> int:
    """Image tokens per picture of a class whose pictures all have one grid: LLaVA's
    ``image_seq_length``; Idefics3's patches over its pixel shuffle's ``scale_factor`` squared
    (one tile: no image splitting)."""
    length = getattr(config, "image_seq_length", None)
    if length is not None:
        return int(length)
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2)


def image_token_id(config) -> int:
    return int(getattr(config, "image_token_id", None) or config.image_token_index)


def expand_image_tokens(ids: list[int], config) -> list[int]:
    """Each placeholder in ``ids`` as ``tokens_per_image`` of them: the slots the image tokens fill."""
    placeholder, n = image_token_id(config), tokens_per_image(config)
    out: list[int] = []
    for t in ids:
        out.extend([t] * n if t == placeholder else (t,))
    return out


def image_processor(config) -> SiglipImageProcessorPil:
    size = config.vision_config.image_size
    return SiglipImageProcessorPil(size={"height": size, "width": size})


def build_processor(tokenizer, config) -> LlavaProcessor:
    return LlavaProcessor(image_processor=image_processor(config), tokenizer=tokenizer,
                          patch_size=config.vision_config.patch_size, vision_feature_select_strategy="full",
                          chat_template=CHAT_TEMPLATE, image_token=IMAGE_PLACEHOLDER, num_additional_image_tokens=0)


def _text_model(vlm) -> torch.nn.Module:
    """The VLM's language model body (LLaVA: ``language_model``; Idefics3: ``text_model``)."""
    inner = vlm.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def text_weights(model: LlavaForConditionalGeneration) -> list[torch.nn.Parameter]:
    return [*_text_model(model).parameters(), model.lm_head.weight]


def attach_text(model: LlavaForConditionalGeneration, text: LoadedModel) -> None:
    """Copy the language model's weights in (``text``: the causal LM that ``text_from`` names)."""
    with torch.no_grad():
        missing, unexpected = _text_model(model).load_state_dict(text.model.model.state_dict(), strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise ValueError(f"{text.name} does not fit this VLM's language model: missing {missing}, unexpected {unexpected}")
        model.lm_head.weight.copy_(text.model.lm_head.weight)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def merge_text_lora(model, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
    """Fold low-rank deltas into the language model: ``W + (alpha / rank) · B A`` for each layer
    named by a ``<layer>.lora_A`` / ``<layer>.lora_B`` pair (LoRA, as ``training/lora.py`` trains
    it). Every name must be a linear layer of the language model and every shape fit it."""
    body = _text_model(model)
    layers = {k.removesuffix(".lora_A") for k in tensors if k.endswith(".lora_A")}
    if not layers or {f"{n}.lora_{m}" for n in layers for m in "AB"} != set(tensors):
        raise ValueError("text LoRA tensors must come in <layer>.lora_A / <layer>.lora_B pairs")
    fitted = []   # every pair checked before any weight changes: a refused set changes nothing
    for name in sorted(layers):
        try:
            linear = body.get_submodule(name)
        except AttributeError:
            raise ValueError(f"text LoRA names {name!r}, which the language model does not have") from None
        a, b = tensors[f"{name}.lora_A"].float(), tensors[f"{name}.lora_B"].float()
        if (not isinstance(linear, torch.nn.Linear) or a.shape != (rank, linear.in_features)
                or b.shape != (linear.out_features, rank)):
            raise ValueError(f"text LoRA for {name!r} does not fit it (rank {rank})")
        fitted.append((linear, a, b))
    with torch.no_grad():
        for linear, a, b in fitted:
            linear.weight.copy_((linear.weight.float() + (alpha / rank) * (b @ a)).to(linear.weight.dtype))


def build_vlm(text: LoadedModel, config: LlavaConfig) -> LlavaForConditionalGeneration:
    """A new VLM: the vision tower and projector at their initial weights, ``text``'s language model."""
    dtype = text.model.dtype
    model = LlavaForConditionalGeneration(config).to(dtype=dtype, device=text.model.device)
    attach_text(model, text)
    return model.eval()


def load_vlm(name_or_path: str = REFERENCE_VLM, dtype: str = "auto",
             device: str | torch.device | None = None) -> LoadedModel:
    """A VLM from a local folder as ``save_pretrained`` wrote it, of the class its config names
    (LLaVA, Idefics3 / SmolVLM, Qwen2-VL: ``AutoModelForImageTextToText``); a folder whose config
    names ``text_from`` (the zoo's reference VLM) gets that model's language weights.
    ``LoadedModel.tokenizer`` is the processor."""
    path = resolve_model_path(name_or_path)
    device = torch.device(device) if device is not None else default_device()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text_from = getattr(config, "text_from", None)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()   # the text weights are "missing" until attached
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, config=config, local_files_only=True,
                                                            dtype=resolve_dtype(dtype, device))
    finally:
        transformers_logging.set_verbosity(verbosity)
    if text_from:
        text = load_causal_lm(text_from, dtype=dtype, device="cpu")
        attach_text(model, text)
        model.generation_config = text.model.generation_config   # its end-of-turn tokens
        if getattr(config, "text_lora", None):
            from safetensors.torch import load_file

            merge_text_lora(model, load_file(path / TEXT_LORA), **config.text_lora)
    elif getattr(config, "text_lora", None):
        raise ValueError(f"{path} names text_lora but no text_from: the adapters fit the model text_from names")
    processor = load_processor(path)
    return LoadedModel(name=Path(name_or_path).name, model=model.to(device).eval(), tokenizer=processor)


def is_vlm_folder(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a local VLM (its config has a vision tower); False for a GGUF
    file or a name not on disk yet."""
    try:
        path = resolve_model_path(name_or_path)
    except FileNotFoundError:
        return False
    config = path / "config.json"
    return path.is_dir() and config.exists() and "vision_config" in json.loads(config.read_text())


def is_vlm_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_processor(name_or_path: str):
    """A local VLM's processor (its tokenizer, image processor and chat template); a Qwen2-VL or
    LLaVA-OneVision folder's without torchvision, which its video processor needs: its
    processor less the video part (``image_only_processor``)."""
    path = resolve_model_path(name_or_path)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type in VIDEO_PROCESSOR_TYPES and not is_torchvision_available():
        return image_only_processor(path, model_type)
    return AutoProcessor.from_pretrained(path, local_files_only=True)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without the video processor (torchvision's): text and pictures as
    its own processor reads them; clips reach the model as temporal patches prepared from their
    frames (``pictures.clip_preparer``)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without the video processor, as ``ImageOnlyQwen2VLProcessor``."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
    """LLaVA-OneVision's processor without the video processor, as ``ImageOnlyQwen2VLProcessor``."""

    def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None, vision_feature_select_strategy=None,
                 chat_template=None, image_token="<image>", video_token="<video>", vision_aspect_ratio="anyres_max_9",
                 **kwargs):
        super().__init__(image_processor, tokenizer, None, num_image_tokens, vision_feature_select_strategy,
                         chat_template, image_token, video_token, vision_aspect_ratio, **kwargs)


def image_only_processor(path: Path, model_type: str):
    """A folder's processor from its parts on disk (the image processor's settings, the tokenizer,
    the chat template, the processor's own settings), without a video processor."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    chat_template = getattr(tokenizer, "chat_template", None)
    if (path / "chat_template.jinja").exists():
        chat_template = (path / "chat_template.jinja").read_text()
    elif (path / "chat_template.json").exists():   # as older processors saved it
        chat_template = json.loads((path / "chat_template.json").read_text()).get("chat_template", chat_template)
    settings_file = path / "processor_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.exists() else {}
    if model_type == "llava_onevision":
        keep = ("num_image_tokens", "vision_feature_select_strategy", "image_token", "vision_aspect_ratio")
        return ImageOnlyLlavaOnevisionProcessor(
            LlavaOnevisionImageProcessorPil.from_pretrained(path, local_files_only=True), tokenizer,
            chat_template=chat_template, **{k: settings[k] for k in keep if k in settings})
    cls = ImageOnlyQwen2_5_VLProcessor if model_type == "qwen2_5_vl" else ImageOnlyQwen2VLProcessor
    return cls(Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True), tokenizer, chat_template=chat_template)


@dataclass(frozen=True)
class TargetText:
    """How a target reads and writes text: its tokenizer and, for a VLM, its processor (the chat
    template with pictures, the image processor). ``config`` is the model's own (a VLM's holds its
    vision tower), ``text_config`` its language model's."""

    tokenizer: object
    config: object
    processor: object | None = None

    @property
    def text_config(self):
        return getattr(self.config, "text_config", None) or self.config


def target_text(tokenizer_or_processor, config) -> TargetText:
    """A target's text side from what loading it gave: a VLM comes with a processor where a text
    model has its tokenizer (``load_vlm``), and its tokenizer is the processor's own."""
    if is_vlm_config(config):
        return TargetText(tokenizer_or_processor.tokenizer, config, tokenizer_or_processor)
    return TargetText(tokenizer_or_processor, config)


def load_target_text(name_or_path: str) -> TargetText:
    """A target's text side without its weights: what the ingress tokenizes and checks with."""
    tokenizer, config = load_tokenizer_and_config(name_or_path)
    return target_text(load_processor(name_or_path) if is_vlm_config(config) else tokenizer, config)


def is_vlm(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def language_model(vlm) -> torch.nn.Module:
    """A causal LM over the VLM's language model and output layer (shared, not copied): what the
    target's forward runs once the image tokens are embedded."""
    config = vlm.config.text_config
    if type(config).__name__ in ("Qwen2VLTextConfig", "Qwen2_5_VLTextConfig"):
        # No causal-LM class of its own: Qwen2's has the same layers and output layer, and the
        # body below is the VLM's own (its M-RoPE rotary included).
        config = Qwen2Config(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    lm.model, lm.lm_head = _text_model(vlm), vlm.lm_head
    lm.generation_config = vlm.generation_config
    return lm.eval()

