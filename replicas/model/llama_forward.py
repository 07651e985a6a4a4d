"""A forward of our own for Llama-family models over the slot cache: the same maths as Hugging
Face's, in fewer and larger operations.

Why: at batch 1 a 135M-parameter model's forward is a few hundred small operations, and on a CPU
each costs microseconds of dispatch whatever its size. Hugging Face's eager Llama runs seven
matrix products per layer (q, k, v, o, gate, up, down) plus modules, hooks and masks
around them. Here:

- q, k and v are one product (their weights stacked), and gate and up another: four per layer;
- the residual add and the RMSNorm after it are one pass (the norm computed in float32, as
  Hugging Face does, then cast back): on the CPU a C kernel (``cpu_row_ops``), on CUDA a kernel
  inductor generates, as it does for rotary and SiLU(gate) * up (``fused_elementwise``);
- rotary embeddings come from a table built once (the values Hugging Face computes per call:
  float32 ``position * inv_freq``, cos/sin, times ``attention_scaling``, cast to the model's
  dtype), applied to q and k in one go;
- attention reads the slot buffers of ``BatchKV`` directly, with grouped-query heads (no repeat
  of k/v): on the CPU a verify step runs ``flat`` (no padding; the C kernels of ``cpu_attention``
  and ``cpu_row_ops``), elsewhere ``__call__`` runs rows padded to the longest feed, its attention
  one fused ``scaled_dot_product_attention`` per layer (``sdpa_attention``), on CUDA under graphs
  (``cuda_graphs``).

The Hugging Face module keeps working: the stacked weights are the storage and the original
``q_proj``/``k_proj``/... parameters become views into them, so memory is not doubled and the eager
path (features for training, tests) sees the same numbers.

Which models: ``model_type`` llama, mistral or qwen2 (q/k/v biases), SiLU MLP, no per-head
q/k norms. Anything else takes the Hugging Face path in ``BatchKV``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.replicas.model import cpu_attention, cpu_row_ops, fused_elementwise, image_tokens, mrope, small_gemm
from specserve.replicas.model.fused_elementwise import ElementwiseOps
from specserve.replicas.model.int8_linear import Int8Linear


# The zoo's pruned-head draft LM (``drafts/pruned_head.py``) is a Llama with its own model type.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "specserve_pruned_head_llama")
# The attribute a loaded model carries its ``quantization`` in (``model_store.load_causal_lm`` sets it).
QUANTIZATION = "specserve_quantization"
STANDARD_FORWARDS = ("LlamaForCausalLM.forward", "MistralForCausalLM.forward", "Qwen2ForCausalLM.forward")
# Rotary variants whose frequencies change with the sequence length: a table built once would be wrong.
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def supports(model) -> bool:
    """True when ``model`` is a Llama-family causal LM this forward reproduces exactly."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if config is None or layers is None or getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(config, "hidden_act", None) != "silu" or not hasattr(model.model, "rotary_emb"):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in SEQUENCE_DEPENDENT_ROPE:
        return False
    # A class that overrides ``forward`` computes its logits its own way; we reproduce only the
    # standard output layer and a pruned head (``to_full_vocab``: logits of a subset of ids).
    if type(model).forward.__qualname__ not in STANDARD_FORWARDS and not hasattr(model, "to_full_vocab"):
        return False
    attn = layers[0].self_attn
    return not hasattr(attn, "q_norm") and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def quantization(model) -> str | None:
    """How the model's weights are to be rounded for its products (``model_store.load_causal_lm``)."""
    return getattr(model, QUANTIZATION, None)


def for_model(model) -> "LlamaForward":
    """The model's one ``LlamaForward`` (stacking and packing its weights happens once)."""
    forward = getattr(model, "_specserve_llama_forward", None)
    if forward is None:
        forward = LlamaForward(model)
        model._specserve_llama_forward = forward
    return forward


