"""Vision-language targets: a language model that reads image tokens, and the reference VLM.

A VLM here is a Hugging Face image-text-to-text model of the LLaVA (with LLaVA-NeXT's and
LLaVA-OneVision's any-res), Idefics3 (SmolVLM) or Qwen2-VL (Qwen2.5-VL) class, loaded by the
class its folder's config names: a vision tower turns a picture into a grid of vectors (its
image tokens), a projector (Idefics3: a pixel shuffle and a linear map) maps them into the
language model's embedding space, and they take the places of as many placeholder tokens in
the prompt. After prefill the language model decodes text as any target does.

A picture is read as its folder's processor reads it (``picture_preparer``): Idefics3's
processor may split a large picture into tiles, each behind marker tokens, beside the whole
picture resized (its "global image"), each tile a unit of the store among the markers of the
processor's own expansion; an any-res picture is its tiles on the best of the processor's
grids beside the whole picture, unpadded to its aspect ratio with a row end after each row,
one unit of as many image tokens as its processor counts. Qwen2-VL's class reads a picture at
its native resolution (its processor's resize to whole merged patches within its pixel bounds)
as flattened patches merged 2 x 2, and places its image tokens with multimodal rotary
positions (``mrope.py``): each picture has its own grid of image tokens, which its ids carry
(``image_tokens.Grid``). Without torchvision, a processor that names a video processor is
built without it (``image_only_processor``). A clip reaches every class as its sampled frames,
pictures one after another (``ingress/images.py``); Qwen2-VL's temporal patches (two frames a
patch) are not used.

The reference VLM (``smollm2-vlm`` in the zoo) is LLaVA-class: a SigLIP vision tower (96 px, 12 px
patches: 64 image tokens) and LLaVA's two-layer projector, trained from scratch on pictures drawn
here (``data/synthetic_images.py``, ``training/vlm_train.py``), feeding the reference target,
frozen. Its zoo folder stores only the vision tower and projector and names the target in
``text_from``; loading copies the target's own weights in, as the zoo drafts share the target's
embeddings. The placeholder is the target's unused special token ``<empty_output>``: the language
model's vocabulary stays the target's, so every text draft still fits it (a new ``<image>`` token
would grow the tied embedding and output rows).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer,
                          LlavaConfig, LlavaForConditionalGeneration, LlavaOnevisionProcessor, LlavaProcessor,
                          Qwen2_5_VLProcessor, Qwen2Config, Qwen2VLProcessor, SiglipVisionConfig)
from transformers import logging as transformers_logging
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from specserve.replicas.captions import CAPTION_PROMPT, Captions
from specserve.replicas.model.image_tokens import Grid, ImageStore, PictureUnit, PreparedPicture
from specserve.replicas.model_store import (LoadedModel, default_device, load_causal_lm, load_tokenizer_and_config,
                                            resolve_dtype, resolve_model_path)

IMAGE_PLACEHOLDER = "<empty_output>"
REFERENCE_VLM = "smollm2-vlm"
# The reference VLM taught clips as well (``zoo vlm --clips``): a target of its own, so that the
# drafts trained on ``REFERENCE_VLM``'s answers stay matched to it.
REFERENCE_VIDEO_VLM = "smollm2-vlm-video"
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


def _is_qwen2_vl_processor(image_processor) -> bool:
    return hasattr(image_processor, "merge_size") and hasattr(image_processor, "temporal_patch_size")


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
    its own processor reads them; clips reach the model as frames."""

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
    template = path / "chat_template.jinja"
    chat_template = template.read_text() if template.exists() else getattr(tokenizer, "chat_template", None)
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


def _one_tile(image_processor) -> dict:
    """Keywords that make an Idefics3-class processor keep a picture whole (its global image, no
    tiles): one unit of the store (a splitting processor's tiles: ``picture_preparer``)."""
    return {"do_image_splitting": False} if hasattr(image_processor, "do_image_splitting") else {}


def _is_any_res(image_processor) -> bool:
    return getattr(image_processor, "image_grid_pinpoints", None) is not None


