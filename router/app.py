"""The OpenAI-compatible HTTP gateway: ``create_app(config) -> FastAPI`` and ``serve(config)``.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics, GET /server_info, POST /flush_cache, POST /tokenize, POST /detokenize, GET /version,
GET /get_model_info, SGLang's POST /generate and GET /health_generate. Every error is OpenAI-shaped JSON
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status (FastAPI's 422 becomes 400).
This module never imports torch (tests check it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from router import serving, sglang_native
from router.admission import AdmissionGate
from router.config import RouterConfig, model_limits
from router.connections import ConnectionLimits, fd_capped_connections, guarded_protocol
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.middleware import ApiKeyMiddleware, RequestMetricsMiddleware
from router.openai_protocol import ModelCard, ModelList, OpenAIError
from router.policy import CacheAwarePolicy, PolicyConfig
from router.serving import RouterState
from router.worker_metrics import render_deployment
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/server_info",
          "/flush_cache", "/tokenize", "/detokenize", "/version", "/get_model_info", "/generate", "/health_generate")


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def served_layers(model_dir: str, decode: list[Worker]) -> dict[str, Any]:
    """/server_info's ``num_layers``: the checkpoint's decoder layers (config.json; None when unreadable), the
    layer counts the decode workers serve (their KV layouts), and ``override`` when they serve fewer
    (``--num-layers``), so that benchmark reports can say so."""
    checkpoint = None
    path = Path(model_dir) / "config.json"
    if path.is_file():
        try:
            hf = json.loads(path.read_text())
            checkpoint = {**hf.get("text_config", {}), **hf}.get("num_hidden_layers")
        except (OSError, ValueError):
            pass
    served = sorted({w.last_load.layout.num_layers for w in decode
                     if w.last_load is not None and w.last_load.layout.num_layers})
    override = isinstance(checkpoint, int) and any(n != checkpoint for n in served)
    return {"checkpoint": checkpoint, "served": served, "override": override}


def create_app(config: RouterConfig, tokenizer: Any = None) -> FastAPI:
    """Build the gateway. ``tokenizer`` defaults to ``tokenization.tokenizer.Tokenizer.from_dir(config.model_dir)``.

    Worker channels open and the health loop starts in the app's lifespan (startup polls every worker once).
    """
    from tokenization.tokenizer import IncrementalDetokenizer, Tokenizer  # torch-free by contract

    if tokenizer is None:
        tokenizer = Tokenizer.from_dir(config.model_dir)
    metrics = RouterMetrics()
    policy = CacheAwarePolicy(PolicyConfig(config.cache_threshold, config.balance_abs_threshold,
                                           config.balance_rel_threshold, config.tree_max_tokens))
    gate = AdmissionGate(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s,
                         config.retry_after_s)
    metrics.bind_queue(lambda: gate.num_active, lambda: gate.num_queued)
    state = RouterState(config, tokenizer, IncrementalDetokenizer, model_limits(config, tokenizer.vocab_size),
                        metrics, WorkerPool(config, policy, metrics), gate)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        log.info("router serving model %r (context %d tokens) over %d decode and %d prefill worker(s)",
                 config.model_name, state.limits.context_len, len(state.pool.decode), len(state.pool.prefill))
        try:
            yield
        finally:
            await state.pool.close()

    app = FastAPI(title="nvfp4-serve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    _add_error_handlers(app)
    _add_routes(app, state)
    if config.api_key:
        open_paths = {"/health", "/metrics"} if config.metrics_open else {"/health"}
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, endpoints=ROUTES)  # outermost: counts 401s
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        return error_response(OpenAIError(400, f"{'.'.join(loc)}: {err.get('msg')}" if loc else str(err.get("msg")),
                                          param=loc[0] if loc else None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client left before its body arrived: nobody to answer, nothing went wrong here
        log.info("%s %s: client disconnected during the upload", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(OpenAIError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # the exception's text might quote request content: above debug level only its type is logged
        log.error("internal error on %s %s: %s (traceback at debug level)", request.method, request.url.path,
                  type(exc).__name__)
        log.debug("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}"))


def _add_routes(app: FastAPI, state: RouterState) -> None:
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    _add_operation_routes(app, state)


def _add_generation_routes(app: FastAPI, state: RouterState) -> None:
    """OpenAI's completions and chat completions, SGLang's /generate, vLLM's /tokenize and /detokenize."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(state, request)

    @app.post("/generate")
    async def generate(request: Request) -> Response:  # SGLang native
        return await sglang_native.generate(state, request)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        return await sglang_native.health_generate(state)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:  # vLLM's shape
        return JSONResponse(await serving.tokenize(state, request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await serving.detokenize(state, request))


def _add_info_routes(app: FastAPI, state: RouterState) -> None:
    """What is served: the model, the version, the deployment's state."""
    config, pool = state.config, state.pool

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=config.model_name, root=config.model_dir, max_model_len=state.context_len())
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        serving.check_model(config, model_id)
        card = ModelCard(id=config.model_name, root=config.model_dir, max_model_len=state.context_len())
        return JSONResponse(card.model_dump(mode="json"))

    @app.get("/version")
    async def version() -> JSONResponse:
        from svc_common.cli_help import version as package_version

        return JSONResponse({"version": package_version()})

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:  # SGLang's
        return JSONResponse({"model_path": config.model_dir, "tokenizer_path": config.model_dir,
                             "is_generation": True, "served_model_name": config.model_name,
                             "max_model_len": state.context_len()})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        await pool.check_all()  # fresh GetLoad of every worker
        return JSONResponse({
            "config": config.public_dict(), "model": config.model_name, "context_len": state.context_len(),
            "model_context_len": state.limits.context_len, "vocab_size": state.limits.vocab_size,
            "num_active_requests": state.gate.num_active, "num_queued_requests": state.gate.num_queued,
            "prefix_tree_tokens": pool.policy.tree_sizes(),
            "num_layers": served_layers(config.model_dir, pool.decode),
            "decode": [w.describe() for w in pool.decode], "prefill": [w.describe() for w in pool.prefill],
        })


