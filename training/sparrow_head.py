"""Sparrow's draft head for the reference VLM: hidden-state reuse trained on the VLM's own answers,
with intermediate-layer visual state bridging (IVSB) and multi-token prediction around a fixed
visual anchor ("Sparrow: Text-Anchored Window Attention with Visual-Semantic Glimpsing for
Speculative Decoding in Video LLMs", §3.2).

    specserve zoo sparrow-head [--no-ivsb] [--steps N]   # states, then training (both resume), export
    specserve zoo sparrow-head --video --pictures 2048  # the video model's: pictures and clips

The head is ``replicas/drafts/hsr_head.py``'s (``z_t = FC(e_t ⊕ h_{t-1})`` into one decoder layer,
``h`` the target's second-to-last layer), started from the zoo's text head ``smollm2-hsr`` with
its vocabulary widened to every token of the VLM's answers. What it learns from:

- **The VLM's answers** to synthetic pictures (``vlm_draft.answer_corpus``, shared with the VLM's
  draft LM), and per answer the VLM's states: ``h`` at every position (the head's input), layer
  m*'s at the picture's image tokens (IVSB's visual anchor, m* = half the layers as the paper
  sets it), the final states where the answer is predicted (the teacher).
- **IVSB** (Eq. 3): at a picture's positions the head's input is the anchor ``h^{m*}`` itself,
  at text positions ``FC(e ⊕ h)``. Without IVSB (``--no-ivsb``, the ablation) a picture's
  positions are fed as the served full-attention draft feeds them, ``FC(e_placeholder ⊕ h)``.
- **MTP** (Eq. 4): ``hsr_train.unrolled_outputs`` runs ``UNROLL`` recursive steps, text positions
  reading the head's own outputs, the picture's positions the same anchor every step.

Served, the head drafts with the text-anchored window (VATA, Eq. 2): the pictures' positions are
never fed at inference, as in the paper's full method, where the anchor is a training signal
(``replicas/drafts/factory.py`` windows every head trained with IVSB; the target sends no layer-m*
states). The loss is ``hsr_train.hsr_loss``: forward KL to the VLM over the head at each answer
position, every unrolled step; every ``VALIDATION_EVERY``-th picture held out, the weights with the
lowest held-out KL exported.

A ``HeadRecipe`` names whose answers the heads learn (a ``vlm_draft.DraftRecipe``: teacher and
questions) and the heads they start from: ``PICTURES`` is the reference VLM's, from the text head;
``VIDEO`` the video model's, from ``PICTURES``' exports, on its answers to pictures and clips (a
clip's frames are pictures in a row: the anchor covers every frame's image tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.replicas.drafts.hsr_head import HSRConfig, HSRHead
from specserve.replicas.model_store import REFERENCE_TARGET, bf16_is_fast, load_causal_lm, model_cache_dir, zoo_dir
from specserve.replicas.vlm import REFERENCE_VLM
from specserve.training import vlm_draft
from specserve.training.distill import DistillConfig, TrainLog, export_best, seeded_batches
from specserve.training.distill import train as train_loop
from specserve.training.hsr_train import hsr_loss, hsr_metrics
from specserve.training.vlm_train import _cpu_name

UNROLL = 2


@dataclass(frozen=True)
class HeadRecipe:
    answers: vlm_draft.DraftRecipe   # whose answers to which questions (the states are the same teacher's)
    names: tuple[str, str]           # the heads exported: with IVSB, without (the ablation)
    bases: tuple[str, str]           # the zoo heads each starts from

    def name(self, ivsb: bool) -> str:
        return self.names[0 if ivsb else 1]

    def base(self, ivsb: bool) -> str:
        return self.bases[0 if ivsb else 1]


PICTURES = HeadRecipe(vlm_draft.DRAFT, ("smollm2-vlm-sparrow", "smollm2-vlm-hsr"), ("smollm2-hsr", "smollm2-hsr"))
VIDEO = HeadRecipe(vlm_draft.VIDEO, ("smollm2-vlm-video-sparrow", "smollm2-vlm-video-hsr"), PICTURES.names)


def default_work(ivsb: bool, recipe: HeadRecipe = PICTURES) -> Path:
    return model_cache_dir().parent / "zoo" / recipe.name(ivsb)


def anchor_layer(num_layers: int) -> int:
    """m*: the index into transformers' ``hidden_states`` of the anchor, half the layers deep."""
    return num_layers // 2


