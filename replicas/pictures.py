"""Pictures as a VLM's processor prepares them, and the image store that encodes them.

A picture is read as its folder's processor reads it (``picture_preparer``): Idefics3's
processor may split a large picture into tiles, each behind marker tokens, beside the whole
picture resized (its "global image"), each tile a unit of the store among the markers of the
processor's own expansion; an any-res picture is its tiles on the best of the processor's
grids beside the whole picture, unpadded to its aspect ratio with a row end after each row,
one unit of as many image tokens as its processor counts. Qwen2-VL's class reads a picture at
its native resolution (its processor's resize to whole merged patches within its pixel bounds)
as flattened patches merged 2 x 2, and places its image tokens with multimodal rotary
positions (``mrope.py``): each picture has its own grid of image tokens, which its ids carry
(``image_tokens.Grid``). A clip reaches Qwen2-VL's and Qwen2.5-VL's classes as its temporal
patches (``clip_preparer``: two frames a patch, each patch a unit on the frames' grid, placed
in time by M-RoPE: a step apart for Qwen2-VL, by the clip's frame rate for Qwen2.5-VL), and
every other class as its sampled frames, pictures one after another (``ingress/images.py``).
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from specserve.replicas.captions import CAPTION_PROMPT, Captions
from specserve.replicas.model.image_tokens import MAX_ADVANCE, Grid, ImageStore, PictureUnit, PreparedPicture
from specserve.replicas.vlm import image_token_id, tokens_per_image

# The frame rate of a clip's frames where the request does not say it: Qwen's own video sampling
# rate (``qwen-vl-utils``), so a list of frames reads as Qwen2.5-VL was taught clips.
DEFAULT_CLIP_FPS = 2.0


def _is_qwen2_vl_processor(image_processor) -> bool:
    return hasattr(image_processor, "merge_size") and hasattr(image_processor, "temporal_patch_size")


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


def clip_preparer(config, image_processor):
    """``(frames, fps) -> PreparedPicture`` for a class that reads a clip as temporal patches
    (Qwen2-VL's and Qwen2.5-VL's: ``temporal_patch_size`` frames a patch), else None. A frame is
    prepared as a picture (its patches hold it ``temporal_patch_size`` times over, as the image
    processor writes a still picture); a patch takes frame j's copy j, which is the video
    processor's layout (per merged token: merge, merge, channel, time, patch, patch), and a clip
    whose frames do not fill its last patch repeats its last frame, as the video processor does.
    Every patch after the first continues the clip (``PictureUnit.continues``), one time step
    after the patch before it for Qwen2-VL; Qwen2.5-VL's patch k sits at k · tokens_per_second ·
    temporal_patch_size / fps steps (``clip_times``), ``fps`` the frame rate of the frames sent
    (``DEFAULT_CLIP_FPS`` when None). Where this deviates from the video processor: frames are
    resized within the image processor's pixel bounds, not the video processor's own, which need
    torchvision to read. A clip whose last patch's time reaches its grid's longer side is refused:
    past it, where the text after the clip resumes differs between Qwen's own code (after the
    last patch) and transformers' (after the grid's longer side). A config that names no video
    token (``video_token_id``) for a clip to stand at reads a clip's frames as pictures."""
    if not _is_qwen2_vl_processor(image_processor) or getattr(config, "video_token_id", None) is None:
        return None
    per_second = getattr(getattr(config, "vision_config", None), "tokens_per_second", None)
    prepare, step = pixel_preparer(config, image_processor), image_processor.temporal_patch_size
    area = image_processor.patch_size ** 2

    def prepare_clip(frames, fps: float | None = None) -> PreparedPicture:
        frames = list(frames)
        if not frames:
            raise ValueError("a clip needs at least one frame")
        sizes = sorted({frame.size for frame in frames})
        if len(sizes) > 1:
            raise ValueError(f"a clip's frames must share one size, got {' and '.join(f'{w}x{h}' for w, h in sizes)}")
        frames += [frames[-1]] * (-len(frames) % step)
        patches = len(frames) // step
        times = clip_times(patches, per_second, step, DEFAULT_CLIP_FPS if fps is None else fps)
        units = []
        for k, first in enumerate(range(0, len(frames), step)):
            shown = [prepare(frame) for frame in frames[first:first + step]]
            rows, columns, width = shown[0].pixels.shape
            if not units and times[-1] >= max(rows, columns):
                raise ValueError(f"a clip of {len(frames)} frames ({patches} temporal patches) reaches time step "
                                 f"{times[-1]} on a grid of {rows} x {columns} image tokens, past the "
                                 f"{max(rows, columns) - 1} its longer side allows: send a shorter clip (fewer "
                                 "frames, or frames of a shorter time) or larger frames")
            copies = [u.pixels.reshape(rows, columns, -1, step, area) for u in shown]   # [..., time, patch²]
            pixels = torch.stack([c[..., j, :] for j, c in enumerate(copies)], dim=-2).reshape(rows, columns, width)
            advance = times[k] - times[k - 1] if k else 1
            if advance > MAX_ADVANCE:
                raise ValueError(f"a clip's patches {advance} time steps apart, more than the {MAX_ADVANCE} an id carries: "
                                 "send frames closer in time")
            units.append(PictureUnit(pixels, shown[0].grid, continues=bool(units), advance=advance))
        return PreparedPicture(tuple(units), (None,) * len(units))
    return prepare_clip


