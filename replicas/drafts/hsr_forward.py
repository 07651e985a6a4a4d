"""The HSR head's drafting step in fewer, larger operations (what ``llama_forward`` does for the target).

Why: drafting one token is one decoder layer and a 8,192-row head, ~8M weights, yet the module
path runs ~40 small operations, each paying dispatch, and ``F.linear``'s bfloat16 path, whose
cost dominates a one-token step; fewer, larger operations make the head cheap enough to compete
with prompt lookup (figures: docs/benchmarks.md §6.1).

- the projections are oneDNN-packed ``llama_forward.Linear``s, q/k/v stacked into one and gate/up
  into another;
- RMSNorm and the rotary embedding are the C row kernels (``cpu_row_ops``), rotary angles come
  from a table grown on demand (the values ``hsr_head.rope_cos_sin`` computes per call);
- the head's cache holds the key/value heads only and attention reads them grouped
  (``enable_gqa``), as ``HSRHead.step`` does.

The numbers are the module's to rounding (the kernels sum in another order); a draft's proposal
only changes speed, never the output, since verification decides. Used where no gradient is
wanted and the products have a faster path than the module's: weights that pack (bfloat16/float16
on a CPU with oneDNN), a float32 output layer large enough for the few-rows kernel
(``small_gemm``), or int8 rows (``quantization: int8``, ``int8_linear``). Small float32 heads,
where the exactness tests run, and training keep the module path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.replicas.model import cpu_row_ops, small_gemm
from specserve.replicas.model.int8_linear import Int8Linear
from specserve.replicas.model.llama_forward import Linear, packable, quantization
from specserve.replicas.model.tree_attention import attend_after_cache


def for_head(head) -> "HSRForward | None":
    """The head's packed step, built once; None where the module path must run (see above)."""
    weight = head.fc.weight
    if torch.is_grad_enabled() or not cpu_row_ops.usable(weight):
        return None
    if not (packable(weight) or (quantization(head) == "int8" and Int8Linear.takes(weight))
            or small_gemm.takes(head.lm_head.weight)):
        return None
    forward = head.__dict__.get("_specserve_hsr_forward")
    if forward is None:
        forward = head.__dict__["_specserve_hsr_forward"] = HSRForward(head)
    return forward


class HSRForward:
    def __init__(self, head):
        layer, attn, mlp = head.layer, head.layer.self_attn, head.layer.mlp
        self.head = head
        self.heads, self.kv_heads, self.head_dim = attn.heads, attn.kv_heads, attn.head_dim
        self.intermediate = head.config.intermediate_size
        int8 = quantization(head) == "int8"

        def linear(*linears) -> Linear:
            return Linear(torch.cat([lin.weight.detach() for lin in linears]), None, int8=int8)

        self.fc = linear(head.fc)
        self.fuse = None if head.fuse is None else linear(head.fuse)
        self.qkv = linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = linear(attn.o_proj)
        self.gate_up = linear(mlp["gate_proj"], mlp["up_proj"])
        self.down = linear(mlp["down_proj"])
        self.lm_head = linear(head.lm_head)
        self.norms = [(n.weight.detach(), n.eps) for n in (layer.input_layernorm, layer.post_attention_layernorm, head.norm)]
        self._cos = self._sin = None

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, d] of ``positions`` from the table (doubled when a position passes its end)."""
        last = int(positions.max())
        if self._cos is None or last >= self._cos.shape[0]:
            size = max(1024, 2 * (last + 1))
            self._cos, self._sin = self.head.rope(torch.arange(size, device=positions.device), dtype)
        return self._cos[positions][None], self._sin[positions][None]

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fusion, ``fuse(h^low ⊕ h^mid ⊕ h^high)``: [..., n·H] -> [..., H] (``HSRHead.fused``)."""
        return self.fuse(features.contiguous())

    def inputs(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """Sparrow Eq. 1, ``FC(e_t ⊕ h_{t-1})``: token_ids [1, T], prev_hidden [1, T, H] -> [1, T, H]."""
        embeds = self.head.embed_tokens(token_ids).to(prev_hidden.dtype)
        return self.fc(torch.cat([embeds, prev_hidden], dim=-1))

    def step(self, z: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor | None,
             past_v: torch.Tensor | None, allowed: torch.Tensor | None = None):
        """``HSRHead.step``'s contract: out [1, T, H] and the new positions' k, v [1, kv heads, T, d]."""
        (norm1, eps1), (norm2, eps2), _ = self.norms
        t = z.shape[1]
        z = z.contiguous()
        x = cpu_row_ops.add_rms_norm(z, None, norm1, eps1)
        qkv = self.qkv(x).view(1, t, self.heads + 2 * self.kv_heads, self.head_dim)
        cos, sin = self._rope_rows(positions, z.dtype)
        q, k = cpu_row_ops.rope(qkv, cos, sin, self.heads, self.kv_heads)
        v = qkv[:, :, self.heads + self.kv_heads:].transpose(1, 2)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        attended = attend_after_cache(q, keys, values, allowed)
        hidden = z + self.o(attended.transpose(1, 2).reshape(1, t, -1))
        h = cpu_row_ops.add_rms_norm(hidden, None, norm2, eps2)
        gate_up = self.gate_up(h)
        out = hidden + self.down(F.silu(gate_up[..., :self.intermediate]) * gate_up[..., self.intermediate:])
        return out, k, v.contiguous()

    def head_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's K tokens [..., K] (``HSRHead.head_logits``)."""
        _, _, (norm, eps) = self.norms
        return self.lm_head(cpu_row_ops.add_rms_norm(out_hidden.contiguous(), None, norm, eps))
