"""The in-process engine: a target, its drafts by name, and text in / text out.

This is what ``specserve generate`` runs, and what a target replica runs for each request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specserve.replicas.drafts.base import Draft, draft_from_model
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.model_store import REFERENCE_TARGET, LoadedModel, load_causal_lm
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.router.prompt_ids import encode_chat, encode_text
from specserve.router.session import Generation, speculative_generate

NO_DRAFT = "none"


@dataclass
class GenerateRequest:
    prompt: str
    max_tokens: int = 128
    draft: str = "prompt-lookup"
    window: int = 4
    tree: TreeShape | None = None
    params: SamplingParams = SamplingParams()
    chat: bool = True   # render the prompt with the model's chat template


class SpecEngine:
    def __init__(self, target: LoadedModel, drafts: dict[str, Draft]):
        self.loaded = target
        self.tokenizer = target.tokenizer
        self.target = Target(target.model)
        self.drafts = drafts
        self.max_context = getattr(target.model.config, "max_position_embeddings", None)

    @classmethod
    def load(
        cls,
        target: str = REFERENCE_TARGET,
        draft_models: list[str] = (),
        dtype: str = "auto",
        device: str | None = None,
    ) -> "SpecEngine":
        loaded = load_causal_lm(target, dtype=dtype, device=device)
        drafts: dict[str, Draft] = {PromptLookupDraft.name: PromptLookupDraft()}
        for name in draft_models:
            lm = load_causal_lm(name, dtype=dtype, device=device)
            drafts[lm.name] = draft_from_model(lm.name, lm.model)
        return cls(loaded, drafts)

    def reset_caches(self) -> None:
        """Forget every KV cache. Sessions otherwise keep their longest common prefix with the
        next request (a free prefix cache); benchmarks start each generation cold."""
        self.target.session.reset()
        for draft in self.drafts.values():
            session = getattr(draft, "session", None)
            if session is not None:
                session.reset()

    @property
    def draft_names(self) -> list[str]:
        return [NO_DRAFT, *self.drafts]

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty: give some text to continue")
        if chat:
            return encode_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        return encode_text(self.tokenizer, prompt)

    def draft(self, name: str) -> Draft | None:
        if name == NO_DRAFT:
            return None
        if name not in self.drafts:
            raise ValueError(f"unknown draft {name!r}; available: {', '.join(self.draft_names)}")
        return self.drafts[name]

    def generate_ids(self, prompt_ids: list[int], request: GenerateRequest,
                     on_tokens: Callable[[list[int]], None] | None = None) -> Generation:
        draft = self.draft(request.draft)
        if self.max_context and len(prompt_ids) + request.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"the target's context of {self.max_context} tokens: shorten the prompt or lower max_tokens"
            )
        return speculative_generate(
            self.target,
            draft,
            prompt_ids,
            request.max_tokens,
            request.params,
            window=request.window,
            tree=request.tree,
            eos_token_ids=self.loaded.eos_token_ids,
            on_tokens=on_tokens,
        )

    def generate(self, request: GenerateRequest) -> dict:
        """The ``--json`` object: ``{text, token_ids, finish_reason, usage, spec}``."""
        prompt_ids = self.encode(request.prompt, request.chat)
        gen = self.generate_ids(prompt_ids, request)
        return {
            "text": self.tokenizer.decode(gen.token_ids, skip_special_tokens=True),
            "token_ids": gen.token_ids,
            "finish_reason": gen.finish_reason,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids)},
            "spec": gen.stats.summary(),
        }
