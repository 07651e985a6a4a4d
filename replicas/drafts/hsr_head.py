"""A hidden-state-reuse (HSR) draft head: Eq. 1 of Sparrow ("Sparrow: Text-Anchored Window
Attention with Visual-Semantic Glimpsing for Speculative Decoding in Video LLMs"), in the manner
of EAGLE.

Instead of reading the context itself, the head reuses what the target already computed. Its
input at position t joins the embedding of token t with the target's hidden state at t-1:

    z_t = FC(e_t ⊕ h_{t-1})                          (Sparrow Eq. 1)
    o_t = DecoderLayer(z_≤t)                           one Llama layer, causal, its own KV cache
    q(x_{t+1}) = softmax(head(norm(o_t)))             a pruned head over K frequent tokens

``h`` is the output of the target's second-to-last decoder layer (Sparrow's ``h^h``). Drafting
several tokens, the target's state for a drafted position does not exist yet: the head feeds its
own output instead, ``z_{t+1} = FC(e_{t+1} ⊕ o_t)`` (Sparrow Eq. 4 without the visual anchor,
which text has no use for). Training unrolls those recursive steps so the head learns to read its
own states (multi-token prediction, ``training/hsr_train.py``).

Deviations from the paper, and why:
- no VATA window (Eq. 2): there are no visual tokens to leave out, every position is text;
- the decoder layer starts as a copy of the target's last layer (its input ``h^h`` is what that
  layer reads) and the FC as ``[0 | I]`` (it passes ``h`` through); Sparrow does not say how it
  initialises, and from random the head learns markedly slower on our small budget.

Fused multi-layer features (EAGLE-3: "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"). With ``feature_layers`` naming n > 1 of the target's
hidden states (low, middle, high), the head first fuses them into one state of the target's width:

    h_t = fuse(h^low_t ⊕ h^mid_t ⊕ h^high_t)          fuse: Linear(n·H -> H), no bias
    z_t = FC(e_t ⊕ h_{t-1})                            as above

and drafting past the root feeds the head's own output o_t in place of the fused h, as EAGLE-3
does. Deviations from EAGLE-3, and why:
- EAGLE-3 feeds ``e_t`` and the fused state side by side into a decoder layer whose attention
  reads 2H-wide inputs; here they go through Sparrow's ``FC(e ⊕ h)`` first, so the layer stays a
  plain Llama layer (it starts as the target's last layer and runs the packed drafting path);
- ``fuse`` starts as ``[0 | ... | I]`` on the deepest layer listed (EAGLE-3 starts from random):
  the head then starts exactly where a single-layer head starts, and learns what the lower
  layers add.
A head with one feature layer (the default, ``feature_layer = -2``) has no ``fuse``.

Registered with transformers' Auto classes like the pruned-head draft, so ``load_causal_lm``
loads it from its folder, embeddings from the target (``embeddings_from``). It is not a causal LM
on tokens alone: ``replicas/drafts/hsr_draft.py`` drives it with the target's hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specserve.replicas.drafts import hsr_forward
from specserve.replicas.drafts.pruned_head import PrunedHeadMixin
from specserve.replicas.model.tree_attention import attend_after_cache


class HSRConfig(PretrainedConfig):
    model_type = "specserve_hsr_head"

    def __init__(self, vocab_size: int = 49152, hidden_size: int = 576, intermediate_size: int = 1536,
                 num_attention_heads: int = 9, num_key_value_heads: int = 3, head_dim: int | None = None,
                 rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0, max_position_embeddings: int = 8192,
                 head_token_ids: list[int] | None = None, feature_layer: int = -2,
                 feature_layers: list[int] | None = None, visual_anchor_layer: int | None = None, **kwargs):
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.head_token_ids = [int(t) for t in (head_token_ids or range(vocab_size))]
        # Which of the target's hidden states the head reads, as an index into transformers'
        # ``hidden_states`` tuple: -2 is the output of the second-to-last decoder layer.
        self.feature_layer = feature_layer
        # EAGLE-3: several of them, fused (None: ``feature_layer`` alone). Same indexing.
        self.feature_layers = [int(i) for i in feature_layers] if feature_layers else None
        if self.feature_layers is not None and len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"feature_layers must be distinct, got {self.feature_layers}")
        # Sparrow's IVSB: the target layer whose states fed a picture's positions in training
        # (``training/sparrow_head.py``); such a head drafts with the text-anchored window only.
        self.visual_anchor_layer = visual_anchor_layer

    @classmethod
    def for_target(cls, target_config, head_token_ids: list[int],
                   feature_layers: list[int] | None = None) -> "HSRConfig":
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None), rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
            max_position_embeddings=target_config.max_position_embeddings, head_token_ids=head_token_ids,
            feature_layers=list(feature_layers) if feature_layers and len(feature_layers) > 1 else None,
            feature_layer=feature_layers[0] if feature_layers and len(feature_layers) == 1 else -2,
        )


def feature_layers(config) -> list[int]:
    """The target's hidden states a head reads, in the order its features concatenate them (an
    index each into transformers' ``hidden_states``; configs saved before EAGLE-3 heads name one)."""
    return list(getattr(config, "feature_layers", None) or [getattr(config, "feature_layer", -2)])


