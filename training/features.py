"""The feature cache: the target's hidden states over its own answers, computed once on disk.

An EAGLE-3 head (``replicas/drafts/hsr_head.py``) trains on, per position, the target's states
at its feature layers (the input) and the target's final state after the norm (the teacher:
``final @ W_out[head].T`` gives its logits over any head vocabulary, ``distill.teacher_log_probs``).
Both come from one teacher-forced pass of the target over each self-distilled answer
(``data/answers.py``): no generation, and no target forward during training.

What the pass reads: the last ``context`` tokens of the prompt, then the whole answer; positions
restart at 0 at the window's start. The prompts run up to 1,024 tokens, and reading them whole
would triple the pass and the cache for positions that are never scored (only answer tokens
are). So the states and the teacher are those of the target reading a shortened prompt, which
for long prompts differ from what the served target hands the head; the answer tokens
themselves are the target's greedy choices given the whole prompt, which is why the recipe adds
a cross-entropy on them to the KL (``training/hsr_train.py``). The cache reads 256 prompt tokens
(``CONTEXT``): the whole prompt of most answers, and on a long prompt a teacher that agrees with
the answer tokens far more often than a shorter window's, for a cache not much larger (figures:
docs/benchmarks.md).

Layout (``<dir>``, default ``<model cache>/../zoo/features``):
- ``shard-NNNNN/`` per answers chunk ``answers-NNNNN.npz``, renamed into place whole (an
  interrupted build leaves no half shard, and resumes at the first missing one):
  ``tokens.npy`` int32 [P]; ``features.npy`` [P, n·H] and ``final.npy`` [P, H], bfloat16 stored
  as int16 bit patterns (numpy has no bfloat16), read through ``np.load(mmap_mode="r")`` so only
  the rows a batch needs are paged in; ``index.npz``: per sequence its ``starts``, ``lengths``,
  ``context_lens`` (prompt tokens kept), ``kinds`` and ``answers`` (the answer's ordinal over
  all chunks, which decides the validation split);
- ``meta.json``: the settings (target, dtype, context, layers, which answers) and the totals.
  A build with other settings into the same folder is refused: its shards would mix two kinds of
  features.

Size: (n + 1)·H·2 bytes a position, 4.6 kB for three layers of the reference target; the answers'
~5.3k sequences of ≤ 256 + 256 tokens are ~2M positions, ~9 GB.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.data.answers import KINDS, Answer, load_chunk
from specserve.replicas.drafts.hsr_head import decoder_layer, stack_features
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm, model_cache_dir
from specserve.training.answers import ANSWERS_DIR
from specserve.training.distill import seeded_batches

# Prompt tokens read before each answer: the whole prompt of most answers, and enough of a long one
# that the cached teacher mostly agrees with the answer tokens (the module's docstring says why).
CONTEXT = 256
# EAGLE-3's low, middle and high states for the 30-layer reference target (indices into
# transformers' ``hidden_states``; see ``training/eagle3.py`` for the choice).
LAYERS = (2, 15, -2)
# Padded tokens per forward of the build: 16 sequences of ~320 tokens.
BATCH_TOKENS = 5120
# Every VALIDATION_EVERY-th answer (by ordinal) is held out, as in the old corpus.
VALIDATION_EVERY = 20


def features_dir() -> Path:
    return model_cache_dir().parent / "zoo" / "features"


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()


def _from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.int16)).view(torch.bfloat16)


def window(answer: Answer, context: int) -> tuple[list[int], int]:
    """(tokens read, prompt tokens among them): the last ``context`` prompt tokens, then the answer."""
    kept = min(context, answer.prompt_len)
    return answer.tokens[answer.prompt_len - kept:], kept


@torch.inference_mode()
def feature_pass(model, sequences: list[list[int]], layers: list[int],
                 pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One teacher-forced forward over ``sequences`` (right-padded, so every row's positions
    start at 0 as a served request's do): per sequence (features [T, n·H], final [T, H])."""
    longest = max(map(len, sequences))
    ids = torch.tensor([s + [pad_id] * (longest - len(s)) for s in sequences], device=model.device)
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sequences], device=model.device)
    hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states
    features, final = stack_features(hidden, layers), hidden[-1]
    return [(features[i, :len(s)], final[i, :len(s)]) for i, s in enumerate(sequences)]


def _batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequence indices in batches of similar length (little padding) of at most ``budget``
    padded tokens."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def write_shard(path: Path, model, answers: list[Answer], first_ordinal: int, layers: list[int], context: int,
                pad_id: int, batch_tokens: int = BATCH_TOKENS) -> int:
    """The shard of one answers chunk, renamed into place whole; returns its positions."""
    windows = [window(a, context) for a in answers]
    tokens = [w for w, _ in windows]
    outputs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(tokens)
    for batch in _batches([len(t) for t in tokens], batch_tokens):
        for i, out in zip(batch, feature_pass(model, [tokens[i] for i in batch], layers, pad_id)):
            outputs[i] = out
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)   # a build stopped mid-write
    tmp.mkdir(parents=True)
    lengths = np.array([len(t) for t in tokens], dtype=np.int32)
    np.save(tmp / "tokens.npy", np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens]))
    np.save(tmp / "features.npy", np.concatenate([_bf16_bits(f) for f, _ in outputs]))
    np.save(tmp / "final.npy", np.concatenate([_bf16_bits(f) for _, f in outputs]))
    np.savez(tmp / "index.npz", starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
             lengths=lengths, context_lens=np.array([k for _, k in windows], dtype=np.int32),
             kinds=np.array([KINDS.index(a.kind) for a in answers], dtype=np.int8),
             answers=np.arange(first_ordinal, first_ordinal + len(answers), dtype=np.int64))
    os.replace(tmp, path)   # atomic: the shard is there whole or not at all
    return int(lengths.sum())