@torch.no_grad()
def _states_chunk(vlm, rows: list[dict], placeholder: int, anchor: int) -> list[dict]:
    """Per answer of ``rows``: ``h`` [T, H] at every position of prompt + answer (the second-to-last
    layer's output) and the anchor [image tokens, H] (layer ``anchor``'s at the image tokens). The
    language model reads each answer's image rows as served (``vlm_draft.answer_corpus`` keeps them,
    in bfloat16), so a picture and a clip's frames are read alike."""
    model = vlm.model
    embed, language_model = model.get_input_embeddings(), model.model.language_model
    out = []
    for length in dict.fromkeys(len(r["prompt"]) for r in rows):   # one prompt (and image rows) length a group
        group = [r for r in rows if len(r["prompt"]) == length]
        width = max(len(r["prompt"]) + len(r["answer"]) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, :len(r["prompt"]) + len(r["answer"])] = torch.tensor(r["prompt"] + r["answer"])
        embeds = embed(ids)
        embeds[ids == placeholder] = torch.cat([r["rows"] for r in group]).to(embeds.dtype)
        # Right padding under a causal mask leaves every real position as it is.
        hidden = language_model(inputs_embeds=embeds, output_hidden_states=True).hidden_states
        for i, r in enumerate(group):
            n = len(r["prompt"]) + len(r["answer"])
            image = ids[i, :n] == placeholder
            out.append({"seed": r["seed"], "states": hidden[-2][i, :n].to(torch.bfloat16).clone(),
                        "anchor": hidden[anchor][i, :n][image].to(torch.bfloat16).clone()})
    return out


def states_corpus(corpus: list[dict], work: Path, progress: bool = True) -> list[dict]:
    """``corpus`` with each answer's states (``_states_chunk``, of the teacher whose answers
    ``work/answers`` holds), built chunk by chunk into ``work/states`` (resumable; shared by both
    heads: it holds ``h`` and the anchor)."""
    from tqdm import tqdm

    from specserve.replicas.vlm import load_vlm

    teacher = answers_teacher(work)
    folder = work / "states"
    folder.mkdir(parents=True, exist_ok=True)
    placeholder = vlm_draft._placeholder(teacher)
    chunks = range(0, len(corpus), vlm_draft.CHUNK)
    vlm = None
    merged = []
    for n, start in enumerate(tqdm(chunks, desc="vlm states", unit="chunk", disable=not progress)):
        path = folder / f"chunk-{n:05d}.pt"
        rows = corpus[start:start + vlm_draft.CHUNK]
        if not path.exists():
            if vlm is None:
                vlm = load_vlm(teacher, dtype="bfloat16" if bf16_is_fast(torch.device("cpu")) else "float32",
                               device="cpu")
            layers = vlm.model.config.text_config.num_hidden_layers
            torch.save(_states_chunk(vlm, rows, placeholder, anchor_layer(layers)), path.with_suffix(".partial"))
            path.with_suffix(".partial").replace(path)
        states = {s["seed"]: s for s in torch.load(path, weights_only=False)}
        merged.extend({**r, **states[r["seed"]]} for r in rows)
    return merged


def answers_teacher(work: Path) -> str:
    """The VLM whose answers ``work/answers`` holds (``vlm_draft.answer_corpus`` names it)."""
    meta = work / "answers" / "meta.json"
    return json.loads(meta.read_text()).get("teacher", REFERENCE_VLM) if meta.exists() else REFERENCE_VLM


