"""The application's configuration: what the Serve application builder takes as its one argument.

It says *what* runs (target, drafts, defaults); *where* and *how many* (``ray_actor_options``,
``autoscaling_config``, ``max_ongoing_requests``) stay in Ray Serve's own config file under
``deployments:``, by deployment name, so that operators tune them with the tools they know.
Deployment names are fixed: ``ingress``, ``target`` and ``draft-<name>`` for each draft.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.policies.registry import DEFAULT_POLICY, POLICIES
from specserve.replicas.model_store import REFERENCE_TARGET
from specserve.ingress.deployment import IngressConfig
from specserve.ingress.images import ImageLimits
from specserve.ingress.openai_api import AUTO_DRAFT, MAX_WINDOW, NO_DRAFT, TreeOptions
from specserve.replicas.step import TreeShape

INGRESS_DEPLOYMENT = "ingress"
TARGET_DEPLOYMENT = "target"
POLICY_DEPLOYMENT = "policy"
PROMPT_LOOKUP = "prompt-lookup"
AUTO, INSIDE, SEPARATE = "auto", "inside", "separate"   # draft placements
SUFFIX = "suffix"                                       # the model-free draft of earlier outputs
SHIPPED_ANSWERS = "answers"                             # seed_outputs: the answers shipped with specserve
# The Redis URL of an application whose config names none. Read where Serve builds the
# application (its build task, on any node), so it belongs in every node's environment or in the
# application's runtime_env.env_vars; the replicas get the URL from the builder, not from here.
REDIS_URL_ENV = "SPECSERVE_REDIS_URL"


def draft_deployment(name: str) -> str:
    return f"draft-{name}"


def redis_url_from_env() -> str | None:
    return os.environ.get(REDIS_URL_ENV) or None


class EnsembleSpec(BaseModel):
    """A draft LM's chains as a TABED ensemble of its views (``replicas/drafts/ensemble.py``)."""

    model_config = ConfigDict(extra="forbid")

    views: list[Literal["full", "last-turn", "multimodal", "text-only", "pooled", "caption"]] = Field(
        ["full", "last-turn"], min_length=1,
        description="The drafting views, rows of one batched draft forward: full (the whole context), last-turn "
        "(from the last user turn on: earlier turns and the system prompt dropped); of a VLM request's pictures: "
        "multimodal (the image tokens as the target embeds them; a draft inside its VLM target's replica), "
        "text-only (the pictures dropped), pooled (each picture's tokens averaged to 4), caption (each picture as a "
        "caption the VLM wrote of it; the VLM writes one per new picture beside the request). One view alone is a "
        "draft the router can choose per request.",
    )
    weights: Literal["adaptive", "static"] = Field(
        "adaptive", description="adaptive: each block's mix chosen from the verified tokens so far; static: the equal mix.")
    distance: Literal["kl", "tvd", "matches"] = Field(
        "matches", description="How a candidate mix is scored on verified positions: hard matches, or KL or TVD to the verified token.")
    history: int | None = Field(None, ge=1, description="Verified positions scored (default: all of the request's).")

    @model_validator(mode="after")
    def _distinct(self) -> "EnsembleSpec":
        if len(set(self.views)) != len(self.views):
            raise ValueError(f"an ensemble's views must differ; got {self.views}")
        return self


class DraftSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="What clients pass as spec.draft; the deployment is named draft-<name>.",
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
    )
    model: str | None = Field(
        None,
        description="A causal LM or hidden-state-reuse head that shares the target's tokenizer: a local "
        "folder, a .gguf file, a model-cache name or a zoo draft (smollm2-draft-2l, smollm2-eagle3, smollm2-hsr). Empty: "
        "prompt lookup, which needs no model.",
    )
    method: Literal["prompt-lookup", "suffix"] | None = Field(
        None,
        description="How a draft without a model drafts: prompt-lookup (what followed the context's last n-gram "
        "earlier in the request) or suffix (SuffixDecoding: the request's own tokens and the earlier outputs of "
        "every target replica for the same cache_salt, shared through Redis). Empty: prompt-lookup.",
    )
    seed_outputs: str | None = Field(
        None,
        description="suffix only: a folder of answer chunks (`specserve zoo answers`) that every tenant's index "
        "starts from; `answers`: the target's own answers shipped with specserve.",
    )
    ensemble: EnsembleSpec | None = Field(
        None,
        description="A draft LM only: draft its chains as a TABED ensemble of several views of the context, mixed "
        "with weights adapted to what the target verified (trees: the full view alone).",
    )
    windowed: bool = Field(
        False, description="A hidden-state-reuse head only: on a VLM request, attend to the text positions alone "
        "(Sparrow's text-anchored window), so a drafted token's cost stays flat as pictures grow.")
    placement: Literal["auto", "inside", "separate"] = Field(
        AUTO,
        description="Where the draft runs: inside each target replica (no handle call per step; it scales and "
        "fails with the target), separate (its own deployment draft-<name>: a device of its own, scaling apart), "
        "or auto: chosen by measured cost at build time (cluster/placement.py): model-free drafts inside, a model "
        "draft inside when its in-replica step costs less than a handle call plus its forwards elsewhere.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch threads in each draft replica (or on an inside draft's own thread, 1 by "
        "default); default: the replica's num_cpus (Ray's OMP_NUM_THREADS)."
    )
    quantization: Literal["int8"] | None = Field(
        None, description="A model draft only: int8 rounds its weights to int8 rows (a float32 scale each) where they "
        "are float32 on a CPU, a quarter of the bytes a drafted token reads; acceptance may change, output never "
        "(verification decides). Elsewhere the weights stay as loaded.")
    own_thread: bool = Field(
        False, description="A model draft placed inside only: its model work runs on a thread of its own in the "
        "target replica (on a GPU, its own CUDA stream), so it drafts the next step while the target verifies "
        "(draft_ahead); the replica then keeps a second core busy. Off: it shares the target's model thread.")

    @model_validator(mode="after")
    def _reserved_names(self) -> "DraftSpec":
        if self.name in (NO_DRAFT, AUTO_DRAFT):
            raise ValueError(f"a draft cannot be named {self.name!r}: that name means {'no speculation' if self.name == NO_DRAFT else 'the router decides'}")
        if self.name == PROMPT_LOOKUP and self.model is not None:
            raise ValueError(f"{PROMPT_LOOKUP!r} is the model-free draft; give the draft LM {self.model!r} another name")
        if self.method is not None and self.model is not None:
            raise ValueError(f"draft {self.name!r}: method {self.method!r} drafts without a model; a draft with a model drafts with it")
        if self.ensemble is not None and self.model is None:
            raise ValueError(f"draft {self.name!r}: an ensemble mixes views of a draft LM; give it a model")
        if self.reads_pictures and self.placement == SEPARATE:
            raise ValueError(f"draft {self.name!r}: the views {', '.join(self.ensemble.views)} read the VLM target's "
                             "pictures, which only its replica holds; placement separate is not possible")
        if self.seed_outputs is not None and self.method != SUFFIX:
            raise ValueError(f"draft {self.name!r}: seed_outputs seeds a suffix draft's index; set method: suffix")
        if self.quantization is not None and self.model is None:
            raise ValueError(f"draft {self.name!r}: quantization rounds a draft model's weights; a model-free draft has none")
        if self.own_thread and (self.model is None or self.placement == SEPARATE):
            raise ValueError(f"draft {self.name!r}: own_thread runs a model draft placed inside on a thread of its "
                             "own; a model-free draft needs none and a separate one has its own replica")
        if self.method == SUFFIX and self.placement == SEPARATE:
            raise ValueError(f"draft {self.name!r}: a suffix draft runs inside the target replica, whose finished "
                             "requests feed its index; placement separate is not possible")
        if self.seed_outputs == SHIPPED_ANSWERS:
            from specserve.training.answers import ANSWERS_DIR
            self.seed_outputs = str(ANSWERS_DIR)
        if self.seed_outputs is not None and not Path(self.seed_outputs).is_dir():
            raise ValueError(f"draft {self.name!r}: seed_outputs {self.seed_outputs!r} is not a folder")
        return self


    @property
    def reads_pictures(self) -> bool:
        """Whether its ensemble has a view that reads a VLM target's pictures (multimodal, pooled, caption)."""
        return self.ensemble is not None and bool(set(self.ensemble.views) & {"multimodal", "pooled", "caption"})


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(REFERENCE_TARGET, description="The target model: a local folder, a .gguf file or a model-cache name; "
                        "a vision-language model (smollm2-vlm, a LLaVA- or Idefics3-class folder) takes pictures too.")
    served_model_name: str | None = Field(
        None, description="The model id clients send as `model`; default: the target's folder name."
    )
    dtype: str = Field("auto", description="auto (bfloat16 where the hardware runs it natively, else float32), float32, bfloat16.")
    drafts: list[DraftSpec] = Field(
        default_factory=lambda: [DraftSpec(name=PROMPT_LOOKUP)],
        description="The drafts the target can speculate with; each runs where its placement says.",
    )
    default_draft: str = Field(PROMPT_LOOKUP, description="The draft for requests that name none (or 'auto') when the router is off: a draft name or 'none'.")
    router: bool = Field(True, description="Choose the draft of requests that name none (or 'auto') per request with the "
                         "learned draft router (specserve/routing/draft_router.py); false: default_draft for all of them.")
    router_explore: float = Field(0.2, ge=0.0, le=5.0, description="The router's exploration weight (LinUCB's β): "
                                  "how much an untried draft's uncertainty counts in its favour; 0: always the predicted best.")
    tree_explore: float = Field(0.1, ge=0.0, le=1.0, description=(
        "With redis_url: the share of tree requests (not pinned) that start one move from the shape "
        "they would start from (depth or top-k halved or doubled), so that the policy service prices "
        "the shapes around the best one measured; 0: never."))
    default_window: int = Field(4, ge=0, le=MAX_WINDOW, description="Window γ for requests that name none.")
    default_tree: TreeOptions = Field(TreeOptions(depth=4, top_k=2, budget=8), description=(
        "The tree a request starts from when its policy (its own or the deployment's) adapts trees (sage, "
        "adt-tree, eagle2-depth, static-tree) and it names no tree or window; the cluster's best measured "
        "shape replaces it where the policy service has one."))
    draft_ahead: bool = Field(True, description="A model draft that runs apart from the target's model thread "
                              "(placement separate, or own_thread) drafts each chain's next step while the target "
                              "verifies it, from the outcome where every token is accepted (replicas/step_loop.py); "
                              "a chain the verdict rules out is dropped unused.")
    grammar_draft: bool = Field(True, description="Structured output: where a request's grammar admits only one "
                                "continuation, those tokens are proposed as its step's draft (verified like any other).")
    tool_parser: Literal["hermes"] | None = Field("hermes", description="How the target writes tool calls, which "
                                                  "the ingress parses out of its output (ingress/tools.py); None: "
                                                  "requests with tools are refused.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch threads in each target replica; default: the replica's num_cpus (Ray's OMP_NUM_THREADS)."
    )
    share_cores: bool = Field(
        False, description="A target replica's step also runs on the threads of the node's idle target replicas "
        "(one stream alone on a node uses every core; under load each replica its own): CPU nodes whose one "
        "core does not take the memory bandwidth (replicas/core_share.py).")
    kv_sessions_idle: int = Field(
        4, ge=0, description="Idle KV caches a replica keeps after their requests end, as a prefix cache for follow-up turns."
    )
    max_batch: int = Field(
        16, ge=1, le=256, description="Requests a target replica verifies together in one forward; more wait for a slot."
    )
    prefill_chunk: int = Field(
        512, ge=16, description="Prompt tokens a target replica prefills per step, so that running requests are not stalled by a long prompt."
    )
    redis_url: str | None = Field(
        default_factory=redis_url_from_env,
        description="The Redis the replicas share statistics through and the policy service publishes "
        f"snapshots to (redis://, or rediss:// for TLS; a password goes in the URL). Not given: ${REDIS_URL_ENV} "
        "of the process that builds the application. None: no policy service, each replica learns alone.")
    redis_prefix: str = Field("specserve", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                              description="Key prefix in Redis, one per application, so that applications can share a Redis.")
    policy: str = Field(DEFAULT_POLICY, description=f"How each request's window adapts per step: {', '.join(POLICIES)}. "
                        "A request that names its window or tree keeps it.")
    api_keys_file: str | None = Field(
        None, description="A file of API keys (one per line) the ingress requires, read by the ingress "
        "replica itself, besides the comma-separated SPECSERVE_API_KEYS in its environment; with neither, "
        "no key is needed. A configured file that cannot be read stops the ingress from starting.")
    max_model_len: int | None = Field(
        None, ge=64, description="The longest prompt + completion a request may have (400 beyond). Each target "
        "replica allocates its KV cache for (max_batch + kv_sessions_idle) sequences of this length when it starts "
        "(on CUDA, as many as gpu_memory_utilization leaves room for), so its memory does not grow under load. "
        "None: the model's context, the cache growing as sequences do (on CUDA: see gpu_memory_utilization).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="On CUDA, the fraction of the device's memory a target replica fills, "
        "counting what is in use when it starts (its weights, other processes) and an allowance for activations "
        "(vLLM's rule): its KV slots are as many of max_model_len positions as fit, at most max_batch + "
        "kv_sessions_idle (idle sessions given up first); with max_model_len None, the model's context capped so "
        "that max_batch fit. Ignored on the CPU.")
    stream_interval: int = Field(
        1, ge=1, le=256, description="A streamed response's tokens are sent at least this many at a time (the first "
        "at once): each piece is a message from the target replica through the ingress and the proxy, which "
        "costs CPU the model would use (measured: 16 streams at once on 2 cores, 170 tok/s at 1, 186 at 4, 198 "
        "at 8). vLLM's --stream-interval. Non-streamed responses travel in 64-token pieces whatever this says "
        "(with stop strings: in pieces of this size, since the ingress looks for them as text arrives).")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="The largest HTTP body accepted (413 beyond).")
    resume_attempts: int = Field(3, ge=0, le=10, description="Times one request continues on another target "
                                 "replica after its own failed (0: fail it with a retriable 503).")
    resume_timeout_s: float = Field(60.0, gt=0, description="How long a continuation waits for a target replica "
                                    "to take it before the request ends with a retriable 503.")
    first_token_timeout_s: float = Field(120.0, gt=0, description="How long a new request waits for its first "
                                         "token (queued, admitted, prefilled) before it ends with a retriable 503: "
                                         "a target deployment with no running replica answers fast, not never.")
    max_images: int = Field(8, ge=0, description="Pictures per request at most (a VLM target's image_url parts).")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="A picture's width x height at most (400 beyond, "
                                  "checked before decoding). Its bytes count against max_body_bytes too.")
    allow_image_urls: bool = Field(False, description="Fetch http(s) image URLs (public addresses only, every "
                                   "redirect checked, 10 s for all of a request's fetches, 16 MB a picture); off: "
                                   "pictures come inline as data: URLs only.")
    max_videos: int = Field(2, ge=0, description="Clips per request at most (a VLM target's video_url parts).")
    max_video_frames: int = Field(16, ge=1, le=256, description="Frames a clip is sampled to, spread evenly over it "
                                  "(vLLM's rule), before any is decoded; each is a picture of the prompt.")
    max_request_image_pixels: int = Field(2 * 4096 * 4096, ge=1, description="All of a request's pictures together, "
                                          "width x height summed (400 beyond, checked before each is decoded).")
    max_image_aspect_ratio: float = Field(32.0, ge=1.0, description="A picture's longer side over its shorter at most: "
                                          "a processor that resizes the shorter side makes ratio x side² pixels.")
    body_timeout_s: float = Field(30.0, gt=0, description="How long a client may take to send its whole HTTP body "
                                  "(408 beyond): a trickling client holds an ingress slot no longer.")

    @model_validator(mode="after")
    def _redis_url_expanded(self) -> "AppConfig":
        # Kubernetes leaves $(NAME) as it is when NAME is not defined above it in the container's env;
        # such a URL would fail every Redis call while the deployment reported cluster learning on.
        if self.redis_url and "$(" in self.redis_url:
            raise ValueError("redis_url holds an unexpanded $(...) reference: in the pod's env, define the variable "
                             f"it names before {REDIS_URL_ENV}")
        return self

    @model_validator(mode="after")
    def _drafts_known(self) -> "AppConfig":
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        names = [d.name for d in self.drafts]
        if len(set(names)) != len(names):
            raise ValueError(f"draft names must be unique, got {names}")
        if self.default_draft not in (NO_DRAFT, *names):
            raise ValueError(f"default_draft {self.default_draft!r} is not a configured draft; choose from {', '.join([NO_DRAFT, *names])}")
        return self

    @property
    def draft_names(self) -> list[str]:
        return [d.name for d in self.drafts]

    @property
    def tree_shape(self) -> TreeShape:
        """``default_tree`` as the replicas take it."""
        return TreeShape(self.default_tree.depth, self.default_tree.top_k, self.default_tree.budget)

    def ingress_config(self) -> IngressConfig:
        return IngressConfig(self.target, self.model_id, self.draft_names, self.default_draft, self.default_window,
                             policy=self.policy, default_tree=self.tree_shape,
                             api_keys_file=self.api_keys_file, max_model_len=self.max_model_len, max_body_bytes=self.max_body_bytes,
                             stream_interval=self.stream_interval, tool_parser=self.tool_parser,
                             resume_attempts=self.resume_attempts, resume_timeout_s=self.resume_timeout_s,
                             first_token_timeout_s=self.first_token_timeout_s,
                             body_timeout_s=self.body_timeout_s,
                             images=ImageLimits(self.max_images, self.max_image_pixels, self.allow_image_urls,
                                                max_total_pixels=self.max_request_image_pixels,
                                                max_aspect_ratio=self.max_image_aspect_ratio,
                                                max_videos=self.max_videos, max_video_frames=self.max_video_frames))

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.target).name.removesuffix(".gguf")
