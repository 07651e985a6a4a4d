"""Low-rank adapters on a language model's linear layers, for a stage that must teach it too.

LoRA (*LoRA: Low-Rank Adaptation of Large Language Models*): each adapted ``nn.Linear`` computes
``x Wᵀ + (α / r) · x Aᵀ Bᵀ`` with ``W`` frozen, ``A`` [r, in] drawn small and ``B`` [out, r] zero, so
training starts from the model as it was. The delta is added to the layer's output (a forward
hook), not to ``W``: in bfloat16 a small ``B A`` added to the weight would round away. An export
stores only ``A`` and ``B`` per layer, which ``replicas.vlm.merge_text_lora`` folds into the
weights at load (``W + (α / r) B A``), so serving runs plain linear layers.

Written here rather than taken from PEFT: it is a hook and two matrices a layer, and serving needs
only the merge, which no extra dependency should carry.
"""

from __future__ import annotations

import math

import torch

# The projections of a Llama-style decoder layer that learn: attention (which relates one frame's
# tokens to another's) and the MLP.
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LowRank(torch.nn.Module):
    """A linear layer's adapter: ``A`` [rank, in] and ``B`` [out, rank], float32."""

    def __init__(self, linear: torch.nn.Linear, rank: int):
        super().__init__()
        device = linear.weight.device
        self.A = torch.nn.Parameter(torch.empty(rank, linear.in_features, device=device))
        torch.nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))   # as nn.Linear draws its own weight
        self.B = torch.nn.Parameter(torch.zeros(linear.out_features, rank, device=device))


def add_lora(body: torch.nn.Module, rank: int, alpha: float) -> list[torch.nn.Parameter]:
    """Adapt every ``ADAPTED`` projection under ``body`` (a submodule ``lora`` of each) and return
    the adapters' parameters, the only ones of ``body`` that learn."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1; got {rank}")
    scale = alpha / rank

    def delta(module, args, out):
        x = args[0]
        lora = module.lora
        return out + scale * torch.nn.functional.linear(torch.nn.functional.linear(x, lora.A.to(x.dtype)),
                                                        lora.B.to(x.dtype))

    learned = []
    for name, module in list(body.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ADAPTED:
            module.add_module("lora", LowRank(module, rank))
            module.register_forward_hook(delta)
            learned += [module.lora.A, module.lora.B]
    if not learned:
        raise ValueError("no projection to adapt: the body has none of " + ", ".join(ADAPTED))
    return learned


def lora_tensors(weights: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The adapters among ``weights`` (a state dict whose language model body's keys start with
    ``prefix``) as ``<layer>.lora_A`` / ``<layer>.lora_B``, names relative to that body: what an
    export stores and ``merge_text_lora`` reads."""
    return {k.removeprefix(prefix).replace(".lora.", ".lora_"): v.detach() for k, v in weights.items() if ".lora." in k}
