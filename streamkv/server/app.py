"""Builds the FastAPI application around an AsyncEngine."""
from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from streamkv.engine.async_engine import AsyncEngine
from streamkv.errors import InvalidRequestError
from streamkv.server import anthropic_api, flash_api, input_streams_api, openai_api, sessions_api, spans_api, ui_api
from streamkv.server.config import ServerConfig
from streamkv.server.errors import APIError, install_error_handlers
from streamkv.server.generation import Limits
from streamkv.server.metrics import ServerMetrics
from streamkv.server.middleware import GuardMiddleware
from streamkv.server.protocol import DetokenizeRequest, TokenizeRequest, message_text
from streamkv.server.state import ServerState


def create_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    api_key = config.api_key or os.environ.get("STREAMKV_API_KEY") or None
    app = FastAPI(title="streamkv", version="0.1.0")
    metrics = ServerMetrics(engine)
    bundle = engine.engine.bundle
    app.state.streamkv = ServerState(engine, config, config.served_model_name or bundle.model_name,
                                     Limits(bundle.max_model_len, bundle.vocab_size), metrics)
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(sessions_api.router)
    app.include_router(flash_api.router)
    app.include_router(input_streams_api.router)
    app.include_router(spans_api.router)
    app.include_router(ui_api.router)
    _utility_routes(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)
    return app


def _utility_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        state: ServerState = request.app.state.streamkv
        ok = state.engine.accepting and state.engine.alive
        return Response(status_code=200 if ok else 503)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.streamkv
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        try:
            if req.messages is not None:
                text = state.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": message_text(m.content)} for m in req.messages])
            else:
                text = req.prompt or ""
            ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": state.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.streamkv
        bad = next((t for t in req.tokens if not 0 <= t < state.limits.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {state.limits.vocab_size})",
                           param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.streamkv
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