def build_features(out: Path | None = None, answers: Path = ANSWERS_DIR, layers: tuple[int, ...] = LAYERS,
                   context: int = CONTEXT, target: str = REFERENCE_TARGET, dtype: str = "auto",
                   chunks: int | None = None, batch_tokens: int = BATCH_TOKENS,
                   on_shard: Callable[[int, int, int], None] | None = None, device: str | None = None) -> Path:
    """The feature cache of every answers chunk in ``answers`` into ``out`` (resuming: only the
    missing shards are computed; chunks generated since the last build are added). At most
    ``chunks`` new shards this call (all when None). ``on_shard(done, total, positions)`` after
    each shard; None shows a tqdm bar. ``device``: where the target runs (default: the CPU; the
    cache is the same wherever it is built, up to bfloat16 rounding). Returns ``out``.

    Raises ``ValueError`` when ``out`` holds shards built with other settings."""
    from tqdm import tqdm

    out = out or features_dir()
    chunk_files = sorted(p for p in answers.glob("answers-*.npz") if not p.name.endswith(".partial.npz"))
    if not chunk_files:
        raise FileNotFoundError(f"no answers in {answers}: run `specserve zoo answers` first")
    loaded = load_causal_lm(target, dtype=dtype, device=device or "cpu")
    model = loaded.model
    for index in layers:
        decoder_layer(index, len(model.model.layers))   # an index no layer outputs fails here, not mid-build
    answers_meta = json.loads((answers / "meta.json").read_text()) if (answers / "meta.json").exists() else {}
    settings = {
        "target": target, "dtype": str(model.dtype), "context": context, "layers": list(layers),
        "hidden_size": int(model.config.hidden_size),
        "answers": {k: answers_meta.get(k) for k in ("target", "dtype", "first_conversation", "answer_tokens",
                                                      "context_tokens", "conversations")},
    }
    meta_file = out / "meta.json"
    if meta_file.exists():
        before = json.loads(meta_file.read_text()).get("settings", {})
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed and any(out.glob("shard-*[0-9]")):
            raise ValueError(f"{out} holds features built with other settings {changed}: build with the same "
                             "ones, or into another folder")
    out.mkdir(parents=True, exist_ok=True)
    _write_meta(out, settings)   # before the first shard: no shard is ever there without its settings
    pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    sizes = [_chunk_size(f) for f in chunk_files]
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    missing = [i for i, f in enumerate(chunk_files) if not (out / _shard_name(f)).exists()]
    if chunks is not None:
        missing = missing[:chunks]
    bar = None if on_shard is not None else tqdm(total=len(chunk_files), initial=len(chunk_files) - len(missing),
                                                 desc="zoo features", unit="shard")
    done = len(chunk_files) - len(missing)
    for i in missing:
        positions = write_shard(out / _shard_name(chunk_files[i]), model, load_chunk(chunk_files[i]), firsts[i],
                                list(layers), context, pad_id, batch_tokens)
        done += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(positions=positions)
        else:
            on_shard(done, len(chunk_files), positions)
        _write_meta(out, settings)
    if bar is not None:
        bar.close()
    _write_meta(out, settings)
    return out


def _shard_name(chunk_file: Path) -> str:
    return "shard-" + chunk_file.stem.removeprefix("answers-")


def _chunk_size(path: Path) -> int:
    with np.load(path) as data:
        return len(data["lengths"])


def _write_meta(out: Path, settings: dict) -> None:
    shards = sorted(p for p in out.glob("shard-*[0-9]") if p.is_dir())
    lengths = [np.load(p / "index.npz")["lengths"] for p in shards]
    meta = {"settings": settings, "shards": len(shards), "sequences": int(sum(len(x) for x in lengths)),
            "positions": int(sum(int(x.sum()) for x in lengths)),
            "bytes": sum(f.stat().st_size for p in shards for f in p.iterdir())}
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "meta.json")


@dataclass(frozen=True)
class CachedSequence:
    shard: int           # index into FeatureCache.shards
    start: int           # first row in the shard's arrays
    length: int
    context_len: int     # prompt tokens read before the answer
    kind: str
    answer: int          # the answer's ordinal over every chunk

    @property
    def validation(self) -> bool:
        return self.answer % VALIDATION_EVERY == VALIDATION_EVERY - 1


