"""Image tokens as ids: a picture's image tokens travel through the engine as virtual token ids.

A VLM prompt holds a run of image tokens per picture, whose embeddings come from the vision tower
and projector, not the embedding table. Here each such token is an id at or above ``VIRTUAL_BASE``
(far above any vocabulary) that names the picture's content and the token's cell on the
picture's grid of image tokens:

    id = VIRTUAL_BASE + digest(pixels) · 2^20 + row · 2^10 + column

so everything that keys on token ids keys on the picture's content for free: the slot caches'
prefix reuse (two prompts share a cached prefix only where they show the same picture), the
prefix-affinity router, the scheduler's bookkeeping. A picture's grid is its own (``Grid``: a
Qwen2-VL picture at its native resolution, an any-res picture's rows of tiles), and the ids
carry it, so that positions that depend on it (M-RoPE, ``mrope.py``) are read off the tokens.
The only places that must know are the ones that embed ids: the target's forward asks
``ImageStore.rows`` for a virtual id's embedding (the vision tower runs then, inside the prefill
forward that first needs the picture, batched over every picture that forward needs), and
drafts, which see the VLM's placeholder token instead (``draft_view``): their text-only view of
the prompt.

The digest is 39 bits of BLAKE2b over the prepared unit (pixels, shape, grid, size: the same
picture sent as PNG or as JPEG that decodes to the same pixels is one picture). The digest field's
top bit (``CLIP_FLAG``) marks a unit that continues the clip of the unit just before it: Qwen2-VL
and Qwen2.5-VL read a clip as temporal patches (two frames a patch), each a unit on the same
grid, whose tokens sit at the clip's first position plus their patch's time (``mrope.py``). Such
a unit's field keeps 31 bits of content and, in the 8 above them, how many time steps it sits
after the patch before it (``PictureUnit.advance``: one for Qwen2-VL, the clip's frame rate's for
Qwen2.5-VL). Two units of one digest are told apart when the second arrives (``ImageStore.add``
refuses it), so a collision fails a request rather than showing it another picture.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

VIRTUAL_BASE = 1 << 32
CELL_BITS = 10                     # a grid is at most 1024 cells a side
_DIGEST_BYTES = 5
_PICTURE_BITS = 2 * CELL_BITS
CLIP_FLAG = 1 << (8 * _DIGEST_BYTES - 1)   # in the digest field: the next temporal patch of a clip
ADVANCE_BITS = 8                           # a continuing unit's time steps after the patch before it
_ADVANCE_SHIFT = 8 * _DIGEST_BYTES - 1 - ADVANCE_BITS
MAX_ADVANCE = (1 << ADVANCE_BITS) - 1
_CELL_MASK = (1 << CELL_BITS) - 1
# Pooled image tokens (a drafting view, ``pooled_view``) live in a namespace of their own above
# the pictures' ids: POOLED_BASE + digest · pooled tokens + j.
POOLED_BASE = VIRTUAL_BASE + (1 << (8 * _DIGEST_BYTES + _PICTURE_BITS))
POOLED_TOKENS = 4


class Grid(NamedTuple):
    """Where a picture's ``count`` image tokens sit: row-major, ``columns`` a row (the last row
    may be short where the tokens are not a rectangle)."""

    count: int
    columns: int

    @property
    def rows(self) -> int:
        return -(-self.count // self.columns)

    @property
    def full(self) -> bool:
        return self.rows * self.columns == self.count

    @classmethod
    def of(cls, count: int, columns: int | None = None) -> "Grid":
        """``count`` tokens on ``columns`` a row; unnamed, a square where ``count`` is one, else rows
        of the widest a grid allows."""
        if columns is None:
            side = round(count ** 0.5)
            columns = side if side * side == count else min(count, 1 << CELL_BITS)
        grid = cls(count, columns)
        if not 0 < columns <= 1 << CELL_BITS or grid.rows > 1 << CELL_BITS:
            raise ValueError(f"a picture's {count} image tokens on {columns} a row exceed the "
                             f"{1 << CELL_BITS} x {1 << CELL_BITS} grid image token ids can name")
        return grid


def is_virtual(token: int) -> bool:
    return token >= VIRTUAL_BASE


def is_picture_token(token: int) -> bool:
    """An image token of a picture (not a pooled view's)."""
    return VIRTUAL_BASE <= token < POOLED_BASE


def cell(token: int) -> tuple[int, int, int]:
    """A picture token's (digest, row, column)."""
    offset = token - VIRTUAL_BASE
    return offset >> _PICTURE_BITS, (offset >> CELL_BITS) & _CELL_MASK, offset & _CELL_MASK


def starts_picture(token: int) -> bool:
    """Whether ``token`` is a picture's first image token (it stands for the picture)."""
    return is_picture_token(token) and (token - VIRTUAL_BASE) & ((1 << _PICTURE_BITS) - 1) == 0


@dataclass(frozen=True, eq=False)
class PictureUnit:
    """What the vision tower encodes at once, as the VLM's processor prepared it: ``pixels``, the
    ``grid`` its image tokens sit on, and the picture's own height and width where the encoder
    needs them (``size``: an any-res picture's unpadding)."""

    pixels: torch.Tensor
    grid: Grid
    size: tuple[int, int] | None = None
    continues: bool = False   # the next temporal patch of the clip whose unit comes just before it
    advance: int = 1          # where it continues a clip: its time steps after the patch before it


def picture_digest(unit: PictureUnit) -> int:
    """The unit's digest field: its content's 39 bits; where it continues a clip, ``CLIP_FLAG``, its
    ``advance`` and 31 bits of content."""
    pixels = unit.pixels.contiguous().cpu()
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    hasher.update(repr((tuple(pixels.shape), unit.grid, unit.size)).encode())
    hasher.update(pixels.numpy().tobytes())
    content = int.from_bytes(hasher.digest(), "little") & (CLIP_FLAG - 1)
    return continuing(content, unit.advance) if unit.continues else content


def continuing(content: int, advance: int) -> int:
    """The digest field of a unit of ``content`` that continues a clip ``advance`` time steps after
    the patch before it."""
    if not 0 <= advance <= MAX_ADVANCE:
        raise ValueError(f"a clip's patch sits 0-{MAX_ADVANCE} time steps after the one before it, not {advance}")
    return CLIP_FLAG | advance << _ADVANCE_SHIFT | content & ((1 << _ADVANCE_SHIFT) - 1)


def clip_advance(digest):
    """The time steps a continuing unit of ``digest`` sits after the patch before it (numpy arrays
    too)."""
    return (digest >> _ADVANCE_SHIFT) & MAX_ADVANCE


def grid_ids(digest: int, grid: Grid) -> list[int]:
    base = VIRTUAL_BASE + (digest << _PICTURE_BITS)
    return [base + ((k // grid.columns) << CELL_BITS) + k % grid.columns for k in range(grid.count)]


def picture_ids(unit: PictureUnit) -> list[int]:
    """The ids of a prepared unit's image tokens."""
    return grid_ids(picture_digest(unit), unit.grid)


def pooled_view(ids: list[int], pooled: int) -> list[int]:
    """``ids`` with each picture's image tokens as ``pooled`` tokens (its grid of image tokens
    averaged in blocks: an 8 x 8 grid pooled to 4 as 2 x 2 blocks of 4 x 4): TABED's pooled
    view, whose embeddings ``ImageStore.rows`` computes."""
    out: list[int] = []
    for t in ids:
        if is_picture_token(t):
            if starts_picture(t):
                digest = cell(t)[0]
                out.extend(range(POOLED_BASE + digest * pooled, POOLED_BASE + (digest + 1) * pooled))
            continue
        out.append(t)
    return out


def draft_view(ids: list[int], placeholder: int) -> list[int]:
    """``ids`` with every image token replaced by ``placeholder`` (what a draft reads)."""
    return [placeholder if t >= VIRTUAL_BASE else t for t in ids]


@dataclass(frozen=True)
class PreparedPicture:
    """A picture as its VLM's processor prepares it: the ``units`` the vision tower encodes, each
    a picture of the store (the whole picture; or Idefics3's tiles and its global image), and the
    picture's ``tokens`` in a prompt: the processor's text ids around them (markers, a tile's
    row and column) with None where a unit's image tokens go, in order."""

    units: tuple[PictureUnit, ...]
    tokens: tuple

    def ids(self, unit_ids: Callable[[PictureUnit], list[int]]) -> list[int]:
        """The picture's ids in a prompt, ``unit_ids(unit)`` naming each unit's image tokens."""
        units = iter(self.units)
        out: list[int] = []
        for t in self.tokens:
            out.extend(unit_ids(next(units)) if t is None else (t,))
        return out


def _same(a: PictureUnit, b: PictureUnit) -> bool:
    """Whether two units of one digest are one (the digest already holds ``continues`` and ``advance``)."""
    return (a.grid, a.size, a.pixels.shape) == (b.grid, b.size, b.pixels.shape) \
        and torch.equal(a.pixels, b.pixels.to(a.pixels.device, a.pixels.dtype))


class ImageStore:
    """The pictures one target has been shown: ids for each, embeddings on demand.

    ``prepare(image) -> PictureUnit`` (the VLM's image processor, a picture whole);
    ``encode([unit, ...]) -> [[count, hidden], ...]`` (vision tower + projector, one row per
    image token, in grid order); ``placeholder``: the VLM's image token, which drafts read in
    place of image tokens; ``check(unit)``: raises ValueError for a unit the vision tower cannot
    encode as its grid says (``pictures.unit_check``), as a request arrives, so that the request
    fails alone rather than the step that would encode it. Units are kept, least recently used
    first out, up to ``capacity``: a prompt may not need a unit evicted before its prefill
    reached it (``rows`` raises), so ``capacity`` must exceed the units of the requests in
    flight."""

    def __init__(self, prepare: Callable, encode: Callable[[list[PictureUnit]], list[torch.Tensor]],
                 placeholder: int, capacity: int = 512, check: Callable[[PictureUnit], None] | None = None):
        self.prepare, self.encode, self.capacity, self.check = prepare, encode, capacity, check
        self.placeholder = placeholder
        self.pooled = POOLED_TOKENS   # the pooled view's tokens per picture
        self._units: OrderedDict[int, PictureUnit] = OrderedDict()                  # digest -> prepared unit
        self._rows: OrderedDict[int, tuple[torch.Tensor, Grid]] = OrderedDict()     # digest -> [count, hidden]
        self.encoded_images = 0   # vision-tower runs, per unit (tests, metrics)
        self.captions = None      # the pictures' captions (``captions.Captions``) where a caption view reads them
        # Tokens the VLM's processor puts before and after one picture's image tokens (``pictures.picture_markers``).
        self.markers: tuple[list[int], list[int]] = ([], [])
        # ``image -> PreparedPicture`` as the VLM's processor expands a picture (``pictures.picture_preparer``);
        # None: the picture whole, between ``markers``.
        self.picture: Callable | None = None
        # ``(frames, fps) -> PreparedPicture``: a clip as temporal patches (``pictures.clip_preparer``),
        # standing where the VLM's ``video_placeholder`` is; None: the class reads a clip's frames
        # as pictures.
        self.clip: Callable | None = None
        self.video_placeholder: int | None = None

    def prepared(self, image) -> PreparedPicture:
        if self.picture is not None:
            return self.picture(image)
        return PreparedPicture((self.prepare(image),), (*self.markers[0], None, *self.markers[1]))

    def register(self, image) -> list[int]:
        """The ids ``image`` stands for in a prompt: its units' image tokens among the processor's
        markers (preparing it now; encoding waits for a forward)."""
        return self.prepared(image).ids(self.add)

    def register_clip(self, frames, fps: float | None = None) -> list[int]:
        """The ids a clip's ``frames`` (``fps`` a second) stand for in a prompt, as its temporal
        patches (``clip``)."""
        if self.clip is None:
            raise ValueError("this VLM reads a clip as its frames, pictures one after another")
        return self.clip(frames, fps).ids(self.add)

    def add(self, unit: PictureUnit) -> list[int]:
        """The ids of a prepared unit's image tokens (the ingress sends units with a request)."""
        if not isinstance(unit, PictureUnit) or not isinstance(unit.pixels, torch.Tensor) \
                or not isinstance(unit.grid, Grid):
            raise ValueError(f"a picture must come prepared as a PictureUnit, not {type(unit).__name__}")
        if type(unit.advance) is not int:
            raise ValueError(f"a clip's patch advances a whole number of time steps, not {unit.advance!r}")
        Grid.of(unit.grid.count, unit.grid.columns)   # within the grid ids can name
        if not unit.pixels.is_floating_point() or not bool(torch.isfinite(unit.pixels).all()):
            raise ValueError("a picture's pixels must be finite floating-point numbers")
        if self.check is not None:
            self.check(unit)
        digest = picture_digest(unit)
        known = self._units.get(digest)
        if known is None:
            self._rows.pop(digest, None)   # rows kept past their unit cannot be told from another's
        elif not _same(known, unit):
            raise ValueError("this picture's digest names another picture the replica holds (a collision): "
                             "send it again later")
        self._remember(self._units, digest, unit)
        if digest in self._rows:
            self._rows.move_to_end(digest)
        return grid_ids(digest, unit.grid)

    def _remember(self, store: OrderedDict, digest: int, value) -> None:
        store[digest] = value
        store.move_to_end(digest)
        while len(store) > self.capacity:
            store.popitem(last=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [n, hidden] of virtual ``ids`` [n] (pooled ones too: ``pooled_view``),
        encoding the pictures not yet encoded in one batch."""
        pooled = ids >= POOLED_BASE
        if bool(pooled.any()):
            pooled_rows = self._pooled_rows(ids[pooled])
            out = pooled_rows.new_empty((len(ids), pooled_rows.shape[-1]))
            out[pooled] = pooled_rows
            if not bool(pooled.all()):
                out[~pooled] = self.rows(ids[~pooled]).to(out.dtype)
            return out
        cells = [cell(t) for t in ids.tolist()]
        pending = sorted({d for d, _, _ in cells if d not in self._rows})
        if pending:
            missing = [d for d in pending if d not in self._units]
            if missing:
                raise KeyError(f"{len(missing)} picture(s) of this prompt left the image store before its prefill "
                               f"(capacity {self.capacity}): raise the capacity above the pictures in flight")
            with torch.no_grad():
                encoded = self.encode([self._units[d] for d in pending])
            self.encoded_images += len(pending)
            for d, rows in zip(pending, encoded):
                grid = self._units[d].grid
                if rows.shape[0] != grid.count:
                    raise ValueError(f"the vision tower gave {rows.shape[0]} rows for a picture of {grid.count} image tokens")
                self._remember(self._rows, d, (rows, grid))
        out = []
        for d, row, column in cells:
            rows, grid = self._rows[d]
            out.append(rows[row * grid.columns + column])
        return torch.stack(out)

    def _pooled_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Pooled tokens' rows: the means of the picture's grid in ``pooled`` blocks (2 x 2 on a
        rectangle; a grid with a short last row, in runs along its tokens)."""
        means: dict[int, torch.Tensor] = {}   # digest -> [pooled, hidden]
        out = []
        for t in ids.tolist():
            digest, j = divmod(t - POOLED_BASE, self.pooled)
            if digest not in means:
                if digest not in self._rows:
                    if digest not in self._units:
                        raise KeyError("a pooled picture left the image store before its prefill "
                                       f"(capacity {self.capacity}): raise the capacity above the pictures in flight")
                    self.rows(torch.tensor(grid_ids(digest, self._units[digest].grid)))
                rows, grid = self._rows[digest]
                means[digest] = block_means(rows, grid, self.pooled)
            out.append(means[digest][j])
        return torch.stack(out)


def block_means(rows: torch.Tensor, grid: Grid, pooled: int) -> torch.Tensor:
    """[pooled, hidden]: ``rows`` [count, hidden] on ``grid`` averaged in ``pooled`` blocks."""
    side = round(pooled ** 0.5)
    if grid.full and side * side == pooled:
        plane = rows.view(grid.rows, grid.columns, -1).permute(2, 0, 1).float()
        return F.adaptive_avg_pool2d(plane, side).flatten(1).T.to(rows.dtype)
    return F.adaptive_avg_pool1d(rows.T[None].float(), pooled)[0].T.to(rows.dtype)


def placeholder_for(images: ImageStore | None, prompt_ids: list[int]) -> int | None:
    """A request's ``SpecRequest.image_placeholder``: the store's placeholder when the prompt shows
    a picture, else None."""
    return images.placeholder if images is not None and any(t >= VIRTUAL_BASE for t in prompt_ids) else None


def embed(ids: torch.Tensor, weight: torch.Tensor, images: ImageStore | None) -> torch.Tensor:
    """``F.embedding(ids, weight)`` where virtual ids take their picture's rows (``images``: None
    when no id of this forward is virtual, which the caller knows without a device sync)."""
    if images is None:
        return F.embedding(ids, weight)
    virtual = ids >= VIRTUAL_BASE
    h = F.embedding(ids.masked_fill(virtual, 0), weight)
    h[virtual] = images.rows(ids[virtual]).to(device=h.device, dtype=h.dtype)
    return h
