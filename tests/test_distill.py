"""Distillation on tiny models: the student starts as a faithful copy of the target, training
lowers the loss, and a run stopped mid-way resumes to exactly the weights of an unbroken run."""

import pytest
import torch

from specserve.replicas.distill import DistillConfig, build_student, distill, distill_loss, most_frequent_tokens
from tiny_models import VOCAB, tiny_model


def batches(start: int, batch: int = 4, length: int = 16):
    """Batch i is a pure function of i, so a resumed run sees exactly the batches it had not seen."""
    i = start
    while True:
        gen = torch.Generator().manual_seed(i)
        # A skewed token distribution, as real text has: low ids are frequent.
        ids = torch.minimum(torch.randint(0, VOCAB, (batch, length), generator=gen),
                            torch.randint(0, VOCAB, (batch, length), generator=gen))
        yield ids, torch.ones(batch, length)
        i += 1


def test_most_frequent_tokens_keeps_the_required_ones():
    seqs = [[1, 1, 1, 2, 2, 3], [1, 2, 9]]
    # 1 (4x) and 2 (3x) are the most frequent; 42 must be there whatever its count.
    assert most_frequent_tokens(seqs, k=3, always=[42]) == [1, 2, 42]


def test_a_full_depth_full_head_student_is_the_target():
    teacher = tiny_model("llama", seed=0, layers=2)
    student = build_student(teacher, layers=2, head_token_ids=list(range(VOCAB))).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.allclose(student(input_ids=ids).logits, teacher(input_ids=ids).logits, atol=1e-5)
    assert not student.model.embed_tokens.weight.requires_grad, "embeddings stay the target's"


def test_kl_is_zero_for_the_teacher_itself_and_positive_otherwise():
    logits = torch.randn(2, 5, VOCAB)
    head = torch.arange(0, VOCAB, 2)
    mask = torch.ones(2, 5)
    assert distill_loss(logits[..., head], logits, head, mask).abs() < 1e-6
    assert distill_loss(torch.zeros(2, 5, len(head)), logits, head, mask) > 0.1


def test_training_lowers_the_loss(tmp_path):
    torch.manual_seed(0)
    teacher = tiny_model("llama", seed=0, layers=2)
    head = most_frequent_tokens((ids.flatten().tolist() for ids, _ in _take(batches(0), 20)), k=48)
    student = build_student(teacher, layers=1, head_token_ids=head)
    losses = []
    distill(teacher, student, batches, DistillConfig(steps=40, lr=3e-3, warmup_steps=5, checkpoint_every=100),
            tmp_path / "ckpt.pt", on_step=lambda step, loss: losses.append(loss))
    assert len(losses) == 40
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses


class Stop(Exception):
    pass


def test_a_stopped_run_resumes_exactly(tmp_path):
    teacher = tiny_model("llama", seed=0, layers=2)
    head = list(range(0, VOCAB, 2))
    config = DistillConfig(steps=8, lr=3e-3, warmup_steps=2, checkpoint_every=3)

    unbroken = build_student(teacher, 1, head)
    distill(teacher, unbroken, batches, config, tmp_path / "a.pt")

    def stop_after_step_4(step, loss):
        if step == 4:
            raise Stop   # the checkpoint of step 3 is on disk; step 4's work is lost, as in a real stop

    broken = build_student(teacher, 1, head)
    with pytest.raises(Stop):
        distill(teacher, broken, batches, config, tmp_path / "b.pt", on_step=stop_after_step_4)
    resumed = build_student(teacher, 1, head)   # a fresh process: nothing but the checkpoint
    assert distill(teacher, resumed, batches, config, tmp_path / "b.pt") == 8
    for (name, a), b in zip(unbroken.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name} differs after resuming"


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]