def _add_operation_routes(app: FastAPI, state: RouterState) -> None:
    """Health, metrics and the cache flush."""
    config, pool = state.config, state.pool

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = {"decode_healthy": len(pool.healthy("decode")), "decode_total": len(pool.decode),
                  "prefill_healthy": len(pool.healthy("prefill")), "prefill_total": len(pool.prefill)}
        if pool.ready:
            return JSONResponse({"status": "ok", **counts})
        down = "; ".join(f"{w.role} {w.address}: {w.last_error}" for w in pool.workers if not w.healthy)
        err = OpenAIError(503, f"not ready: {down}", code="no_healthy_worker",
                          headers={"Retry-After": str(max(1, config.retry_after_s))})
        return JSONResponse({**err.body(), "status": "unavailable", **counts}, status_code=503,
                            headers=err.headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await render_deployment(state.metrics, pool.workers, config.health_check_timeout_s)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        workers = pool.healthy("decode")
        if not workers:
            raise OpenAIError(503, "no healthy decode worker to flush", code="no_healthy_worker")
        results = await asyncio.gather(*(w.flush_cache(config.health_check_timeout_s * 5) for w in workers),
                                       return_exceptions=True)
        out, failed = [], []
        for w, res in zip(workers, results, strict=True):
            if isinstance(res, grpc.aio.AioRpcError):
                failed.append(f"{w.address}: {res.code().name}: {res.details()}")
                out.append({"address": w.address, "error": f"{res.code().name}: {res.details()}"})
            elif isinstance(res, BaseException):
                raise res
            else:
                pool.policy.forget(w.address)
                out.append({"address": w.address, "flushed": res.flushed, "num_pages_freed": res.num_pages_freed})
        if failed:
            raise OpenAIError(502, "flush_cache failed on " + "; ".join(failed))
        return JSONResponse({"flushed": all(r["flushed"] for r in out), "workers": out})


def serve(config: RouterConfig) -> None:
    """Run the gateway with uvicorn (uvloop when installed) until interrupted."""
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    logging.basicConfig(level=logging.DEBUG if config.log_level == "trace" else config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("router binds to %s: reachable from other hosts%s", config.host,
                    "" if config.api_key else " WITHOUT an API key (--api-key)")
    else:
        log.info("router binds to %s only (pass --host 0.0.0.0 to serve other hosts)", config.host)
    log.info("gRPC links to the workers: %s", config.tls.describe())
    limits = ConnectionLimits(config.header_timeout_s, config.body_timeout_s,
                              fd_capped_connections(config.max_connections), config.retry_after_s)
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop=loop, log_level=config.log_level,
                timeout_graceful_shutdown=5, http=guarded_protocol(limits),
                timeout_keep_alive=config.keep_alive_timeout_s)  # type: ignore[arg-type]