def pixel_preparer(config, image_processor):
    """``image -> PictureUnit``, as the VLM's processor prepares a picture whole: [3, h, w] on the
    class's one square grid; Qwen2-VL's: its flattened patches at the picture's native
    resolution, grouped by merged token on the picture's own grid [rows, columns, merge² · 3 ·
    temporal · patch²]. An any-res picture needs its processor's expansion (``picture_preparer``)."""
    if _is_any_res(image_processor):
        def counted_by_the_processor(image) -> PictureUnit:
            raise ValueError("an any-res picture's image tokens are counted by its processor: prepare it with "
                             "picture_preparer (a store from target_image_store does)")
        return counted_by_the_processor
    if _is_qwen2_vl_processor(image_processor):
        merge = image_processor.merge_size

        def prepare_patches(image) -> PictureUnit:
            out = image_processor(image.convert("RGB"), return_tensors="pt")
            _, height, width = out["image_grid_thw"][0].tolist()
            rows, columns = height // merge, width // merge
            return PictureUnit(out["pixel_values"].reshape(rows, columns, -1), Grid.of(rows * columns, columns))
        return prepare_patches

    grid = Grid.of(tokens_per_image(config))

    def prepare(image) -> PictureUnit:
        pixels = image_processor(image.convert("RGB"), return_tensors="pt", **_one_tile(image_processor))["pixel_values"]
        while pixels.dim() > 3:   # Idefics3: [batch, pictures, 3, h, w]
            pixels = pixels[0]
        return PictureUnit(pixels, grid)
    return prepare


def picture_markers(processor) -> tuple[list[int], list[int]]:
    """The tokens the VLM's processor puts before and after one picture's image tokens (Idefics3:
    ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``; LLaVA: none),
    read off the processor's own expansion of one picture."""
    image_token = getattr(processor, "image_token", None)
    if image_token is None:
        return [], []
    tokenizer = processor.tokenizer
    ids = processor(text=image_token, images=[Image.new("RGB", (32, 32))], add_special_tokens=False,
                    **_one_tile(processor.image_processor))["input_ids"][0]
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    image = tokenizer.convert_tokens_to_ids(image_token)
    first, last = ids.index(image), len(ids) - 1 - ids[::-1].index(image)
    return ids[:first], ids[last + 1:]


