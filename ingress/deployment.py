"""The ingress deployment: OpenAI-compatible HTTP and gRPC in, a target replica's token stream out.

Both protocols share one path, a module for each part of it:

    body --(pydantic)--> Preparer.prepare --> Prepared --> TargetStreams.events --> Events
         (prepare.py: checks, tokens, pictures)            (resumable.py: target.generate -> TextStream,
                                                            resumed when a target replica fails)

``http_api.py`` formats the events as OpenAI JSON or Server-Sent Events, ``grpc_api.py`` as
protobuf messages; what a client gets when something breaks is written in ``resumable.py``.
With API keys configured (``auth.py``) every route but ``/health`` needs one (401 /
``UNAUTHENTICATED``); bodies over ``max_body_bytes`` are a 413 before anything parses them
(``guard.py``).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations (a body's
# model) on the replica, where Serve's copy of this class keeps only the globals its code uses, so
# an annotation left as a string would not resolve there.
import logging
from collections.abc import AsyncIterator

from fastapi import Query
from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.ingress import guard
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.auth import ApiKeys
from specserve.ingress.config import IngressConfig
from specserve.ingress.grpc_api import GrpcFace
from specserve.ingress.http_api import HttpFace, api
from specserve.ingress.image_generation import ImageGenerationRequest, NoText, PictureFace
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Preparer
from specserve.ingress.resumable import TargetStreams
from specserve.replicas.imagegen import is_generator_folder
from specserve.replicas.vlm import load_target_text

__all__ = ["Ingress", "IngressConfig", "api"]

logger = logging.getLogger("ray.serve")


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1024, health_check_period_s=10)
@serve.ingress(api)
class Ingress:
    def __init__(self, target: DeploymentHandle, config: IngressConfig, policy: DeploymentHandle | None = None):
        """``policy``: the policy service, when the application shares statistics through Redis."""
        # An image generator's deployment answers /v1/images/generations; text routes refuse.
        self.pictures = None
        if is_generator_folder(config.target):
            preparer, streams = None, TargetStreams(target, NoText(), config)
            self.pictures = PictureFace(config, streams)
        else:
            text = load_target_text(config.target)
            preparer, streams = Preparer(text, config), TargetStreams(target, text.tokenizer, config)
        api_keys = ApiKeys.load(config.api_keys_file)
        guard.configure(api_keys, config.max_body_bytes, config.body_timeout_s)
        self.http = HttpFace(config, preparer, streams, target, policy)
        self.grpc = GrpcFace(config.model_id, api_keys, preparer, streams, self.pictures)
        logger.info("ingress for %s: API keys %s", config.model_id,
                    f"required ({len(api_keys)} configured)" if api_keys.enabled else "off")

    # ---- HTTP (the routes are this class's own methods: ``http_api.py`` says why) -----------------

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return self.http.models()

    @api.get("/v1/policy")
    async def policy_snapshot(self) -> dict:
        """The cluster priors new requests start from (the policy service's latest snapshot), and
        ``cluster_learning``: "on", or "off: ..." with what to set when the app has no Redis."""
        return await self.http.policy_snapshot()

    @api.get("/v1/routing/recent")
    async def routing_recent(self, limit: int = Query(50, ge=1, le=1000)) -> dict:
        """The draft router's latest decisions with their features and outcomes: the whole
        cluster's (the Redis stream, through the policy service) when there is one, else one
        target replica's own."""
        return await self.http.routing_recent(limit)

    @api.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        self._text_only()
        return await self.http.completions(req)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, req: ChatCompletionRequest):
        self._text_only()
        return await self.http.chat_completions(req)

    @api.post("/v1/images/generations")
    async def images_generations(self, req: ImageGenerationRequest) -> dict:
        if self.pictures is None:
            raise OpenAIError("this deployment's model generates text, not pictures: use /v1/chat/completions",
                              param="model", code="images_not_supported")
        return await self.pictures.generate(req)

    def _text_only(self) -> None:
        if self.pictures is not None:
            raise OpenAIError("this deployment's model generates pictures: POST /v1/images/generations",
                              param="model", code="text_not_supported")

    # ---- gRPC (method names are the RPC names of specserve.proto) --------------------------------

    async def Complete(self, request: pb.CompletionRequest, grpc_context) -> pb.CompletionResponse:
        return await self.grpc.complete(request, grpc_context)

    async def CompleteStream(self, request: pb.CompletionRequest, grpc_context) -> AsyncIterator[pb.CompletionChunk]:
        async for chunk in self.grpc.complete_stream(request, grpc_context):
            yield chunk

    async def GenerateImage(self, request: pb.ImageRequest, grpc_context) -> pb.ImageResponse:
        return await self.grpc.generate_image(request, grpc_context)