def clip_times(patches: int, tokens_per_second: float | None, temporal_patch_size: int, fps: float) -> list[int]:
    """Each temporal patch's time step from the clip's first: its index (Qwen2-VL), or, where the
    class has ``tokens_per_second`` (Qwen2.5-VL), the index times the patch's seconds times that
    rate, rounded down in float32 as Hugging Face's ``get_rope_index`` computes it."""
    index = torch.arange(patches)
    if tokens_per_second is None:
        return index.tolist()
    if not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"a clip's frame rate must be a positive number of frames a second, not {fps}")
    interval = tokens_per_second * torch.tensor(temporal_patch_size / fps, dtype=torch.float32)
    return (index * interval).long().tolist()


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
    vision tower and projector encode them (``encoder``), and each unit that arrives is checked
    against them (``unit_check``)."""
    store = ImageStore(pixel_preparer(vlm.config, image_processor), encoder(vlm, image_processor),
                       image_token_id(vlm.config), capacity, check=unit_check(vlm.config, image_processor))
    store.clip = clip_preparer(vlm.config, image_processor)
    store.video_placeholder = getattr(vlm.config, "video_token_id", None)
    return store


def encoder(vlm, image_processor):
    """``[unit, ...] -> [[count, hidden], ...]`` through ``get_image_features``: the rows the
    model's own forward scatters into its image tokens (Qwen2-VL's given each picture's patch
    grid, any-res classes each picture's size)."""
    if getattr(vlm.model, "visual", None) is not None:   # Qwen2-VL: flattened patches and each picture's grid
        merge = image_processor.merge_size

        def encode_patches(units: list[PictureUnit]) -> list[torch.Tensor]:
            weight = next(vlm.model.visual.parameters())
            thw = torch.tensor([[1, u.pixels.shape[0] * merge, u.pixels.shape[1] * merge] for u in units],
                               device=weight.device)
            patches = torch.cat([u.pixels.reshape(-1, u.pixels.shape[-1] // merge ** 2) for u in units])
            out = vlm.model.get_image_features(pixel_values=patches.to(weight.device, weight.dtype), image_grid_thw=thw)
            return list(getattr(out, "pooler_output", out))
        return encode_patches

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
    return encode


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


def image_prompt_ids(text_ids: list[int], images: list, register, placeholder: int, kind: str = "image") -> list[int]:
    """``text_ids`` (one ``placeholder`` per picture, in order) with each placeholder as the ids its
    picture stands for (``register(picture) -> ids``: ``ImageStore.register``, or
    ``PreparedPicture.ids`` of prepared pictures where no store is). ``kind``: "video" where the
    pictures are clips (``ImageStore.register_clip``) and the placeholder the video token."""
    if text_ids.count(placeholder) != len(images):
        raise ValueError(f"the prompt has {text_ids.count(placeholder)} {kind} placeholder(s) for {len(images)} "
                         f"{kind}(s): {kind}s go in {kind} content parts, not as the placeholder token in text")
    pictures = iter(images)
    out: list[int] = []
    for t in text_ids:
        out.extend(register(next(pictures)) if t == placeholder else (t,))
    return out