def picture_preparer(processor, config):
    """``image -> PreparedPicture`` as the VLM's processor expands a picture in a prompt: the
    picture whole between the processor's markers (``picture_markers``); read off the
    processor's own expansion of the picture where it splits pictures (Idefics3's
    ``do_image_splitting``: its tiles and global image, each behind its markers) or counts a
    picture's image tokens by its size (any-res: LLaVA-NeXT's and LLaVA-OneVision's unpadded
    tiles and row ends)."""
    image_processor = processor.image_processor
    any_res = _is_any_res(image_processor)
    if not any_res and not getattr(image_processor, "do_image_splitting", False):
        prepare, (before, after) = pixel_preparer(config, image_processor), picture_markers(processor)
        return lambda image: PreparedPicture((prepare(image),), (*before, None, *after))
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)

    def expanded(image) -> PreparedPicture:
        out = processor(text=processor.image_token, images=[image.convert("RGB")], add_special_tokens=False,
                        return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        tokens: list[int | None] = []   # each run of image tokens as one None
        runs: list[int] = []
        for i, t in enumerate(ids):
            if t != image_id:
                tokens.append(t)
            elif i == 0 or ids[i - 1] != image_id:
                tokens.append(None)
                runs.append(1)
            else:
                runs[-1] += 1
        if any_res:   # one unit: the picture's tiles, encoded together and unpadded by its size
            size = tuple(out["image_sizes"][0].tolist())
            units = (PictureUnit(out["pixel_values"][0], Grid.of(runs[0]), size),)
        else:         # [tiles + 1, 3, h, w]: the tiles, then the global image
            units = tuple(PictureUnit(pixels, Grid.of(run)) for pixels, run in zip(out["pixel_values"][0], runs))
        if len(runs) != len(units):
            raise ValueError(f"the processor expanded a picture into {len(runs)} runs of image tokens for "
                             f"{len(units)} units")
        return PreparedPicture(units, tuple(tokens))
    return expanded


def target_image_store(vlm, processor, capacity: int = 512) -> ImageStore:
    """A served VLM's ``ImageStore``: its processor's pixels and markers around each picture, and
    the captions the caption view reads."""
    store = image_store(vlm, processor.image_processor, capacity)
    store.markers = picture_markers(processor)
    store.picture = picture_preparer(processor, vlm.config)
    store.captions = caption_writer(processor, store)
    return store


def image_store(vlm, image_processor, capacity: int = 512) -> ImageStore:
    """The pictures' ``ImageStore``: ``image_processor`` (the processor's) prepares them, the
    vision tower and projector encode them (``get_image_features``: the rows the model's own
    forward scatters into its image tokens; Qwen2-VL's given each picture's patch grid, any-res
    classes each picture's size)."""
    prepare = pixel_preparer(vlm.config, image_processor)
    placeholder = image_token_id(vlm.config)
    if getattr(vlm.model, "visual", None) is not None:   # Qwen2-VL: flattened patches and each picture's grid
        merge = image_processor.merge_size

        def encode_patches(units: list[PictureUnit]) -> list[torch.Tensor]:
            weight = next(vlm.model.visual.parameters())
            thw = torch.tensor([[1, u.pixels.shape[0] * merge, u.pixels.shape[1] * merge] for u in units],
                               device=weight.device)
            patches = torch.cat([u.pixels.reshape(-1, u.pixels.shape[-1] // merge ** 2) for u in units])
            out = vlm.model.get_image_features(pixel_values=patches.to(weight.device, weight.dtype), image_grid_thw=thw)
            return list(getattr(out, "pooler_output", out))

        store = ImageStore(prepare, encode_patches, placeholder, capacity)
        store.check = unit_check(vlm.config, image_processor)
        return store

    idefics = getattr(vlm.model, "vision_model", None) is not None   # Idefics3: pictures per prompt, 5-D

    def encode(units: list[PictureUnit]) -> list[torch.Tensor]:
        tower = vlm.model.vision_model if idefics else vlm.model.vision_tower
        weight = next(tower.parameters())
        if units[0].size is not None:   # any-res: each picture's tiles with its size
            rows = []
            for u in units:
                out = vlm.model.get_image_features(pixel_values=u.pixels[None].to(weight.device, weight.dtype),
                                                   image_sizes=torch.tensor([u.size], device=weight.device))
                rows.append(list(getattr(out, "pooler_output", out))[0])
            return rows
        pixels = torch.stack([u.pixels for u in units]).to(weight.device, weight.dtype)
        out = vlm.model.get_image_features(pixel_values=pixels[:, None] if idefics else pixels)
        features = getattr(out, "pooler_output", out)   # transformers 5: an output object
        return list(features)

    store = ImageStore(prepare, encode, placeholder, capacity)
    store.check = unit_check(vlm.config, image_processor)
    return store


def unit_check(config, image_processor):
    """``unit -> None``: raises ValueError where a prepared unit's pixels do not fit this VLM's
    vision tower or its grid does not fit its pixels (a unit comes from the ingress: input)."""
    vision = config.vision_config
    if _is_qwen2_vl_processor(image_processor):
        width = (image_processor.merge_size ** 2 * getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
                 * image_processor.temporal_patch_size * image_processor.patch_size ** 2)

        def check_patches(unit: PictureUnit) -> None:
            pixels = unit.pixels
            if pixels.dim() != 3 or pixels.shape[2] != width or \
                    unit.grid != Grid(pixels.shape[0] * pixels.shape[1], pixels.shape[1]):
                raise ValueError(f"a picture of {tuple(pixels.shape)} patches on {unit.grid} does not fit this "
                                 f"VLM's [rows, columns, {width}]")
        return check_patches
    side = vision.image_size
    any_res = _is_any_res(image_processor)
    fixed = None if any_res else Grid.of(tokens_per_image(config))

    def check_tiles(unit: PictureUnit) -> None:
        pixels = unit.pixels
        tiles = pixels.dim() == 4 and any_res and unit.size is not None and len(unit.size) == 2 \
            and all(isinstance(x, int) and x > 0 for x in unit.size)
        whole = pixels.dim() == 3 and not any_res and unit.grid == fixed
        if not (tiles or whole) or tuple(pixels.shape[-3:]) != (3, side, side):
            raise ValueError(f"a picture of {tuple(pixels.shape)} pixels on {unit.grid} does not fit this VLM's "
                             f"{side} px tiles")
    return check_tiles


def caption_writer(processor, store: ImageStore) -> Captions:
    """The ``Captions`` of ``store``'s pictures, written by the VLM whose ``processor`` (tokenizer
    and chat template) this is: the caption view's source (``captions.py``)."""
    tokenizer = processor.tokenizer
    content = [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Captions(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"],
                    lambda ids: tokenizer.decode(ids, skip_special_tokens=True), prompt, store.placeholder,
                    store.capacity, store.markers)


def image_prompt_ids(text_ids: list[int], images: list, register, placeholder: int) -> list[int]:
    """``text_ids`` (one ``placeholder`` per picture, in order) with each placeholder as the ids its
    picture stands for (``register(picture) -> ids``: ``ImageStore.register``, or
    ``PreparedPicture.ids`` of prepared pictures where no store is)."""
    if text_ids.count(placeholder) != len(images):
        raise ValueError(f"the prompt has {text_ids.count(placeholder)} image placeholder(s) for {len(images)} image(s): "
                         "images go in image content parts, not as the placeholder token in text")
    pictures = iter(images)
    out: list[int] = []
    for t in text_ids:
        out.extend(register(next(pictures)) if t == placeholder else (t,))
    return out
