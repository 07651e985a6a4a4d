"""A Llama draft whose output layer covers only the most frequent tokens.

The reference target's vocabulary has 49,152 tokens, and a small draft's full output layer
(49,152 x 576) costs more than its decoder layers: a head over the K most frequent tokens
(K = 8,192 covers nearly all of what the target writes) makes each draft step several times
cheaper. The head's logits are scattered back to full-vocabulary ids with -inf elsewhere, so to
everything outside this file it is an ordinary causal LM: greedy drafting never proposes a token
outside the head, and under sampling its ``q`` is zero there, which the rejection sampler's
residual ``max(0, p - q)`` already covers (lossless either way).

Registered with transformers' Auto classes, so ``load_causal_lm`` loads a saved one like any
other model: ``config.json`` says ``model_type: specserve_pruned_head_llama`` and carries the
head's token ids.

A draft trained with the target's frozen embeddings is saved without them
(``save_without_embeddings``): they are the target's to the last bit, and at half precision they
would be most of the file (56 MB for the reference target). So is a head kept frozen as the
target's output rows (9 MB at 8,192 tokens). ``config.embeddings_from`` names the target, and
``attach_from_target`` copies both in at load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


class PrunedHeadConfig(LlamaConfig):
    model_type = "specserve_pruned_head_llama"

    def __init__(self, head_token_ids: list[int] | None = None, **kwargs):
        kwargs["tie_word_embeddings"] = False   # the head is smaller than the embeddings
        super().__init__(**kwargs)
        self.head_token_ids = [int(t) for t in (head_token_ids or range(self.vocab_size))]


class PrunedHeadMixin:
    """Head-token bookkeeping shared by every draft whose output layer covers ``config.head_token_ids``."""

    def head_token_ids(self, device: torch.device) -> torch.Tensor:
        # Built from config.json on first use, per device: not a buffer, because from_pretrained
        # creates modules on the meta device and leaves non-persistent buffers uninitialised.
        cache = self.__dict__.setdefault("_head_ids", {})
        if device not in cache:
            cache[device] = torch.tensor(self.config.head_token_ids, dtype=torch.long, device=device)
        return cache[device]

    def to_full_vocab(self, small: torch.Tensor) -> torch.Tensor:
        """Head logits [..., K] scattered to full-vocabulary ids [..., V], -inf elsewhere."""
        logits = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.head_token_ids(small.device), small)


class PrunedHeadLlamaForCausalLM(PrunedHeadMixin, LlamaForCausalLM):
    config_class = PrunedHeadConfig
    _tied_weights_keys = {}

    def __init__(self, config: PrunedHeadConfig):
        super().__init__(config)
        ids = config.head_token_ids
        if len(set(ids)) != len(ids) or not all(0 <= t < config.vocab_size for t in ids):
            raise ValueError(f"head_token_ids must be distinct ids in [0, {config.vocab_size}), got {len(ids)} ids")
        self.lm_head = nn.Linear(config.hidden_size, len(ids), bias=False)
        self.post_init()

    def head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the head's tokens only: [..., K]. What training optimises."""
        return self.lm_head(hidden_states)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.to_full_vocab(self.head_logits(hidden))                      # [B, T, V]
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)


EMBEDDINGS_KEY = "model.embed_tokens.weight"
OUTPUT_KEY = "lm_head.weight"


def save_without_embeddings(model, out_dir: Path, embeddings_from: str, dtype: torch.dtype = torch.float16) -> None:
    """Save in half precision, minus what is the target's to the last bit: the input embeddings
    and, when training kept it frozen, the head (the target's output rows for the head's tokens).
    Both load from ``embeddings_from``."""
    model.config.embeddings_from = embeddings_from
    model.config.head_from_target = not model.lm_head.weight.requires_grad
    shared = [model.get_input_embeddings().weight] + ([model.lm_head.weight] if model.config.head_from_target else [])
    skip = {name for name, p in model.named_parameters() if any(p is s for s in shared)}
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k not in skip}
    model.save_pretrained(out_dir, state_dict=state)


def _target_tensor(source_dir: Path, key: str) -> torch.Tensor | None:
    for file in sorted(Path(source_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            if key in weights.keys():
                return weights.get_tensor(key)
    return None


def attach_from_target(model, source_dir: Path) -> None:
    """Copy in what ``save_without_embeddings`` left out, from the model saved in ``source_dir``
    (safetensors): the embeddings, and the head's rows of its output layer if the head is the
    target's (the embeddings themselves when the target ties them)."""
    embeddings = _target_tensor(source_dir, EMBEDDINGS_KEY)
    if embeddings is None:
        raise FileNotFoundError(f"no {EMBEDDINGS_KEY} in the safetensors files of {source_dir}")
    wanted = model.get_input_embeddings().weight
    if embeddings.shape != wanted.shape:
        raise ValueError(f"{source_dir} has embeddings of shape {tuple(embeddings.shape)}, the draft "
                         f"needs {tuple(wanted.shape)}: embeddings_from names the wrong model")
    with torch.no_grad():
        wanted.copy_(embeddings)
        if getattr(model.config, "head_from_target", False):
            output = _target_tensor(source_dir, OUTPUT_KEY)
            output = embeddings if output is None else output
            model.lm_head.weight.copy_(output[torch.tensor(model.config.head_token_ids)])


AutoConfig.register(PrunedHeadConfig.model_type, PrunedHeadConfig, exist_ok=True)
AutoModelForCausalLM.register(PrunedHeadConfig, PrunedHeadLlamaForCausalLM, exist_ok=True)