def decoder_layer(index: int, num_layers: int) -> int:
    """The decoder layer whose output is ``hidden_states[index]`` of a ``num_layers``-layer model.

    transformers' tuple holds the embeddings, then every layer's output but the last, then the
    last after the final norm: entry i > 0 is layer i - 1's output, entry -i (i >= 2) layer
    L - i's. The embeddings (0) and the normed last state (-1, L) are no layer's output, and no
    tap can read them."""
    layer = index - 1 if index > 0 else num_layers + index
    if not 0 <= layer <= num_layers - 2:
        raise ValueError(f"hidden state {index} of a {num_layers}-layer model is not a decoder layer's output: "
                         f"choose from 1..{num_layers - 1} or -{num_layers}..-2")
    return layer


def stack_features(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """The features of a head reading ``layers``: those entries of transformers' ``hidden_states``
    side by side, [..., T, n·H] (what ``Target.features`` hands a draft, and the cache stores)."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Llama's recipe (the norm in float32, cast back, then scaled); torch's rms_norm is one
        # kernel on CUDA where the spelled-out ops are five.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for ``positions`` [T]: cos, sin [T, head_dim] (Llama's half-split layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Llama attention split in two, so that training can attend over keys of several unrolled
    steps (``training/hsr_train.py``) and inference over its own small cache."""

    def __init__(self, config: HSRConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, repeat_kv: bool = True):
        """x [B, T, H] -> q [B, heads, T, d]; k, v [B, heads, T, d] (kv heads repeated for GQA),
        or [B, kv heads, T, d] without ``repeat_kv``."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not repeat_kv:
            return q, k, v
        groups = self.heads // self.kv_heads
        return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        """attended [B, heads, T, d] -> [B, T, H]"""
        b, _, t, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    """One Llama decoder layer (names as in transformers', so the target's last layer loads in)."""

    def __init__(self, config: HSRConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(config.hidden_size, config.intermediate_size, bias=False),
            "up_proj": nn.Linear(config.hidden_size, config.intermediate_size, bias=False),
            "down_proj": nn.Linear(config.intermediate_size, config.hidden_size, bias=False),
        })

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class HSRHead(PrunedHeadMixin, PreTrainedModel):
    config_class = HSRConfig
    base_model_prefix = "hsr"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: HSRConfig):
        super().__init__(config)
        h = config.hidden_size
        ids = config.head_token_ids
        if len(set(ids)) != len(ids) or not all(0 <= t < config.vocab_size for t in ids):
            raise ValueError(f"head_token_ids must be distinct ids in [0, {config.vocab_size}), got {len(ids)} ids")
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        n = len(feature_layers(config))
        self.fuse = nn.Linear(n * h, h, bias=False) if n > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(ids), bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def features_size(self) -> int:
        """Width of one position's features from the target: n·H for n feature layers."""
        return len(feature_layers(self.config)) * self.config.hidden_size

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fusion of the target's layers into one state: [..., n·H] -> [..., H] (the
        features themselves for a one-layer head)."""
        if features.shape[-1] != self.features_size:
            raise ValueError(f"features of width {features.shape[-1]}; this head reads {self.features_size} "
                             f"(layers {feature_layers(self.config)} of width {self.config.hidden_size})")
        if self.fuse is None:
            return features
        if (fast := hsr_forward.for_head(self)) is not None:
            return fast.fused(features)
        return self.fuse(features)

    def inputs(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 1: ``FC(e_t ⊕ h_{t-1})``. token_ids [B, T], prev_hidden [B, T, H] -> [B, T, H]"""
        if (fast := hsr_forward.for_head(self)) is not None:
            return fast.inputs(token_ids, prev_hidden)
        embeds = self.embed_tokens(token_ids).to(prev_hidden.dtype)
        return self.fc(torch.cat([embeds, prev_hidden], dim=-1))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def head_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's K tokens: [..., K]."""
        if (fast := hsr_forward.for_head(self)) is not None:
            return fast.head_logits(out_hidden)
        return self.lm_head(self.norm(out_hidden))

    def full_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Head logits scattered to full-vocabulary ids, -inf elsewhere: [..., V]."""
        return self.to_full_vocab(self.head_logits(out_hidden))

    def step(self, z: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor | None, past_v: torch.Tensor | None,
             allowed: torch.Tensor | None = None):
        """Run the layer on inputs ``z`` [1, T, H] at ``positions`` [T] after cached keys/values.
        ``allowed`` [T, S] says which keys (cached, then new) each new position sees; default
        causal. returns (out [1, T, H], k, v) where k, v [1, kv heads, T, d] are the new positions'
        keys and values, for the caller to cache (grouped: attention repeats nothing).
        Drafting in bfloat16 on a CPU runs ``hsr_forward``'s packed step, the same maths."""
        if (fast := hsr_forward.for_head(self)) is not None:
            return fast.step(z, positions, past_k, past_v, allowed)
        cos, sin = self.rope(positions, z.dtype)
        x = self.layer.input_layernorm(z)
        q, k, v = self.layer.self_attn.qkv(x, cos, sin, repeat_kv=False)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        attended = attend_after_cache(q, keys, values, allowed)
        hidden = z + self.layer.self_attn.out(attended)
        return self.layer.feed_forward(hidden), k, v

    def forward(self, *args, **kwargs):
        raise TypeError("an HSR head drafts from the target's hidden states: use HSRDraft, not a forward on tokens")


