"""Distillation on tiny models: the student starts as a faithful copy of the target, training
lowers the loss, and a run stopped mid-way resumes to exactly the weights of an unbroken run."""

import pytest
import torch

from specserve.training.distill import (
    DistillConfig, best_path, build_student, distill_loss, load_weights, most_frequent_tokens, standalone_loss,
    teacher_log_probs, train,
)
from tiny_hsr import teacher_batch
from tiny_models import VOCAB, tiny_model

TEACHER = tiny_model("llama", seed=0, layers=2)
DATA = [teacher_batch(TEACHER, seed, batch=4, length=16) for seed in range(12)]


def batches(start: int):
    """Batch i is a pure function of i, so a resumed run sees exactly the batches it had not seen."""
    i = start
    while True:
        yield DATA[i % len(DATA)]
        i += 1


def loss_for(student):
    head = student.head_token_ids(torch.device("cpu"))
    return standalone_loss(student, TEACHER.get_output_embeddings().weight.detach()[head])


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
    final = torch.randn(10, 8)
    head_weight = torch.randn(VOCAB // 2, 8)
    weights = torch.ones(10)
    teacher = teacher_log_probs(final, head_weight)
    assert distill_loss(final @ head_weight.T, teacher, weights).abs() < 1e-5
    assert distill_loss(torch.zeros(10, VOCAB // 2), teacher, weights) > 0.1


def test_the_corpus_teacher_is_the_target_renormalised_over_the_head():
    batch = DATA[0]
    head = torch.arange(0, VOCAB, 3)
    with torch.inference_mode():
        logits = TEACHER(batch["tokens"]).logits
    expected = torch.log_softmax(logits[..., head], -1)
    got = teacher_log_probs(batch["final"], TEACHER.get_output_embeddings().weight[head])
    assert torch.allclose(got, expected, atol=1e-4)


def test_training_lowers_the_loss(tmp_path):
    torch.manual_seed(0)
    head = most_frequent_tokens((b["tokens"].flatten().tolist() for b in DATA), k=48)
    student = build_student(TEACHER, layers=1, head_token_ids=head)
    losses = []
    train(student, loss_for(student), batches, DistillConfig(steps=40, lr=3e-3, warmup_steps=5, checkpoint_every=100),
          tmp_path / "ckpt.pt", on_step=lambda step, loss: losses.append(loss))
    assert len(losses) == 40
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses


def test_the_weights_that_validate_best_are_kept(tmp_path):
    head = list(range(0, VOCAB, 2))
    held_out = teacher_batch(TEACHER, 99, batch=4, length=16)
    student = build_student(TEACHER, 1, head)
    seen = []
    # A high learning rate makes validation go up as well as down.
    config = DistillConfig(steps=12, lr=3e-2, warmup_steps=1, checkpoint_every=100, validate_every=3)
    train(student, loss_for(student), batches, config, tmp_path / "ckpt.pt",
          validate=lambda: loss_for(student)(held_out), on_validate=lambda *row: seen.append(row))
    assert [step for step, _, _ in seen] == [3, 6, 9, 12]
    assert [best for _, _, best in seen] == [v == min(u for _, u, _ in seen[:i + 1]) for i, (_, v, _) in enumerate(seen)]
    step, value, _ = min(seen, key=lambda row: row[1])
    fresh = build_student(TEACHER, 1, head)
    assert load_weights(best_path(tmp_path / "ckpt.pt"), fresh)["step"] == step
    with torch.no_grad():
        assert abs(float(loss_for(fresh)(held_out)) - value) < 1e-5


class Stop(Exception):
    pass


def test_a_stopped_run_resumes_exactly(tmp_path):
    head = list(range(0, VOCAB, 2))
    config = DistillConfig(steps=8, lr=3e-3, warmup_steps=2, checkpoint_every=3)

    unbroken = build_student(TEACHER, 1, head)
    train(unbroken, loss_for(unbroken), batches, config, tmp_path / "a.pt")

    def stop_after_step_4(step, loss):
        if step == 4:
            raise Stop   # the checkpoint of step 3 is on disk; step 4's work is lost, as in a real stop

    broken = build_student(TEACHER, 1, head)
    with pytest.raises(Stop):
        train(broken, loss_for(broken), batches, config, tmp_path / "b.pt", on_step=stop_after_step_4)
    resumed = build_student(TEACHER, 1, head)   # a fresh process: nothing but the checkpoint
    assert train(resumed, loss_for(resumed), batches, config, tmp_path / "b.pt") == 8
    for (name, a), b in zip(unbroken.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name} differs after resuming"
