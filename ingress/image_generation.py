"""``POST /v1/images/generations``: pictures from a deployment whose target is an image generator
(``replicas/imagegen.py``), in OpenAI's shape.

A prompt names a scene ("a red circle on a striped background": ``data/scenes.prompt_label``),
which becomes the class token the generator is conditioned on. Each of the ``n`` pictures is one
request through the same target stream as text (``TargetStreams``: deadlines, retries, a replica
failure resumed from the image tokens so far), guided by classifier-free guidance (its
unconditional row beside it in every verify forward) and carrying its grid (tree rules read a
token's neighbours). Its image tokens decode to PNG with the generator's VQ tokenizer, here at the
ingress, off the target's model thread.

Fields: OpenAI's ``prompt``, ``n``, ``size`` (the generator's one size), ``response_format``
(``b64_json``; ``url`` would need storage this server does not keep), and specserve's ``seed``
(picture i draws from seed + i), ``temperature`` (0: greedy), ``top_k``, ``cfg_scale`` and ``spec``,
whose ``acceptance: "lantern"`` asks for LANTERN's relaxed, lossy acceptance (``replicas/lantern.py``),
named in each picture's ``spec``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.data.scenes import label_prompt, prompt_label
from specserve.ingress.choices import answers
from specserve.ingress.config import IngressConfig
from specserve.ingress.openai_api import LanternOptions, Name, OpenAIError, SpecOptions
from specserve.ingress.prepare import Prepared, check_model, speculation
from specserve.replicas.imagegen import generator_settings, load_tokenizer, to_pictures
from specserve.replicas.lantern import DEFAULT_DELTA, Lantern, default_k
from specserve.replicas.request import AUTO_DRAFT, MAX_GUIDANCE_SCALE, Guidance, SpecRequest
from specserve.replicas.sampling import SamplingParams

MAX_PICTURES = 8


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Name | None = None
    prompt: str = Field(min_length=1, max_length=1000, description="The scene: a shape, a colour and a background.")
    n: int = Field(1, ge=1, le=MAX_PICTURES, description="Pictures to generate.")
    size: str | None = Field(None, max_length=32, description="WIDTHxHEIGHT: the generator's own size only.")
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = Field(None, ge=0, lt=2**63, description="Picture i draws from seed + i.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy.")
    top_k: int | None = Field(None, ge=0, description="Keep the k likeliest image tokens (default: the generator's).")
    cfg_scale: float | None = Field(None, gt=0.0, le=MAX_GUIDANCE_SCALE,
                                    description="Classifier-free guidance scale (default: the generator's).")
    spec: SpecOptions | None = None
    user: str | None = Field(None, max_length=256)


class NoText:
    """The text side of image tokens: none (``TextStream`` asks every piece for its text)."""

    def decode(self, ids, **_) -> str:
        return ""


class PictureFace:
    """Image requests on a generator's deployment: checks, the target streams, PNG."""

    def __init__(self, config: IngressConfig, streams):
        folder, self.settings = generator_settings(config.target)
        self.tokenizer = load_tokenizer(folder, self.settings)
        self.size = self.tokenizer.config.image_size
        self.config, self.streams = config, streams

    def _requests(self, req: ImageGenerationRequest) -> list[SpecRequest]:
        s, config = self.settings, self.config
        check_model(req.model, config.model_id)
        if req.size is not None and req.size != f"{self.size}x{self.size}":
            raise OpenAIError(f"size {req.size!r}: this generator draws {self.size}x{self.size} pictures only",
                              param="size")
        if req.response_format != "b64_json":
            raise OpenAIError("response_format url is not served (no picture is stored): ask for b64_json",
                              param="response_format")
        try:
            label = prompt_label(req.prompt)
            class_token = s.layout.class_token(label)
        except ValueError as err:
            raise OpenAIError(str(err), param="prompt") from None
        top_k = s.top_k if req.top_k is None else req.top_k
        if top_k > s.codebook_size:
            raise OpenAIError(f"top_k must be at most the codebook's {s.codebook_size} image tokens", param="top_k")
        spec = req.spec
        if spec is not None and spec.grammar_draft is not None:
            raise OpenAIError("grammar_draft is for structured text output", param="spec.grammar_draft")
        draft, window, tree, policy = speculation(spec, config, config.default_draft)
        lantern = self._relaxation(spec)
        draft = config.default_draft if draft == AUTO_DRAFT else draft   # no router reads pictures' prompts
        guidance = Guidance((s.layout.unconditional,), s.cfg_scale if req.cfg_scale is None else req.cfg_scale,
                            s.codebook_size)
        base = uuid.uuid4().hex
        return [SpecRequest([class_token], s.tokens,
                            SamplingParams(temperature=req.temperature, top_k=top_k,
                                           seed=None if req.seed is None else (req.seed + i) % 2**63),
                            draft, window, tree, f"{base}-{i}",
                            pinned=bool(spec and (spec.window is not None or spec.tree is not None)), policy=policy,
                            guidance=guidance, grid=s.grid, lantern=lantern) for i in range(req.n)]

    def _relaxation(self, spec: SpecOptions | None) -> Lantern | None:
        """The request's LANTERN relaxation (``spec.acceptance: lantern``), or None: exact."""
        if spec is None or spec.acceptance in (None, "exact"):
            if spec is not None and spec.lantern is not None:
                raise OpenAIError("spec.lantern is read with spec.acceptance 'lantern' only", param="spec.lantern")
            return None
        given = spec.lantern or LanternOptions()
        k = default_k(self.settings.codebook_size) if given.k is None else given.k
        if k >= self.settings.codebook_size:
            raise OpenAIError(f"spec.lantern.k must be below the codebook's {self.settings.codebook_size} codes",
                              param="spec.lantern.k")
        return Lantern(DEFAULT_DELTA if given.delta is None else given.delta, k)

    async def render(self, req: ImageGenerationRequest) -> tuple[list[bytes], str, list[dict | None]]:
        """(each picture's PNG, the scene the generator was conditioned on, each one's spec)."""
        requests = self._requests(req)
        # Each picture's call with a Serve request id of its own (``choices.answers``: concurrent
        # calls under one id are taken for one call).
        answered = await answers(self.streams, [Prepared(r.request_id, r, []) for r in requests])
        if any(len(a.token_ids) != self.settings.tokens for a in answered):
            raise OpenAIError("the target returned an incomplete picture; retry", status=503, type="server_error",
                              code="unavailable", retry_after=self.config.retry_after_s)
        pngs = await asyncio.to_thread(self._pngs, [a.token_ids for a in answered])
        return pngs, label_prompt(prompt_label(req.prompt)), [a.spec for a in answered]

    async def generate(self, req: ImageGenerationRequest) -> dict:
        """The HTTP body: OpenAI's ``data`` of base64 PNGs, and each picture's ``spec``."""
        pngs, scene, specs = await self.render(req)
        return {"created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": scene} for png in pngs],
                "spec": specs}

    def _pngs(self, ids: list[list[int]]) -> list[bytes]:
        """Each picture decoded on its own: a batched convolution may round a pixel differently,
        and a picture must not depend on the others of its request."""
        import torch

        out = []
        for row in ids:
            picture = to_pictures(self.tokenizer, torch.tensor([row]), self.settings.grid)[0]
            buffer = io.BytesIO()
            picture.save(buffer, format="PNG")
            out.append(buffer.getvalue())
        return out
