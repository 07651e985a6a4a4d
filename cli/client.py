"""``specserve generate --server URL``: the same request, sent to a running deployment.

``http://HOST:PORT`` speaks the OpenAI API (chat completions, or completions with ``raw``);
``grpc://HOST:PORT`` speaks ``specserve.proto``. Either way the result is the object that the
in-process ``generate --json`` prints: ``{text, token_ids, finish_reason, usage, spec}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

import requests

from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.ingress.auth import client_headers, client_metadata


@dataclass
class RemoteRequest:
    prompt: str
    max_tokens: int = 128
    draft: str | None = None        # None: the server's default
    window: int | None = None
    tree: TreeShape | None = None
    params: SamplingParams = SamplingParams()
    chat: bool = True
    model: str | None = None        # None: the first model the server lists
    images: tuple[bytes, ...] = ()  # picture files (PNG, JPEG, ...) shown before the prompt: a VLM target


class ServerError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


def _spec(req: RemoteRequest) -> dict:
    spec: dict = {}
    if req.draft is not None:
        spec["draft"] = req.draft
    if req.window is not None:
        spec["window"] = req.window
    if req.tree is not None:
        spec["tree"] = {"depth": req.tree.depth, "top_k": req.tree.top_k, "budget": req.tree.budget}
    return spec


def data_url(picture: bytes) -> str:
    """A picture file as an OpenAI ``image_url`` data URL (its type read from its bytes)."""
    import base64
    import io

    from PIL import Image

    with Image.open(io.BytesIO(picture)) as image:
        kind = (image.format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(picture).decode()}"


def _http(base: str, req: RemoteRequest, timeout_s: float) -> dict:
    base = base.rstrip("/").removesuffix("/v1")
    headers = client_headers()
    model = req.model or requests.get(f"{base}/v1/models", headers=headers, timeout=timeout_s).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": req.params.temperature,
            "top_p": req.params.top_p, "top_k": req.params.top_k, "seed": req.params.seed,
            "spec": _spec(req), "return_token_ids": True}
    if req.chat:
        content = req.prompt if not req.images else [
            *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in req.images),
            {"type": "text", "text": req.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        url = f"{base}/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        url = f"{base}/v1/completions"
    response = requests.post(url, json=body, headers=headers, timeout=timeout_s)
    out = response.json()
    if response.status_code != 200:
        raise ServerError(f"HTTP {response.status_code}: {out.get('error', {}).get('message', out)}")
    choice = out["choices"][0]
    text = choice["message"]["content"] if req.chat else choice["text"]
    return {"text": text, "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"],
            "usage": {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")}, "spec": out["spec"]}


def _grpc(address: str, req: RemoteRequest, timeout_s: float) -> dict:
    import grpc

    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress import specserve_pb2_grpc

    spec = _spec(req)
    message = pb.CompletionRequest(
        model=req.model or "", max_tokens=req.max_tokens, temperature=req.params.temperature,
        top_p=req.params.top_p, top_k=req.params.top_k,
        spec=pb.SpecOptions(draft=spec.get("draft", ""), window=spec.get("window"),
                            tree=pb.TreeShape(**spec["tree"]) if "tree" in spec else None),
    )
    if req.params.seed is not None:
        message.seed = req.params.seed
    if req.chat:
        message.messages.append(pb.ChatMessage(role="user", content=req.prompt, images=list(req.images)))
    else:
        message.prompt = req.prompt
    with grpc.insecure_channel(address) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        try:
            out = stub.Complete(message, timeout=timeout_s, metadata=(("application", "specserve"), *client_metadata()))
        except grpc.RpcError as err:
            raise ServerError(f"gRPC {err.code().name}: {err.details()}") from err
    return {"text": out.text, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
            "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens},
            "spec": {"draft": out.spec.draft, "steps": out.spec.steps,
                     "mean_accepted_len": round(out.spec.mean_accepted_len, 4),
                     "acceptance_rate": round(out.spec.acceptance_rate, 4), "windows": list(out.spec.windows)}}


def generate_remote(server: str, req: RemoteRequest, timeout_s: float = 600.0) -> dict:
    if req.images and not req.chat:
        raise ValueError("pictures go in a chat message: drop --raw")
    url = urlparse(server)
    if url.scheme in ("http", "https"):
        return _http(server, req, timeout_s)
    if url.scheme == "grpc":
        return _grpc(url.netloc, req, timeout_s)
    raise ValueError(f"--server must start with http://, https:// or grpc://, got {server!r}")
