"""The HSR head's drafting step of fewer operations computes what the module computes: packed
(bfloat16 on a CPU with oneDNN) and with int8 rows (float32; the module given the same rounded
weights)."""

import pytest
import torch

from specserve.replicas.model import int8_linear
from specserve.replicas.drafts import hsr_forward
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.drafts.hsr_head import build_hsr_head
from specserve.replicas.model.llama_forward import QUANTIZATION
from specserve.replicas.sampling import SamplingParams
from tiny_models import VOCAB, rounded_to_int8_rows, tiny_model

# A pruned head over every third id, in an order that is not the ids' own: the chain must map
# the head's index back to the id.
HEAD_IDS = list(range(VOCAB - 1, 0, -3))


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def head(request):
    target = tiny_model("llama", seed=0, layers=3)
    head = build_hsr_head(target, HEAD_IDS).eval()
    with torch.no_grad():
        # Large values make attention move the output well past bfloat16's rounding, so that a
        # wrong mask or rotary shows (unscaled, dropping the tree mask moves it by 0.3%).
        head.layer.self_attn.v_proj.weight.mul_(20.0)
    if request.param == "int8":
        rounded_to_int8_rows(head)
        setattr(head, QUANTIZATION, "int8")
    else:
        head = head.to(torch.bfloat16)
    with torch.inference_mode():
        if hsr_forward.for_head(head) is None:
            pytest.skip(f"no {request.param} path here (no oneDNN or no C compiler for the kernels)")
    return head


def dtype_of(head) -> torch.dtype:
    return head.fc.weight.dtype


def module_path(fn):
    """Run ``fn`` on the module path: with gradients on, ``for_head`` declines."""
    with torch.enable_grad():
        out = fn()
    return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Within 1% (bfloat16 keeps 8 bits of mantissa and the kernels sum in another order than
    # torch's); dropping the tree mask moves the output by 5%, swapping cos and sin by more.
    return torch.allclose(a.float(), b.float(), rtol=0.01, atol=0.01 * float(b.float().abs().max()))


def test_the_module_path_is_taken_for_float32_and_for_training():
    target = tiny_model("llama", seed=0, layers=2)
    head = build_hsr_head(target, HEAD_IDS)
    with torch.inference_mode():
        assert hsr_forward.for_head(head) is None            # float32: the exactness tests' dtype
    head = head.to(torch.bfloat16)
    assert hsr_forward.for_head(head) is None                # gradients wanted
    head = build_hsr_head(target, HEAD_IDS)
    setattr(head, QUANTIZATION, "int8")
    with torch.inference_mode():
        assert (hsr_forward.for_head(head) is not None) == (int8_linear.library() is not None)


@pytest.mark.parametrize("new", [1, 4])
def test_a_step_equals_the_modules_after_a_cache(head, new):
    h = head.config.hidden_size
    gen = torch.Generator().manual_seed(new)
    tokens = torch.randint(1, VOCAB, (1, 9 + new), generator=gen)
    prev = torch.randn(1, 9 + new, h, generator=gen).to(dtype_of(head))
    with torch.inference_mode():
        z_fast = head.inputs(tokens, prev)
        cache_fast = head.step(z_fast[:, :9], torch.arange(1, 10), None, None)
        fast = head.step(z_fast[:, 9:], torch.arange(10, 10 + new), cache_fast[1], cache_fast[2])
        logits_fast = head.head_logits(fast[0])
    z = module_path(lambda: head.inputs(tokens, prev))
    cache = module_path(lambda: head.step(z[:, :9], torch.arange(1, 10), None, None))
    slow = module_path(lambda: head.step(z[:, 9:], torch.arange(10, 10 + new), cache[1], cache[2]))
    logits = module_path(lambda: head.head_logits(slow[0]))
    assert close(z_fast, z)
    assert all(close(a, b) for a, b in zip(cache_fast, cache))
    assert all(close(a, b) for a, b in zip(fast, slow))
    assert fast[1].shape[1] == head.config.num_key_value_heads   # grouped: kv heads only, no repeat
    assert close(logits_fast, logits)


def test_a_tree_levels_mask_is_honoured(head):
    h = head.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(1, 8, h, generator=gen).to(dtype_of(head))
    allowed = torch.zeros(3, 8, dtype=torch.bool)
    allowed[:, :5] = True
    allowed[0, 5], allowed[1, 6], allowed[2, 5:] = True, True, True   # siblings 0, 1 and a child of 0
    with torch.inference_mode():
        _, k, v = head.step(z[:, :5], torch.arange(1, 6), None, None)
        fast = head.step(z[:, 5:], torch.tensor([6, 6, 7]), k, v, allowed)
    slow = module_path(lambda: head.step(z[:, 5:], torch.tensor([6, 6, 7]), k, v, allowed))
    assert all(close(a, b) for a, b in zip(fast, slow))


def test_greedy_chains_choose_among_the_heads_ids(head):
    draft = HSRDraft("hsr", head)
    context = list(range(3, 40))
    rows = torch.randn(len(context) - 1, head.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        proposal = draft.propose(context, 4, SamplingParams(), None, features=rows.to(dtype_of(head)), features_start=0)
    assert len(proposal.tokens) == 4 and set(proposal.tokens) <= set(HEAD_IDS)
    assert proposal.draft_probs is None and all(0.0 < p <= 1.0 for p in proposal.token_probs)
    # The first token and its probability are the full-vocabulary argmax and softmax of the root.
    with torch.inference_mode():
        full = head.full_logits(draft.session.root_hidden())[0, -1].float()
    assert proposal.tokens[0] == int(full.argmax())
    assert proposal.token_probs[0] == pytest.approx(float(torch.softmax(full, -1).max()), rel=1e-3)


def test_sampled_chains_carry_q_over_the_whole_vocabulary(head):
    draft = HSRDraft("hsr", head)
    context = list(range(3, 40))
    rows = torch.randn(len(context) - 1, head.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        proposal = draft.propose(context, 3, SamplingParams(temperature=0.8), torch.Generator().manual_seed(0),
                                 features=rows.to(dtype_of(head)), features_start=0)
    q = proposal.draft_probs
    assert q.shape == (3, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[HEAD_IDS] = False
    assert float(q[:, outside].abs().max()) == 0.0 and torch.allclose(q.float().sum(-1), torch.ones(3), atol=1e-3)