class FeatureCache:
    """A built cache, read lazily: ``row(seq)`` reads one sequence's rows from the memory maps."""

    def __init__(self, folder: Path | None = None, shards: list[str] | None = None, device: str | None = None):
        """``shards``: only these (a training run pins the shards it started with, so a cache that
        grew meanwhile does not change the batches of a resumed run). ``device``: read every shard
        whole into that device's memory at first use (an accelerator's: ~9 GB for the whole cache,
        and a batch is then gathered there, not copied over from the page cache); None: read
        rows lazily from the memory maps."""
        self.device = torch.device(device) if device is not None else None
        self.folder = folder or features_dir()
        meta_file = self.folder / "meta.json"
        if not meta_file.exists():
            raise FileNotFoundError(f"no feature cache in {self.folder}: build it first "
                                    "(training.features.build_features)")
        self.meta = json.loads(meta_file.read_text())
        found = sorted(p.name for p in self.folder.glob("shard-*[0-9]") if p.is_dir())
        if shards is not None:
            lost = sorted(set(shards) - set(found))
            if lost:
                raise FileNotFoundError(f"{self.folder} lacks the shards {lost[:4]} this run was started on")
            found = list(shards)
        if not found:
            raise FileNotFoundError(f"the feature cache in {self.folder} has no shards yet")
        self.shards = found
        self.sequences: list[CachedSequence] = []
        for s, name in enumerate(self.shards):
            with np.load(self.folder / name / "index.npz") as index:
                columns = ("starts", "lengths", "context_lens", "kinds", "answers")
                for start, length, context_len, kind, answer in zip(*(index[c] for c in columns)):
                    self.sequences.append(CachedSequence(s, int(start), int(length), int(context_len),
                                                         KINDS[int(kind)], int(answer)))
        self._maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def layers(self) -> list[int]:
        return list(self.meta["settings"]["layers"])

    def _arrays(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if shard not in self._maps:
            folder = self.folder / self.shards[shard]
            self._maps[shard] = tuple(np.load(folder / f"{name}.npy", mmap_mode="r")
                                      for name in ("tokens", "features", "final"))
        return self._maps[shard]

    def _resident(self, shard: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if shard not in self._tensors:
            tokens, features, final = self._arrays(shard)
            self._tensors[shard] = (torch.from_numpy(np.array(tokens, dtype=np.int64)).to(self.device),
                                    _from_bits(features).to(self.device), _from_bits(final).to(self.device))
        return self._tensors[shard]

    def row(self, seq: CachedSequence) -> dict:
        """``{tokens [T] int64, features [T, n·H] bf16, final [T, H] bf16, weights [T]}`` (on the
        cache's device): position p is scored (weight 1) when it predicts an answer token
        (p >= context_len - 1), the last never (nothing follows it)."""
        rows = slice(seq.start, seq.start + seq.length)
        weights = (torch.arange(seq.length, device=self.device) >= seq.context_len - 1).float()
        weights[-1] = 0.0
        if self.device is not None:
            tokens, features, final = self._resident(seq.shard)
            return {"tokens": tokens[rows], "features": features[rows], "final": final[rows], "weights": weights}
        tokens, features, final = self._arrays(seq.shard)
        return {"tokens": torch.from_numpy(np.array(tokens[rows], dtype=np.int64)),
                "features": _from_bits(features[rows]), "final": _from_bits(final[rows]), "weights": weights}

    def answers(self, sequences: list[CachedSequence]) -> list[Answer]:
        """The token windows of ``sequences`` (the kept prompt tokens, then the answer), without
        their states: what the head's vocabulary is counted on."""
        return [Answer(s.kind, s.context_len, self._arrays(s.shard)[0][s.start:s.start + s.length].tolist())
                for s in sequences]

    def split(self) -> tuple[list[CachedSequence], list[CachedSequence]]:
        """(training, validation): every ``VALIDATION_EVERY``-th answer is never trained on."""
        return ([s for s in self.sequences if not s.validation], [s for s in self.sequences if s.validation])


def collate(rows: list[dict]) -> dict:
    """Right-padded to the longest row, states as float32 (training runs bfloat16 autocast over
    float32 weights); padding has weight 0."""
    width = max(len(r["tokens"]) for r in rows)

    def pad(key: str) -> torch.Tensor:
        return torch.stack([torch.cat([r[key], r[key].new_zeros((width - len(r[key]), *r[key].shape[1:]))])
                            for r in rows])

    return {"tokens": pad("tokens"), "features": pad("features").float(), "final": pad("final").float(),
            "weights": pad("weights")}


def batch_stream(cache: FeatureCache, sequences: list[CachedSequence], batch: int, seed: int = 0):
    """``batches(start)`` for ``distill.train``: batch ``b`` is a pure function of ``b`` (a seeded
    shuffle per epoch), so a resumed run sees exactly the batches an unbroken one would."""
    per_epoch = len(sequences) // batch
    if per_epoch == 0:
        raise ValueError(f"the feature cache has {len(sequences)} training sequences, fewer than one batch of {batch}")

    return seeded_batches(len(sequences), batch, lambda picked: collate([cache.row(sequences[j]) for j in picked]), seed)
