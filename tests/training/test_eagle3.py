"""The EAGLE-3 recipe on a tiny target: the feature cache holds the target's own states over
each answer's window (the last prompt tokens, then the answer), resumes with the missing shard
only and refuses other settings; the head's vocabulary is ranked by what the answers write; a
short training run lowers the loss, validates, plots, and resumes to exactly an unbroken run's
weights; the export is small, loads with ``load_causal_lm`` and drafts greedily-exact in the
engine."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specserve.data.answers import Answer, save_chunk
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.hsr_head import HSRHead, stack_features
from specserve.replicas.engine import GenerateRequest, SpecEngine
from specserve.replicas.model_store import load_causal_lm
from specserve.training import eagle3
from specserve.training import features as feature_cache
from specserve.training.zoo import recipe
from tiny_hsr import FUSED_LAYERS, one_thread, save_tiny_pair
from tiny_models import VOCAB, tiny_model

CONTEXT = 6
ANSWERS = 40   # ordinals 19 and 39 are held out
CHUNKS = (16, 16, 8)
SPEC = replace(recipe("smollm2-eagle3"), feature_layers=tuple(FUSED_LAYERS), unroll=3, batch=4, lr=3e-3,
               warmup_steps=5, head_tokens=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return one_thread(lambda: tiny_answers(tmp_path_factory.mktemp("eagle3")))


def tiny_answers(root):
    """A saved 3-layer target (with a tokenizer) and its greedy answers to random prompts of 3 to
    12 tokens (longer than CONTEXT: the window cuts them), in three chunks."""
    target = tiny_model("llama", seed=0, layers=3)
    save_tiny_pair(target, eagle3.build_head(SPEC, target, list(range(VOCAB))), root)
    gen = torch.Generator().manual_seed(0)
    answers = []
    for i in range(ANSWERS):
        prompt = torch.randint(1, VOCAB, (3 + i % 10,), generator=gen).tolist()
        with torch.inference_mode():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        answers.append(Answer(["chat", "turn", "code"][i % 3], len(prompt), out[0].tolist()))
    folder = root / "answers"
    folder.mkdir()
    start = 0
    for c, n in enumerate(CHUNKS):
        save_chunk(folder / f"answers-{c:05d}.npz", answers[start:start + n])
        start += n
    (folder / "meta.json").write_text(json.dumps({"target": "tiny", "first_conversation": 0}))
    return target, root / "target", folder, answers


def build(setup, out, **settings):
    _, target_dir, answers_dir, _ = setup
    return feature_cache.build_features(out, answers_dir, layers=tuple(FUSED_LAYERS), context=CONTEXT,
                                        target=str(target_dir), dtype="float32", batch_tokens=64,
                                        on_shard=lambda done, total, positions: None, **settings)


@pytest.fixture(scope="module")
def cache(setup, tmp_path_factory):
    return one_thread(lambda: build(setup, tmp_path_factory.mktemp("features")))


def test_the_cache_holds_the_targets_states_over_each_answers_window(setup, cache):
    target, _, _, answers = setup
    reader = feature_cache.FeatureCache(cache)
    assert reader.shards == ["shard-00000", "shard-00001", "shard-00002"] and len(reader.sequences) == ANSWERS
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["settings"]["layers"] == FUSED_LAYERS and meta["settings"]["context"] == CONTEXT
    assert meta["positions"] == sum(s.length for s in reader.sequences)
    for seq, answer in zip(reader.sequences, answers):
        row = reader.row(seq)
        kept = min(CONTEXT, answer.prompt_len)
        assert row["tokens"].tolist() == answer.tokens[answer.prompt_len - kept:] and seq.context_len == kept
        with torch.inference_mode():
            hidden = target(row["tokens"][None], output_hidden_states=True).hidden_states
        # Stored in bfloat16: 8 bits of mantissa.
        assert torch.allclose(row["features"].float(), stack_features(hidden, FUSED_LAYERS)[0], atol=0.02, rtol=0.01)
        assert torch.allclose(row["final"].float(), hidden[-1][0], atol=0.02, rtol=0.01)
        # Position p is scored when it predicts an answer token, the last one never.
        assert row["weights"].tolist() == [0.0] * (kept - 1) + [1.0] * (seq.length - kept) + [0.0]
    training, validation = reader.split()
    assert [s.answer for s in validation] == [19, 39] and len(training) == ANSWERS - 2


def test_a_cache_read_into_device_memory_gives_the_memory_mapped_rows(cache):
    mapped, resident = feature_cache.FeatureCache(cache), feature_cache.FeatureCache(cache, device="cpu")
    for seq in mapped.sequences[::7]:
        row, again = mapped.row(seq), resident.row(seq)
        assert row.keys() == again.keys() and all(torch.equal(row[k], again[k]) for k in row)
    picked = mapped.sequences[:4]
    a = feature_cache.collate([mapped.row(s) for s in picked])
    b = feature_cache.collate([resident.row(s) for s in picked])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stopped_build_resumes_with_the_missing_shard_only_and_other_settings_are_refused(setup, cache, tmp_path):
    import shutil

    copy = tmp_path / "features"
    shutil.copytree(cache, copy)
    before = {p.name: (p / "features.npy").stat().st_mtime_ns for p in copy.glob("shard-*")}
    kept = np.load(copy / "shard-00001" / "features.npy")
    shutil.rmtree(copy / "shard-00001")
    (copy / "shard-00001.partial").mkdir()   # a build stopped mid-write
    (copy / "shard-00001.partial" / "tokens.npy").write_bytes(b"half")
    build(setup, copy)
    assert not (copy / "shard-00001.partial").exists()
    after = {p.name: (p / "features.npy").stat().st_mtime_ns for p in copy.glob("shard-*")}
    assert after.keys() == before.keys()
    assert all(after[n] == before[n] for n in before if n != "shard-00001")
    assert np.array_equal(np.load(copy / "shard-00001" / "features.npy"), kept)
    with pytest.raises(ValueError, match="other settings"):
        feature_cache.build_features(copy, setup[2], layers=tuple(FUSED_LAYERS), context=CONTEXT + 2,
                                     target=str(setup[1]), dtype="float32", on_shard=lambda *a: None)


def test_the_head_vocabulary_is_what_the_answers_write_first():
    answers = [Answer("chat", 2, [7, 8, 1, 1, 1, 2, 2, 3]), Answer("chat", 1, [9, 2, 5])]
    # Written: 1 (3x), 2 (3x), 3, 5; then read: 7, 8, 9; then the lowest ids left. EOS 42 always.
    assert eagle3.head_vocabulary(answers, 5, VOCAB, always=[42]) == [1, 2, 3, 5, 42]
    assert eagle3.head_vocabulary(answers, 8, VOCAB, always=[42]) == [1, 2, 3, 5, 7, 8, 9, 42]
    assert eagle3.head_vocabulary(answers, 10, VOCAB) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert eagle3.coverage(answers, [1, 2]) == pytest.approx(6 / 8)   # 1, 1, 1, 2, 2, 2 of the 8 written


def test_one_log_softmax_gives_the_kl_and_the_ce():
    from specserve.training.distill import distill_loss
    from specserve.training.hsr_train import Teacher, kl_and_ce

    gen = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(6, 10, generator=gen), torch.log_softmax(torch.randn(6, 10, generator=gen), -1)
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    target = torch.tensor([3, -1, 2, 9, 0, 4])   # -1: outside the head, no CE
    kept = torch.tensor([0, 3, 4, 5])            # weighted and inside the head
    ce = torch.nn.functional.cross_entropy(logits[kept], target[kept])
    expected = distill_loss(logits, teacher, weights) + 0.3 * ce
    assert torch.allclose(kl_and_ce(logits, Teacher(teacher), weights, target, 0.3), expected, atol=1e-6)
    assert torch.allclose(kl_and_ce(logits, Teacher(teacher), weights, target, 0.0), distill_loss(logits, teacher, weights))


def assert_drafts_greedily_exact(target_dir, draft, answers) -> None:
    """Served in the engine after the target, ``draft`` proposes tokens and leaves the greedy
    answers to the first answers' prompts as they are."""
    engine = SpecEngine(load_causal_lm(str(target_dir), dtype="float32", device="cpu"),
                        {"d": draft_from_model("d", draft)}, slots=2)
    drafted = 0
    for answer in answers[:4]:
        prompt = answer.tokens[:answer.prompt_len]
        expected = engine.generate_ids(prompt, GenerateRequest("", 16, "none", 0)).token_ids
        got = engine.generate_ids(prompt, GenerateRequest("", 16, "d", 3))
        assert got.token_ids == expected
        drafted += sum(got.stats.windows)
    assert drafted > 0