def build_head(head_token_ids: list[int], ivsb: bool, base_name: str = PICTURES.base(True)) -> HSRHead:
    """``base_name``'s weights under a head over ``head_token_ids`` (the target's output rows,
    frozen like the embeddings); ``visual_anchor_layer`` set when trained with IVSB."""
    base = load_causal_lm(base_name, dtype="float32", device="cpu").model
    target = load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu").model
    layers = target.config.num_hidden_layers
    config = HSRConfig.from_dict({**base.config.to_dict(), "head_token_ids": head_token_ids,
                                  "visual_anchor_layer": anchor_layer(layers) if ivsb else None})
    head = HSRHead(config)
    state = {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"}
    state["lm_head.weight"] = target.get_output_embeddings().weight.detach()[torch.tensor(head_token_ids)].clone()
    head.load_state_dict(state)
    head.embed_tokens.weight.requires_grad_(False)
    head.lm_head.weight.requires_grad_(False)
    return head.float()


def collate(rows: list[dict], placeholder: int, ivsb: bool) -> dict:
    """``hsr_loss``'s batch: tokens (image tokens as ``placeholder``), the VLM's states, the teacher
    at the answer-predicting positions and their weights; with IVSB the anchor at the image tokens."""
    width = max(len(r["prompt"]) + len(r["answer"]) for r in rows)
    hidden = rows[0]["states"].shape[-1]
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    features = torch.zeros((len(rows), width, hidden))
    final = torch.zeros((len(rows), width, hidden))
    weights = torch.zeros((len(rows), width))
    anchor = torch.zeros((len(rows), width, hidden)) if ivsb else None
    for i, r in enumerate(rows):
        n, at = len(r["prompt"]) + len(r["answer"]), len(r["prompt"]) - 1
        tokens[i, :n] = torch.tensor(r["prompt"] + r["answer"])
        features[i, :n] = r["states"].float()
        final[i, at:at + len(r["answer"])] = r["final"].float()
        weights[i, at:at + len(r["answer"])] = 1.0
        if ivsb:
            anchor[i, :n][tokens[i, :n] == placeholder] = r["anchor"].float()
    batch = {"tokens": tokens, "features": features, "final": final, "weights": weights}
    if ivsb:
        batch |= {"anchor": anchor, "image": tokens == placeholder}
    return batch


def train(ivsb: bool = True, pictures: int = 3072, steps: int = 1500, batch: int = 16, lr: float = 3e-4,
          work: Path | None = None, answers: Path | None = None, validate_every: int = 100,
          progress: bool = True, recipe: HeadRecipe = PICTURES) -> Path:
    """The answers and states (built into ``answers`` if missing: ``zoo vlm-draft``'s folder of the
    recipe's answers by default), then training (resumes its checkpoint); returns ``work``."""
    work = Path(work or default_work(ivsb, recipe))
    work.mkdir(parents=True, exist_ok=True)
    answers = Path(answers or vlm_draft.default_work(recipe.answers))
    teacher = recipe.answers.teacher
    corpus = states_corpus(vlm_draft.answer_corpus(pictures, answers, progress, recipe=recipe.answers), answers,
                           progress)
    placeholder = vlm_draft._placeholder(teacher)
    held_out, rows = vlm_draft.split(corpus)
    head_file = work / "head_token_ids.json"
    if not head_file.exists():   # a resumed run keeps its head
        head_file.write_text(json.dumps(vlm_draft.head_tokens(corpus, recipe.base(ivsb))))
    head = build_head(json.loads(head_file.read_text()), ivsb, recipe.base(ivsb))
    head_weight = head.lm_head.weight.detach().clone()
    autocast = bf16_is_fast(torch.device("cpu"))
    (work / "recipe.json").write_text(json.dumps({"recipe": recipe.name(ivsb), "ivsb": ivsb, "unroll": UNROLL,
                                                  "pictures": pictures, "batch": batch,
                                                  "machine": f"{os.cpu_count()} cores of {_cpu_name()}"}))
    config = DistillConfig(steps=steps, lr=lr, warmup_steps=min(50, steps // 10 + 1), autocast_bf16=autocast,
                           validate_every=validate_every, checkpoint_every=validate_every)
    validation = [collate(held_out[i:i + 32], placeholder, ivsb) for i in range(0, len(held_out), 32)]
    log = TrainLog(work, steps, f"zoo train {recipe.name(ivsb)}", progress)

    def validate() -> float:
        scores = hsr_metrics(head, head_weight, UNROLL, validation, autocast)
        log.write({"step": log.bar.n, "validation": scores})
        log.bar.write(f"step {log.bar.n}: held-out KL {scores['kl'][0]:.3f}, first-token acceptance "
                      f"{scores['top1'][0]:.3f}")
        return sum(scores["kl"]) / len(scores["kl"])

    before = work / "base_validation.json"
    if not before.exists():   # the base head under this vocabulary: what training starts from
        before.write_text(json.dumps(hsr_metrics(head, head_weight, UNROLL, validation, autocast)))
    batches = seeded_batches(len(rows), batch, lambda idx: collate([rows[i] for i in idx], placeholder, ivsb))
    train_loop(head, hsr_loss(head, head_weight, UNROLL, autocast), batches, config, work / "checkpoint.pt",
               on_step=log.on_step, validate=validate)
    log.close()
    return work


def export(ivsb: bool = True, work: Path | None = None, out: Path | None = None, recipe: HeadRecipe = PICTURES) -> Path:
    """The weights with the lowest held-out KL as a zoo draft (half precision; the embeddings and
    head rows load from the target), its ``training.json`` and model card."""
    name = recipe.name(ivsb)
    work = Path(work or default_work(ivsb, recipe))
    checkpoint = work / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint in {work}: run `specserve zoo sparrow-head"
                                f"{'' if recipe == PICTURES else ' --video'}{'' if ivsb else ' --no-ivsb'}` first")
    head = build_head(json.loads((work / "head_token_ids.json").read_text()), ivsb, recipe.base(ivsb))
    out = Path(out or zoo_dir() / name)
    chosen, log, trained = export_best(head, work, out)
    held = json.loads((work / "recipe.json").read_text())
    training = {
        "recipe": name, "kind": "hsr", "base": recipe.base(ivsb), "teacher": recipe.answers.teacher, "ivsb": ivsb,
        **({} if recipe.answers.categories == vlm_draft.DRAFT.categories
           else {"categories": list(recipe.answers.categories)}),
        "visual_anchor_layer": head.config.visual_anchor_layer, "unroll": UNROLL, "pictures": held["pictures"],
        "first_seed": vlm_draft.DRAFT_SEED, "held_out_every": vlm_draft.VALIDATION_EVERY, "steps": trained["step"],
        "batch": held["batch"], "config": trained["config"], "exported_step": chosen["step"],
        "train_seconds": max((r["elapsed_s"] for r in log), default=0), "machine": held["machine"],
        "validation_before": json.loads((work / "base_validation.json").read_text()),
        "validation": next((r["validation"] for r in log if r.get("step") == chosen["step"] and "validation" in r), None),
        "head_tokens": len(head.config.head_token_ids),
    }
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    write_card(out, training)
    return out


def write_card(out: Path, training: dict) -> Path:
    weights_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    before, after = training["validation_before"], training["validation"] or training["validation_before"]
    visual = (f"a picture's positions read the VLM's layer-{training['visual_anchor_layer']} states (IVSB, Sparrow "
              f"Eq. 3), every unrolled step (Eq. 4)" if training["ivsb"] else
              "a picture's positions read as the served full-attention draft reads them, `FC(e_placeholder ⊕ h)` "
              "(the ablation without IVSB)")
    teacher = training.get("teacher", REFERENCE_VLM)
    video = teacher != REFERENCE_VLM
    categories = training.get("categories", list(vlm_draft.DRAFT.categories))
    data = (f"the video model's greedy answers to {training['pictures']} synthetic questions, pictures and clips "
            f"({', '.join(dict.fromkeys(categories))}; seeds from {training['first_seed']:,}, in turn; `zoo vlm-draft "
            f"--video`'s); every {training['held_out_every']}th question held out." if video else
            f"the VLM's greedy answers to {training['pictures']} synthetic pictures (seeds from "
            f"{training['first_seed']:,}, the eight question categories in turn); every {training['held_out_every']}th "
            f"picture held out.")
    lines = [
        f"# {out.name}", "",
        f"Sparrow's draft head for the reference {'video model' if video else 'VLM'} `{teacher}`: `{training['base']}`'s "
        f"hidden-state-reuse head trained further on the model's own answers with {training['unroll']} unrolled steps "
        f"(multi-token prediction); in training {visual}. Trained and exported by `specserve zoo sparrow-head"
        f"{' --video' if video else ''}{'' if training['ivsb'] else ' --no-ivsb'}` (`training/sparrow_head.py`).", "",
        f"- **Head**: {training['head_tokens']} tokens; its rows and the token embeddings are the target's (frozen, "
        f"not stored: `embeddings_from: {REFERENCE_TARGET}`).",
        f"- **Weights**: {weights_mb:.1f} MB, float16 safetensors.",
        f"- **Data**: {data}",
        f"- **Training**: {training['steps']} steps of {training['batch']} answers, AdamW lr {training['config']['lr']}, "
        f"forward KL to the VLM over the head; {training['train_seconds'] / 60:.0f} min on {training['machine']}; "
        f"exported: step {training['exported_step']}, the lowest held-out KL.", "",
        "## Held out", "",
        "Per unrolled step: KL to the VLM per answer position and how often the head's argmax is the VLM's next token "
        "(step 1: the first drafted token's greedy acceptance, teacher-forced), before (the base head under this "
        "vocabulary) and after:", "",
        "| step | KL before | KL after | acceptance before | acceptance after |", "| --- | --- | --- | --- | --- |",
    ]
    for j in range(len(after["kl"])):
        lines.append(f"| {j + 1} | {before['kl'][j]:.3f} | {after['kl'][j]:.3f} | {before['top1'][j]:.3f} | "
                     f"{after['top1'][j]:.3f} |")
    rows = (f"--target {teacher} --pictures 0 --frames 2,4,8,16 --frame-category sequence --head "
            f"{VIDEO.name(False)} --ivsb-head {VIDEO.name(True)}" if video else "--frames 1,4,16,64")
    lines += ["", f"Served: `specserve bench multimodal {rows}` (Sparrow's rows; docs/benchmarks.md)."]
    card = out / "README.md"
    card.write_text("\n".join(lines) + "\n")
    return card
