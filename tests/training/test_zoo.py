"""The draft zoo on the real target: the corpus holds the target's own greedy answers and the
hidden states that reproduce its choices, held out from every benchmark prompt; batches are the
same from any starting point (what makes a resumed run exact); both recipes train, export, load
by path and evaluate."""

import json
from itertools import islice

import pytest
import torch

from specserve.data.prompts import load_prompts, training_prompts
from specserve.training import corpus as zoo_corpus
from specserve.training.zoo import recipe

pytestmark = pytest.mark.reference

MINI = {"chat": 3, "code": 2, "edit": 1}
TRANSCRIPTS = 2


@pytest.mark.parametrize("category", ["chat", "summarise", "code", "edit"])
def test_training_prompts_hold_out_the_benchmark_prompts(category):
    training = set(islice(training_prompts(category), 300))
    assert training and not training & set(load_prompts(category, 100))


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="the zoo has: smollm2-draft-2l, smollm2-hsr"):
        recipe("nope")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    zoo_corpus.build(out, mix=MINI, batch=2, max_new_tokens=12, dtype="float32")
    zoo_corpus.build_transcripts(zoo_corpus.transcripts_dir(out), n=TRANSCRIPTS, tokens=24, batch=2, dtype="float32")
    return out


@pytest.mark.slow
def test_the_corpus_is_the_targets_greedy_answers_and_its_states(corpus):
    from specserve.replicas.model_store import load_causal_lm

    target = load_causal_lm(dtype="float32").model
    sequences = [s for s in zoo_corpus.load(corpus) if s.category != "transcript"]
    assert sorted(s.category for s in sequences) == sorted(c for c, n in MINI.items() for _ in range(n))
    out_weight = target.get_output_embeddings().weight
    for seq in sequences:
        answer = range(seq.prompt_len - 1, len(seq.tokens) - 1)
        assert len(answer) >= 1 and seq.features.shape == seq.final.shape == (len(seq.tokens), 576)
        # The stored final states reproduce the target's greedy choice at every answer position.
        predicted = (seq.final[list(answer)].float() @ out_weight.T).argmax(-1)
        assert predicted.tolist() == seq.tokens[seq.prompt_len:].tolist()
        with torch.inference_mode():
            hidden = target(seq.tokens[None], output_hidden_states=True).hidden_states
        assert torch.allclose(seq.features.float(), hidden[-2][0], atol=0.05, rtol=0.02)


@pytest.mark.slow
def test_transcripts_are_conversations_read_by_the_target_and_only_answers_validate(corpus):
    from specserve.replicas.model_store import load_causal_lm

    loaded = load_causal_lm(dtype="float32")
    sequences = zoo_corpus.load(corpus)
    read = [s for s in sequences if s.category == "transcript"]
    assert len(read) == TRANSCRIPTS and len(sequences) == sum(MINI.values()) + TRANSCRIPTS
    for seq in read:
        text = loaded.tokenizer.decode(seq.tokens)
        assert len(seq.tokens) == 24 and "<|im_start|>user" in text, text
        with torch.inference_mode():
            hidden = loaded.model(seq.tokens[None], output_hidden_states=True).hidden_states
        assert torch.allclose(seq.final.float(), hidden[-1][0], atol=0.05, rtol=0.02)
        # Every position but the last is scored: the target's distribution wherever it reads.
        assert zoo_corpus.training_row(seq, 64)["weights"].tolist() == [1.0] * 23 + [0.0]
    training, validation = zoo_corpus.split(sequences, every=3)
    assert len(validation) == 2 and all(s.category != "transcript" for s in validation)
    assert not {id(s) for s in validation} & {id(s) for s in training}
    assert len(training) + len(validation) == len(sequences)


@pytest.mark.slow
def test_a_stopped_build_resumes_with_the_missing_shard_only(corpus):
    shards = sorted(corpus.glob("shard-*.pt"))
    before = {s: s.stat().st_mtime_ns for s in shards}
    kept = torch.load(shards[1], weights_only=True)
    shards[1].unlink()
    zoo_corpus.build(corpus, mix=MINI, batch=2, max_new_tokens=12, dtype="float32")
    assert all(s.stat().st_mtime_ns == before[s] for s in shards if s != shards[1])
    again = torch.load(shards[1], weights_only=True)
    assert [r["tokens"].tolist() for r in again] == [r["tokens"].tolist() for r in kept]


@pytest.mark.slow
def test_batches_from_any_start_are_the_continuation_and_score_only_answers(corpus):
    sequences = zoo_corpus.load(corpus)
    batches = zoo_corpus.batch_stream(sequences, seq_len=64, batch=2)
    first = list(islice(batches(0), 6))   # past one epoch of 3 batches: a new shuffle
    again = next(batches(4))
    assert torch.equal(again["tokens"], first[4]["tokens"]) and torch.equal(again["weights"], first[4]["weights"])
    for b in first:
        assert b["tokens"].shape[1] <= 64 and b["features"].shape == (*b["tokens"].shape, 576)
        # Scored positions of answers are answer positions: each predicts a token of the answer.
        assert b["weights"].sum() > 0 and set(b["weights"].unique().tolist()) <= {0.0, 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-hsr"])
def test_train_export_load_and_evaluate(corpus, name, tmp_path):
    """The whole path, two steps long: train, export, load by path, draft, evaluate (the recipes
    trained on the feature cache: tests/training/test_eagle3.py)."""
    from specserve.replicas.drafts.factory import draft_from_model
    from specserve.replicas.model_store import load_causal_lm
    from specserve.training.zoo import evaluate, export, train, write_card

    work = train(name, steps=2, work=tmp_path / "work", corpus=corpus, batch=2, validation_every=3)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 2] and log[-1]["best"], "two steps, then the last step validates"
    assert (work / "checkpoint.pt").exists() and (work / "best.pt").exists()
    out = export(name, work=work, out=tmp_path / "draft", corpus=corpus)
    training = json.loads((out / "training.json").read_text())
    assert training["exported_step"] == 2 and training["validation_kl"] == pytest.approx(log[-1]["validation"], abs=1e-4)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    assert size_mb < 30, f"an exported draft should stay well under half the 60 MB budget, got {size_mb:.1f} MB"
    draft = load_causal_lm(str(out), dtype="float32")
    target = load_causal_lm(dtype="float32")
    assert torch.equal(draft.model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    head = torch.tensor(draft.model.config.head_token_ids)   # frozen in training, so the target's, not stored
    assert torch.equal(draft.model.lm_head.weight, target.model.get_output_embeddings().weight[head])
    assert type(draft_from_model("d", draft.model)).__name__ == "HSRDraft"
    rows = evaluate([str(out)], prompts_per_category=1, max_tokens=4, window=2, dtype="float32")
    assert [r["category"] for r in rows] == ["code", "chat", "summarise", "edit"]
    for r in rows:
        assert r["draft"] == "draft" and 0 <= r["acceptance_rate"] <= 1 and r["mean_accepted_len"] >= 1
        assert 0 < r["latency_ratio"] < 1, "a draft must cost less than the 30-layer target"
        assert r["speedup_vs_ar"] > 0
    card = write_card(out, rows, {"prompts": 1, "max_tokens": 4, "window": 2}).read_text()
    assert "exported: step 2, the best validation KL" in card
    assert len([line for line in card.splitlines() if line.startswith("| ") and "x |" in line]) == 4