def train(cache, work, steps):
    return eagle3.train_recipe(SPEC, work, cache, steps=steps, batch=4, validate_every=10, validation_sequences=8,
                               checkpoint_every=10)


class Stop(Exception):
    pass


def test_training_lowers_the_loss_validates_plots_and_resumes_exactly(cache, tmp_path, monkeypatch):
    work = train(cache, tmp_path / "straight", 40)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    checks = [r for r in log if "validation" in r]
    assert [r["step"] for r in checks] == [10, 20, 30, 40]
    assert all(len(r["top1_by_step"]) == SPEC.unroll and 0 <= r["acceptance_1"] <= 1 for r in checks)
    assert (work / "train.png").stat().st_size > 0 and (work / "best.pt").exists()
    assert json.loads((work / "data.json").read_text())["shards"] == ["shard-00000", "shard-00001", "shard-00002"]
    # Stopped at step 30's validation (step 20's checkpoint on disk) and run again: the same
    # weights as the unbroken run.
    plots = []

    def plot_then_stop(work, out=None):
        plots.append(work)
        if len(plots) == 3:
            raise Stop

    with monkeypatch.context() as patch:
        patch.setattr(eagle3, "plot_training", plot_then_stop)
        with pytest.raises(Stop):
            train(cache, tmp_path / "resumed", 40)
    resumed = train(cache, tmp_path / "resumed", 40)
    assert torch.load(resumed / "checkpoint.pt", weights_only=False)["step"] == 40
    straight = torch.load(work / "checkpoint.pt", weights_only=False)["trainable"]
    again = torch.load(resumed / "checkpoint.pt", weights_only=False)["trainable"]
    assert straight.keys() == again.keys() and "fuse.weight" in straight
    assert all(torch.equal(straight[k], again[k]) for k in straight)
    with pytest.raises(ValueError, match="keep it"):
        eagle3.train_recipe(SPEC, resumed, cache, steps=50, batch=2)