def _stack(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears of the same input; each linear's parameters
    become views into it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("cannot stack linears of which only some have a bias")
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


@dataclass(frozen=True)
class FlatStep:
    """A flat (ragged) step for ``LlamaForward.flat``, built by ``batch_kv.BatchKV``: the feeds' tokens one after another, no
    padding. ``sequences`` int64 [N, 4]: (slot, first token, tokens, cached positions) per feed;
    ``token_slots``, ``columns`` int64 [1, T]: where each token's key and value go; ``mask``
    [T, W] float32: 0 where a token sees the c-th new token of its own feed (its chain or tree
    ancestors and itself), -inf elsewhere (cached positions are always seen); ``length``: the
    longest feed's cached + new positions."""

    sequences: torch.Tensor
    token_slots: torch.Tensor
    columns: torch.Tensor
    mask: torch.Tensor
    length: int


class Linear:
    """``y = x W^T + b``. On a CPU with oneDNN, 16-bit weights are packed once into oneDNN's
    blocked layout, whose products of a few rows run faster than ``F.linear``'s with bitwise-equal
    results. Float32 weights stay as they are: oneDNN's float32 result differs from
    ``F.linear``'s in the last bits and may depend on the batch size, and float32 is the dtype
    the exactness tests run in."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False):
        """``int8``: a draft's weight rounded to int8 rows where it is float32 on the CPU
        (``int8_linear``); elsewhere the weight stays as it is."""
        self.weight, self.bias = weight, bias
        self.packed = None
        self.int8 = Int8Linear(weight, bias) if int8 and Int8Linear.takes(weight) else None
        if self.int8 is None and packable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        # Float32 products of a step's few rows in one pass over the weights, where that pays here.
        self.few_rows = self.packed is None and self.int8 is None and small_gemm.takes(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.few_rows:
            return small_gemm.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack ``weight``: a 16-bit CPU weight, on a CPU whose instructions oneDNN
    has a path for in that dtype (without AVX-512 or AVX-NE-CONVERT it has none and refuses)."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return _onednn_supports(weight.dtype)


@functools.cache
def _onednn_supports(dtype: torch.dtype) -> bool:
    mkldnn = torch.ops.mkldnn
    check = mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported
    return bool(check())


class _Layer:
    def __init__(self, layer, int8: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Linear(*_stack([attn.q_proj, attn.k_proj, attn.v_proj]), int8=int8)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias, int8=int8)
        self.gate_up = Linear(*_stack([mlp.gate_proj, mlp.up_proj]), int8=int8)
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias, int8=int8)
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.module = layer


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  ops: ElementwiseOps | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, its RMSNorm): ``ops`` None: in one C pass on the CPU (``cpu_row_ops``; h
    updated in place), else ``ops``'s (``fused_elementwise``)."""
    if ops is None:
        return h, cpu_row_ops.add_rms_norm(h, delta, weight, eps)
    return ops.add_rms_norm(h, delta, weight, eps)


# Bytes of float32 scores one block of query rows may take (see ``_attention``).
SCORES_BLOCK_BYTES = 1 << 21


def query_blocks(mask: torch.Tensor, heads: int) -> list[tuple[int, int, int]]:
    """How ``_attention`` splits a forward's query rows: (first row, end row, keys seen) per
    block, computed once per forward from the additive mask [B, 1, S, L] (the same for every
    layer).

    A block's float32 scores stay within ``SCORES_BLOCK_BYTES``: a prefill chunk's [heads, S, L]
    scores in one piece leave the CPU's caches (495 new tokens, 9 heads: 8.8 MB), and the softmax
    and both products then run from memory. And a block reads only the keys up to the last one
    any of its rows may see: under a causal mask, the later keys are masked for all its rows, and
    their products need not be computed (about half of a fresh prompt's; docs/benchmarks.md
    §2.4)."""
    B, _, S, L = mask.shape
    rows = max(16, SCORES_BLOCK_BYTES // (4 * B * heads * L))
    if rows >= S or mask.device.type != "cpu":   # sized for a CPU's caches; elsewhere, no device sync
        return [(0, S, L)]
    seen = mask[:, 0] == 0                                   # [B, S, L]
    blocks = []
    for s0 in range(0, S, rows):
        s1 = min(S, s0 + rows)
        cols = seen[:, s0:s1].any(dim=1).any(dim=0)          # [L]: keys any row of the block sees
        end = L - int(torch.flip(cols, dims=[0]).to(torch.int8).argmax()) if bool(cols.any()) else L
        blocks.append((s0, s1, end))
    return blocks


def _mlp(layer: _Layer, h: torch.Tensor, attn: torch.Tensor,
         ops: ElementwiseOps | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a decoder layer after attention (both layouts): output projection, residual,
    norm, SiLU MLP. Returns (h, the MLP's output): the last residual add is left to the next
    norm, which adds it in the same pass (``_add_rms_norm``)."""
    h, x = _add_rms_norm(h, layer.o(attn), layer.norm2, layer.eps2, ops)
    gate_up = layer.gate_up(x)
    if ops is None:   # torch's vectorised exp: cpu_row_ops matches nothing else
        gate, up = gate_up.chunk(2, dim=-1)
        return h, layer.down(F.silu(gate) * up)
    return h, layer.down(ops.silu_mul(gate_up))


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               blocks: list[tuple[int, int, int]], grouped_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``_attention_block`` over the ``query_blocks``. Each row is computed on its own and a key a
    row cannot see has a probability of exactly 0, so blocking changes the result at most in the
    last bit (the softmax and the product sum over a block's own key count). With
    ``grouped_mask`` (``sdpa_mask``), off the CPU: ``sdpa_attention``."""
    if grouped_mask is not None:
        return sdpa_attention(q, keys, values, grouped_mask)
    if len(blocks) == 1 and blocks[0][2] == keys.shape[2]:
        return _attention_block(q, keys, values, mask)
    return torch.cat([_attention_block(q[:, :, s0:s1], keys[:, :, :end], values[:, :, :end], mask[:, :, s0:s1, :end])
                      for s0, s1, end in blocks], dim=2)


def _attention_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention, softmax in float32 (Hugging Face's eager recipe).

    q: [B, nq, S, D]; keys, values: [B, nkv, L, D]; mask: [B, 1, S, L] additive -> [B, nq, S, D].
    Query heads h use kv head h // (nq / nkv), so a group's queries are stacked into one product
    with their kv head instead of repeating k and v. On the CPU this is faster than
    ``scaled_dot_product_attention`` for a step's few query rows and for prefill chunks in the
    blocks of ``query_blocks``, because the grouped product reads each kv head once."""
    B, nq, S, D = q.shape
    nkv, L = keys.shape[1], keys.shape[2]
    group = nq // nkv
    # The cache hands out views strided by its capacity; oneDNN's bfloat16 product of q with such a
    # view, transposed, is several times slower than a copy plus the product on the dense copy
    # (docs/benchmarks.md §2.6).
    # (float32 and other devices take the strided view as it is: a copy there only costs.)
    if keys.device.type == "cpu" and keys.dtype != torch.float32:
        keys, values = keys.contiguous(), values.contiguous()
    scores = torch.matmul(q.reshape(B, nkv, group * S, D), keys.transpose(-1, -2)) * D ** -0.5
    scores = scores.view(B, nkv, group, S, L) + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(B, nkv, group * S, L), values).view(B, nq, S, D)


def uses_sdpa(device: torch.device) -> bool:
    """Attention through ``scaled_dot_product_attention`` (fused kernels: one launch per layer
    instead of five, and no [S, L] scores in memory) off the CPU; the CPU keeps
    ``_attention_block``, faster there for a step's few rows."""
    return device.type != "cpu"


def sdpa_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The additive mask [B, 1, S, L] repeated for the ``groups`` query heads that share a kv head
    ([B, 1, groups * S, L]), built once per forward for ``sdpa_attention``'s stacked queries."""
    B, _, S, L = mask.shape
    return mask[:, :, None].expand(B, 1, groups, S, L).reshape(B, 1, groups * S, L)


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, grouped_mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention in one fused kernel: each kv head's query heads stacked as one
    head's rows (as ``_attention_block`` does), so any backend takes it without repeating keys and
    values. q: [B, nq, S, D]; keys, values: [B, nkv, L, D]; grouped_mask: ``sdpa_mask``."""
    B, nq, S, D = q.shape
    nkv = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, nkv, (nq // nkv) * S, D), keys, values,
                                         attn_mask=grouped_mask, scale=D ** -0.5)
    # The fused kernels may hand back heads and rows in another memory order: reshape, not view.
    return out.reshape(B, nq, S, D)


class LlamaForward:
    """``__call__(ids, positions, mask, cache_layers, keep)`` -> logits ``[B, keep, V]``, writing
    each layer's keys and values through ``cache_layers[i].update`` (``batch_kv.SlotLayer``)."""

    def __init__(self, model):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) is not a Llama-family model")
        config = model.config
        inner = model.model
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        int8 = quantization(model) == "int8"
        with torch.no_grad():
            self.layers = [_Layer(layer, int8) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight
        self.norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        head = model.get_output_embeddings()
        self.lm_head = Linear(head.weight, head.bias, int8=int8)
        self.to_full_vocab = getattr(model, "to_full_vocab", None)   # pruned heads (drafts/pruned_head.py)
        self._cos = self._sin = None
        # Tables outgrown, kept alive: a CUDA graph captured before a growth reads the table it saw.
        self._outgrown: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rotary = inner.rotary_emb
        # Qwen2-VL's M-RoPE: the dimensions that turn by a token's h and w positions (mrope.py).
        sections = getattr(self._rotary, "mrope_section", None)
        self._mrope_dims = None if sections is None else mrope.section_dims(list(sections), self.head_dim)
        # The elementwise pieces' implementation (``fused_elementwise``); None: the device's.
        self.elementwise: ElementwiseOps | None = None

    def _rope_table(self, needed: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..needed-1, exactly as the model's rotary module computes them."""
        if self._cos is None or len(self._cos) < needed or self._cos.dtype != dtype:
            size = max(needed, 2 * (0 if self._cos is None else len(self._cos)), 1024)
            positions = torch.arange(size, device=device)[None]
            probe = torch.empty(0, device=device, dtype=dtype)
            cos, sin = self._rotary(probe, positions)
            if self._cos is not None:
                self._outgrown.append((self._cos, self._sin))
            self._cos, self._sin = cos[0], sin[0]   # [positions, head_dim]
        return self._cos, self._sin

    def _mrope_dims_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's h and w dimension masks on ``device``, sent once (a CUDA graph's capture may
        not copy from the host)."""
        if self._mrope_dims[0].device != device:
            self._mrope_dims = tuple(d.to(device) for d in self._mrope_dims)
        return self._mrope_dims

    def _rotary_rows(self, cos_t: torch.Tensor, sin_t: torch.Tensor, positions: torch.Tensor,
                     spatial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [..., D] at ``positions``; with M-RoPE's ``spatial`` offsets ([..., 2]: dh,
        dw) the h and w sections come from the rows at p + dh and p + dw."""
        cos, sin = cos_t[positions], sin_t[positions]
        if spatial is not None:
            h_dims, w_dims = self._mrope_dims_on(cos.device)
            at_h, at_w = positions + spatial[..., 0], positions + spatial[..., 1]
            cos = torch.where(h_dims, cos_t[at_h], torch.where(w_dims, cos_t[at_w], cos))
            sin = torch.where(h_dims, sin_t[at_h], torch.where(w_dims, sin_t[at_w], sin))
        return cos, sin

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache_layers, keep: int,
                 tap=None, images=None, spatial: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions: [B, S]; mask: [B, 1, S, kv_len] additive; returns logits [B, keep, V].
        ``tap`` (a ``target.FeatureTap``) receives the outputs of the decoder layers it watches;
        ``images`` (an ``image_tokens.ImageStore``) embeds the image tokens among ``ids``;
        ``spatial`` [B, S, 2]: M-RoPE's h and w offsets (``mrope.py``)."""
        B, S = ids.shape
        nq, nkv, D = self.heads, self.kv_heads, self.head_dim
        h = image_tokens.embed(ids, self.embed, images)        # [B, S, hidden]
        # Every position is below the key length (no device sync to find the largest one).
        cos_t, sin_t = self._rope_table(mask.shape[-1], h.device, h.dtype)
        cos, sin = self._rotary_rows(cos_t, sin_t, positions, spatial)
        cos, sin = cos[:, :, None], sin[:, :, None]             # [B, S, 1, D]
        ops = self.elementwise_ops(h)
        blocks = query_blocks(mask, nq)
        grouped = sdpa_mask(mask, nq // nkv) if uses_sdpa(h.device) else None
        if ops is None:
            cos_rows, sin_rows = cos[:, :, 0].contiguous(), sin[:, :, 0].contiguous()   # [B, S, D]
        delta = None   # the last layer's MLP output, added to h by the next norm
        for index, layer in enumerate(self.layers):
            h, x = _add_rms_norm(h, delta, layer.norm1, layer.eps1, ops)
            qkv = layer.qkv(x).view(B, S, nq + 2 * nkv, D)
            if ops is None:   # one C pass, q and k written in the layout attention and the cache take
                q, k = cpu_row_ops.rope(qkv, cos_rows, sin_rows, nq, nkv)
            else:
                q, k = ops.rope(qkv, cos, sin, nq, nkv)        # [B, nq, S, D], [B, nkv, S, D]
            v = qkv[:, :, nq + nkv:].transpose(1, 2)
            keys, values = cache_layers[index].update(k, v)    # [B, nkv, kv_len, D] views
            attn = _attention(q, keys, values, mask, blocks, grouped).transpose(1, 2).reshape(B, S, nq * D)
            h, delta = _mlp(layer, h, attn, ops)
            if tap is not None and (tapped := tap.layer_of(layer.module)) is not None:
                h, delta = h + delta, None
                tap.keep(tapped, h.clone() if ops is None else h)   # the C norm adds to h in place
        last = None if delta is None else delta[:, -keep:].contiguous()
        _, x = _add_rms_norm(h[:, -keep:].contiguous(), last, self.norm, self.eps, ops)
        logits = self.lm_head(x)
        return logits if self.to_full_vocab is None else self.to_full_vocab(logits)

    def elementwise_ops(self, h: torch.Tensor) -> ElementwiseOps | None:
        """How this forward runs the pieces between its products (``fused_elementwise``): compiled
        when ``self.elementwise`` asks for them; with gradients torch's eager ops; else None for
        ``cpu_row_ops``' C kernels on the CPU, else the eager ops when ``self.elementwise`` asks
        for them, else the device's (compiled on CUDA)."""
        if self.elementwise is not None and self.elementwise.fused:
            return self.elementwise
        if torch.is_grad_enabled():
            return fused_elementwise.EAGER
        if cpu_row_ops.usable(h):
            return None
        return fused_elementwise.EAGER if self.elementwise is not None else fused_elementwise.for_device(h.device)

    def fuses(self, device: torch.device) -> bool:
        """Whether steps without gradients on ``device`` run compiled elementwise pieces."""
        return self.elementwise.fused if self.elementwise is not None else fused_elementwise.available(device)

    def flat_usable(self, new_tokens: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a step whose feeds have at most ``new_tokens`` tokens each can run ``flat``: on
        the CPU with both C kernels (a feed longer than ``cpu_attention.MAX_NEW_TOKENS``, a GPU, no
        compiler, or fused elementwise kernels asked for take the padded path)."""
        return (not self.fuses(device) and cpu_attention.usable(device, dtype, new_tokens, self.heads, self.kv_heads, self.head_dim)
                and device.type == "cpu" and cpu_row_ops.library() is not None)

    def flat(self, ids: torch.Tensor, positions: torch.Tensor, step: FlatStep, buffers, keep: torch.Tensor,
             tap=None, images=None, spatial: torch.Tensor | None = None) -> torch.Tensor:
        """A step on the CPU (a verification or a short prefill) with its tokens flat (ragged):
        ids, positions [T], the sequences one after another; ``step`` says where each sequence's
        tokens are and what they see (``FlatStep``); ``buffers[i]`` = layer i's (keys,
        values) slot buffers, into which this step's keys and values are written; ``keep`` [R]:
        the tokens whose logits come back ([R, V]). Only ``cpu_attention.usable`` steps come here.

        Why flat: padded to the longest feed, one request verifying 5 tokens makes every row of a
        batch of 16 five tokens wide (80 tokens through every linear instead of 20). Here every
        linear, norm and rotary runs over exactly the tokens fed. Each tapped output is [1, T, hidden]."""
        T = ids.shape[0]
        nq, nkv, D = self.heads, self.kv_heads, self.head_dim
        h = image_tokens.embed(ids, self.embed, images)        # [T, hidden]
        cos_t, sin_t = self._rope_table(step.length, h.device, h.dtype)
        cos, sin = self._rotary_rows(cos_t, sin_t, positions, spatial)
        cos, sin = cos[None], sin[None]                           # [1, T, D]
        delta = None   # as in ``__call__``
        for index, layer in enumerate(self.layers):
            h, x = _add_rms_norm(h, delta, layer.norm1, layer.eps1, None)
            qkv = layer.qkv(x).view(1, T, nq + 2 * nkv, D)
            q, k = cpu_row_ops.rope(qkv, cos, sin, nq, nkv)    # [1, nq, T, D], [1, nkv, T, D]
            v = qkv[:, :, nq + nkv:].transpose(1, 2)           # [1, nkv, T, D] view
            keys, values = buffers[index]
            if not (cpu_attention.write(keys, k, step.token_slots, step.columns)
                    and cpu_attention.write(values, v, step.token_slots, step.columns)):
                raise RuntimeError("the flat step could not write its keys and values into the slot cache")
            attn = cpu_attention.attention(q[0], keys, values, step.sequences, step.mask, step.length)
            h, delta = _mlp(layer, h, attn, None)
            if tap is not None and (tapped := tap.layer_of(layer.module)) is not None:
                h, delta = h + delta, None
                tap.keep(tapped, h[None].clone())   # the next layer adds to h in place
        _, x = _add_rms_norm(h[keep], None if delta is None else delta[keep], self.norm, self.eps, None)
        logits = self.lm_head(x)
        return logits if self.to_full_vocab is None else self.to_full_vocab(logits)
