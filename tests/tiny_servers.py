"""Drafts served in-process for the scheduler's tests (a perturbed copy of the target and prompt
lookup), and the target's own greedy output to compare with."""

from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.engine import speculative_generate
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.target import Target
from tiny_models import perturbed

GREEDY = SamplingParams()


def servers(target_model):
    near = perturbed(target_model, seed=1)
    return {
        "near": DraftServer("near", worker=InlineWorker(), make_draft=lambda: DraftLM("near", near)),
        "prompt-lookup": DraftServer("prompt-lookup", worker=InlineWorker(), make_draft=PromptLookupDraft),
    }


def alone(target_model, prompt, new_tokens: int = 24):
    return speculative_generate(Target(target_model), None, prompt, new_tokens, GREEDY).token_ids