def test_the_export_is_small_loads_and_drafts_greedily_exact(setup, cache, tmp_path):
    target, target_dir, _, answers = setup
    work = train(cache, tmp_path / "work", 20)
    out = eagle3.export_recipe(SPEC, work, tmp_path / "draft")
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as saved:
        keys = set(saved.keys())
        assert {saved.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert "fuse.weight" in keys and "embed_tokens.weight" not in keys and "lm_head.weight" not in keys
    training = json.loads((out / "training.json").read_text())
    assert training["feature_layers"] == FUSED_LAYERS and training["steps"] == 20
    loaded = load_causal_lm(str(out), dtype="float32", device="cpu")
    assert isinstance(loaded.model, HSRHead) and loaded.model.fuse is not None
    assert_drafts_greedily_exact(target_dir, loaded.model, answers)


STANDALONE = replace(recipe("smollm2-draft-2l"), layers=1, head_tokens=64, batch=4, lr=3e-3, warmup_steps=5)


def test_a_standalone_draft_trains_on_the_cache_validates_and_exports_greedily_exact(setup, cache, tmp_path):
    """The standalone draft LM learns from the same cache (its tokens and the target's final
    states as the teacher), with one validated step: acceptance of its first drafted token."""
    target, target_dir, _, answers = setup
    work = eagle3.train_recipe(STANDALONE, tmp_path / "work", cache, steps=30, batch=4, validate_every=10,
                               validation_sequences=8, checkpoint_every=10)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    checks = [r for r in log if "validation" in r]
    assert [r["step"] for r in checks] == [10, 20, 30]
    assert all(len(r["top1_by_step"]) == 1 and 0 <= r["acceptance_1"] <= 1 for r in checks)
    assert checks[-1]["validation"] < checks[0]["validation"]
    out = eagle3.export_recipe(STANDALONE, work, tmp_path / "draft")
    training = json.loads((out / "training.json").read_text())
    assert training["kind"] == "standalone" and training["feature_layers"] is None
    loaded = load_causal_lm(str(out), dtype="float32", device="cpu")
    assert loaded.model.config.num_hidden_layers == 1
    assert_drafts_greedily_exact(target_dir, loaded.model, answers)
