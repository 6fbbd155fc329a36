"""The HTTP surface (FastAPI): OpenAI's chat completions, completions and models, per
session and for the current policy, and copes' ask/tell routes.

    POST /s/{session}/v1/chat/completions   a recorded turn of one session (ES member or policy)
    GET  /s/{session}/v1/models             the session's one model
    POST /v1/chat/completions               the current policy, unrecorded (policy@VERSION)
    POST /v1/completions                    the same, for a text prompt
    GET  /v1/models                         the current policy and the open step's members
    POST /copes/v1/ask                      {"max_sessions": k, "client": name?} -> work
    POST /copes/v1/sessions/{session}/reward  {"reward": r} (+ correct, tool_calls, end_reason)
    GET  /copes/v1/sessions/{session}       what was recorded (token ids, log-probs, turns)
    GET  /copes/v1/status                   run, policy version, the open step's progress

Every refusal is an OpenAI-style error body with its HTTP status; nothing changes on a
refused request.
"""

import asyncio
import hmac
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route

from copes.serve.wire import ServeError, parse_request


class _KeyCheck:
    """``Authorization: Bearer KEY`` on every request (a plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` costs a task group and two streams per request)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ServeError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                   code="invalid_api_key")  # fmt: skip
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Any) -> Any:
    app = FastAPI(title="copes-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ServeError)
    async def _refused(_: Request, exc: ServeError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    if server.api_key:
        app.add_middleware(_KeyCheck, key=server.api_key)

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ServeError(400, "the request body is not JSON") from None

    def model_list(names: list[str]) -> dict[str, Any]:
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": now, "owned_by": "copes"} for n in names
            ],
        }

    # ------------------------------------------------------------------ OpenAI routes
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(server.models())

    @app.get("/s/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        return model_list([server.session(session_id).model])

    async def session_chat(request: Request) -> Any:
        session = server.session(request.path_params["session_id"])
        turn = parse_request(await body_of(request))
        server.check_model(turn, session)
        server.check_sampling(turn, session.step.sampling)
        served = session.step
        # Inline, not in a worker thread: a turn's encoding is a few milliseconds, and a
        # thread hop per request costs more than that while the engine holds the GIL.
        future = session.submit(
            turn, server.chat, server.max_context, server.sampling.max_new_tokens
        )
        to_deadline = max(0.0, served.deadline - time.monotonic())
        left = min(to_deadline, server.request_timeout)
        try:  # the reply as it was recorded: no model validation on the way out
            reply = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), left)
            return JSONResponse(reply)
        except asyncio.TimeoutError:
            if left >= to_deadline:
                raise ServeError(
                    504,
                    f"step {served.step} passed its deadline (--step-timeout) before this "
                    "turn was generated",
                    code="step_timeout",
                ) from None
            raise ServeError(
                504,
                f"not generated within --request-timeout ({server.request_timeout:g} s): "
                f"{served.waiting_reason(server.schedule)}; the turn stays queued (a retry "
                "of the same request waits for it)",
                code="request_timeout",
            ) from None

    # Every turn of training comes here: a plain Starlette route, without FastAPI's
    # per-request dependency solving (nothing here is declared for it to solve).
    app.router.routes.append(
        Route("/s/{session_id}/v1/chat/completions", session_chat, methods=["POST"])
    )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        turn = parse_request(await body_of(request))
        server.check_model(turn, None)
        return await asyncio.to_thread(server.generate_policy, turn)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise ServeError(400, "prompt must be one string", param="prompt")
        # The same checks as a chat request: the prompt as one user message's place.
        turn = parse_request({**body, "messages": [{"role": "user", "content": prompt}]})
        server.check_model(turn, None)
        return await asyncio.to_thread(server.complete_text, turn, prompt)

    # ------------------------------------------------------------------ ask / tell
    @app.post("/copes/v1/ask")
    async def ask(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        limit = body.get("max_sessions", 1) if isinstance(body, dict) else None
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ServeError(400, "max_sessions must be a positive integer", param="max_sessions")
        client = body.get("client")
        if client is not None and not isinstance(client, str):
            raise ServeError(400, "client must be a name (a string) or absent", param="client")
        if client is None:  # named by its address in a failed step's message
            peer = request.client
            client = f"{peer.host}:{peer.port}" if peer is not None else "an unnamed client"
        else:
            client = f"client {client!r}"
        served = server.open
        if server.failure is not None:  # a step failed: the run stops, no more work
            return {"done": True, "step": None, "work": [], "error": server.failure}
        if server.finished:
            return {"done": True, "step": None, "work": []}
        if served is None or served.failed is not None:
            return {"done": False, "step": None, "work": [], "retry_after": 0.5}
        work = [server.work_item(s) for s in served.claim(limit, client)]
        return {
            "done": False,
            "step": served.step,
            "purpose": served.purpose,
            "work": work,
            "retry_after": 0.5,
        }

    @app.post("/copes/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        session = server.session(session_id)
        body = await body_of(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise ServeError(
                400, 'the body must be {"reward": number, "correct": bool?}', param="reward"
            )
        session.end(body["reward"], body.get("correct"), body.get("tool_calls"),
                    body.get("end_reason"))  # fmt: skip
        return {"session": session_id, "reward": session.reward}

    @app.get("/copes/v1/sessions/{session_id}")
    async def record(session_id: str) -> dict[str, Any]:
        return server.session(session_id).record()

    @app.get("/copes/v1/status")
    async def status() -> dict[str, Any]:
        served = server.open
        return {
            "run": server.run_id,
            "policy": server.models()[0],
            "done": server.finished,
            "step": None
            if served is None
            else {
                "step": served.step,
                "purpose": served.purpose,
                "sessions": len(served.sessions),
                "rewarded": sum(s.ended for s in served.sessions),
            },
        }

    return app
