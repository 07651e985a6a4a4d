"""Pictures through the batched speculative engine, in-process: the reference image generator
(``imagegen.py``) as a target, its distilled draft, classifier-free guidance and the picture's
grid on every request (``SpecRequest.guidance``, ``SpecRequest.grid``), image tokens decoded by
the VQ tokenizer. ``specserve generate --image-out`` and ``bench imagegen`` run it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.engine import Generation, in_process_server, run_batch
from specserve.replicas.imagegen import load_generator, to_pictures
from specserve.replicas.lantern import Lantern, latent_neighbours
from specserve.replicas.model_store import targets_dir, zoo_dir
from specserve.replicas.request import NO_DRAFT, Guidance, SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target

REFERENCE_GENERATOR = "scenes-imagegen"
GENERATOR_DRAFT = "scenes-imagegen-draft"


def reference_generator() -> Path:
    return targets_dir() / REFERENCE_GENERATOR


class ImageEngine:
    """A generator folder and, when given (or in the zoo), its draft LM, in this process."""

    def __init__(self, generator: str | Path | None = None, draft: str | Path | None = None,
                 device: str | None = None, slots: int = 16):
        from transformers import LlamaForCausalLM

        folder = Path(generator) if generator is not None else reference_generator()
        self.model, self.settings, self.tokenizer = load_generator(folder, device or "cpu")
        self.slots = slots
        self.neighbours = latent_neighbours(self.tokenizer.codes().detach())   # once, for every target
        draft_folder = Path(draft) if draft is not None else zoo_dir() / GENERATOR_DRAFT
        self.drafts: dict[str, DraftLM] = {}
        if draft is not None or (draft_folder / "config.json").is_file():
            model = LlamaForCausalLM.from_pretrained(draft_folder).to(self.model.device).eval()
            self.drafts[GENERATOR_DRAFT] = DraftLM(GENERATOR_DRAFT, model)

    def request(self, label: int, request_id: str, draft: str = NO_DRAFT, window: int = 0,
                tree: TreeShape | None = None, temperature: float = 1.0, top_k: int | None = None,
                seed: int | None = None, cfg_scale: float | None = None, pinned: bool = True,
                policy: str | None = None, lantern: Lantern | None = None) -> SpecRequest:
        """One picture of class ``label``: guided at ``cfg_scale`` (default: the generator's),
        drawn at ``temperature`` with ``top_k`` (default: the generator's; temperature 0: greedy);
        ``lantern``: LANTERN's relaxed (lossy) acceptance."""
        s = self.settings
        params = SamplingParams(temperature=temperature, top_k=s.top_k if top_k is None else top_k, seed=seed)
        guidance = Guidance((s.layout.unconditional,), s.cfg_scale if cfg_scale is None else cfg_scale, s.codebook_size)
        return SpecRequest([s.layout.class_token(label)], s.tokens, params, draft, window, tree, request_id,
                           pinned=pinned, policy=policy, guidance=guidance, grid=s.grid, lantern=lantern)

    def target(self, slots: int | None = None) -> Target:
        """A target over the generator with ``slots`` KV slots (default: the engine's), its
        codebook at hand for relaxed requests."""
        return Target(self.model, slots=slots or self.slots, neighbours=self.neighbours)

    def generate(self, requests: list[SpecRequest], policy=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        """Every request through one batched scheduler (a guided picture takes two slots)."""
        servers = {name: in_process_server(name, draft) for name, draft in self.drafts.items()
                   if any(r.draft == name for r in requests)}
        return run_batch(self.target(), servers, requests, policy=policy, on_tokens=on_tokens)

    def pictures(self, generations: list[Generation]):
        """The PIL pictures of finished generations."""
        ids = torch.tensor([g.token_ids for g in generations])
        return to_pictures(self.tokenizer, ids, self.settings.grid)