def build_hsr_head(target, head_token_ids: list[int], layers: list[int] | None = None) -> HSRHead:
    """A head for ``target`` (a Llama-family model) reading its hidden states ``layers`` (default:
    the second-to-last layer's output alone): its embeddings (frozen), its last layer as the
    starting point of the head's layer, and its output rows for the head's tokens."""
    num_layers = len(target.model.layers)
    decoder = [decoder_layer(i, num_layers) for i in (layers or [-2])]   # checks each index
    head = HSRHead(HSRConfig.for_target(target.config, head_token_ids, layers))
    last = target.model.layers[-1].state_dict()
    missing, unexpected = head.layer.load_state_dict(last, strict=False)
    if missing or unexpected:
        raise ValueError(f"the target's last layer does not fit the head's: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        # FC starts as [0 | I]: z = h_(t-1), a state the copied layer knows how to read, instead
        # of random directions, which the head learns from markedly slower.
        h = head.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[torch.tensor(head_token_ids)])
        head.norm.weight.copy_(target.model.norm.weight)
        if head.fuse is not None:
            # [0 | ... | I] on the deepest layer: the fused state starts as that layer's output,
            # the single-layer head's input (for [2, 15, -2], the state the copied last layer reads).
            deepest = max(range(len(decoder)), key=decoder.__getitem__)
            head.fuse.weight.zero_()
            head.fuse.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
    head.embed_tokens.weight.requires_grad_(False)
    return head.float().to(target.device)


AutoConfig.register(HSRConfig.model_type, HSRConfig, exist_ok=True)
AutoModelForCausalLM.register(HSRConfig, HSRHead, exist_ok=True)
