"""The OpenAPI document: FastAPI's, plus the request bodies of the routes that parse their own.

The completion routes read their body as raw JSON, so that every error comes out in OpenAI's
shape whatever the Content-Type; FastAPI therefore cannot see their request models. This adds
each model's JSON schema (pydantic's, so it cannot drift from what is accepted) as the route's
request body, so that clients and fuzzers see the real schema.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdserve.gateway.embeddings import EmbeddingRequest
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.responses import ResponsesRequest
from pdserve.gateway.tokenization import DetokenizeRequest, TokenizeRequest

BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/v1/embeddings", "post"): EmbeddingRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and /openapi.json) document the JSON bodies in `BODIES`."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for (path, method), model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            doc["paths"][path][method]["requestBody"] = {
                "required": True,
                "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
