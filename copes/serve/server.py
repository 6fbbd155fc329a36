"""`PolicyServer`: a copes policy, its population and its open step behind one endpoint.

The server object is the state both sides share: the trainer opens and closes steps on it
(`open_step`, `close_step`), the HTTP app (`copes.serve.app`) reads requests into it.

Who uses the model when. The trainer holds `model_lock` while it changes the weights (a
step's members loaded, an update) and while a served step's episode loop runs. A sessionless
request for the current policy never waits for a step: while a loop runs it is interjected
into it (generated on the loop's thread between two forward passes, with the policy's own
weights: `copes.agents.episodes.Interjections`); otherwise it takes the lock, waiting only
for weights that are being changed, and is refused as stale if they changed meanwhile.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from copes.agents.episodes import SCHEDULES, Interjections, Schedule
from copes.agents.policy import SamplingConfig
from copes.serve.names import member_name, new_run_id, parse_model_name, policy_name
from copes.serve.sessions import Session
from copes.serve.steps import ServedStep, SessionSpec
from copes.serve.wire import ServeError, TurnRequest, context_error, turn_reply

logger = logging.getLogger(__name__)

STEP_TIMEOUT = 1800.0  # seconds a step waits for all of its rewards (--step-timeout)
REQUEST_TIMEOUT = 600.0  # seconds a request waits for its reply (--request-timeout)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PolicyServer:
    """What the endpoint serves: the current policy (``policy@VERSION``), the open step's
    sessions and members, and the ask/tell queue of work.

    Args:
        policy: the run's policy (its `chat` renders conversations).
        sampling: the step's sampling (temperature, top-p); a request may restate it, not
            change it. Its `max_new_tokens` is a turn's default length.
        call_format: how the model writes tool calls (`copes.envs.parsing`), read into
            OpenAI `tool_calls` when a request sends `tools`.
        api_key: required as ``Authorization: Bearer KEY`` when set.
        step_timeout: seconds a step waits for every reward before it fails.
        request_timeout: seconds a request waits for its reply before a 504 says why.
        schedule: when a step's turns join the batch (`copes.agents.episodes`):
            ``as-they-come`` (any client) or ``deterministic`` (every session at once; the
            in-process tokens bit for bit).
    """

    def __init__(
        self,
        policy: Any,
        sampling: SamplingConfig,
        call_format: str = "tags",
        api_key: str | None = None,
        step_timeout: float = STEP_TIMEOUT,
        max_context: int | None = None,
        run_id: str | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
        schedule: str = "deterministic",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.policy = policy
        self.request_timeout = request_timeout
        self.schedule: Schedule = "as-they-come" if schedule == "as-they-come" else "deterministic"
        self.max_context = max_context or policy.max_context
        self.chat = policy.chat
        self.sampling = sampling
        self.call_format = call_format
        self.api_key = api_key
        self.step_timeout = step_timeout
        self.run_id = run_id or new_run_id()
        self.policy_version = 0
        self.model_lock = threading.RLock()  # the trainer's thread, while weights may change
        self._loop_guard = threading.Lock()
        self._interjections: Interjections | None = None  # set while a step's loop runs
        self.failure: str | None = None  # why the run stopped, when a step failed
        self.open: ServedStep | None = None
        self.last_step = -1  # the newest step opened for training
        self.finished = False  # no more work: clients asking are told to stop
        self.base_url = ""  # set by `start`
        self._http: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ trainer side
    def open_step(
        self,
        step: int,
        specs: Sequence[SessionSpec],
        purpose: str = "train",
        sampling: SamplingConfig | None = None,
    ) -> ServedStep:
        """Open a step with these sessions (members named with the step; the policy's
        sessions ``policy@VERSION``), sampled with `sampling` (default: the run's)."""
        if self.open is not None:
            raise RuntimeError(f"step {self.open.step} is still open")
        names = [
            policy_name(self.policy_version)
            if s.member is None
            else member_name(self.run_id, step, s.member)
            for s in specs
        ]
        served = ServedStep(step, purpose, self.policy_version, names, specs, self.step_timeout)
        served.sampling = sampling or self.sampling
        if purpose == "train":
            self.last_step = max(self.last_step, step)
        self.open = served
        return served

    def close_step(self, served: ServedStep) -> None:
        """The step is over: its sessions and member names stop working. (The policy's
        version is the trainer's to move, after an update: `policy_version`.)"""
        served.closed = True
        if served.failed is not None:
            self.failure = served.failed.message
        if self.open is served:
            self.open = None

    @contextmanager
    def loop_running(self) -> Iterator[Interjections]:
        """While a served step's episode loop runs (its thread holds `model_lock`), the
        sessionless requests it runs between forward passes; those queued after its last
        look run here, before the lock is given up."""
        interjections = Interjections()
        with self._loop_guard:
            self._interjections = interjections
        try:
            yield interjections
        finally:
            with self._loop_guard:
                self._interjections = None
            interjections.run()

    # ------------------------------------------------------------------ request side
    def session(self, session_id: str) -> Session:
        served = self.open
        if served is None or session_id not in served.by_id:
            raise ServeError(
                404,
                f"no open session {session_id!r} (its step closed, or it "
                "never existed); ask for new work",
                code="session_not_found",
            )
        return served.by_id[session_id]

    def check_model(self, request: TurnRequest, session: Session | None) -> None:
        """The request's model must be the session's (or the current policy, sessionless)."""
        name = request.model
        if session is not None:
            if name != session.model:
                raise ServeError(
                    400,
                    f"session {session.id} serves model {session.model!r}, not {name!r}",
                    code="model_not_session",
                    param="model",
                )
            return
        parsed = parse_model_name(name)
        if parsed is None or (parsed.run is not None and parsed.run != self.run_id):
            raise ServeError(
                404,
                f"unknown model {name!r} (GET /v1/models lists them)",
                code="model_not_found",
                param="model",
            )
        if parsed.is_policy:
            if parsed.step != self.policy_version:
                raise ServeError(
                    409,
                    f"{name!r} is not the current policy "
                    f"({policy_name(self.policy_version)!r}): its weights changed",
                    code="model_stale",
                    param="model",
                )
            return
        served = self.open
        if parsed.step < (served.step if served else self.last_step + 1):
            raise ServeError(
                409,
                f"{name!r} belongs to step {parsed.step}, which is closed",
                code="step_closed",
                param="model",
            )
        if served is None or parsed.step > served.step:
            raise ServeError(
                409,
                f"{name!r} belongs to step {parsed.step}, which is not open yet",
                code="step_not_open",
                param="model",
            )
        if parsed.member not in {s.member for s in served.sessions}:
            raise ServeError(
                404,
                f"step {parsed.step} has no member {parsed.member}",
                code="model_not_found",
                param="model",
            )
        raise ServeError(
            400,
            f"{name!r} is served per session: send its requests to the "
            "session's base URL (/s/SESSION/v1, from the step's work)",
            code="session_required",
            param="model",
        )

    def check_sampling(self, request: TurnRequest, sampling: SamplingConfig | None = None) -> None:
        """A request may restate the temperature and top-p it is sampled with (its step's,
        or the run's for sessionless requests), not change them."""
        sampling = sampling or self.sampling
        restated = (
            ("temperature", sampling.temperature, request.temperature),
            ("top_p", sampling.top_p, request.top_p),
        )
        for name, ours, theirs in restated:
            if theirs is not None and theirs != ours:
                raise ServeError(
                    400,
                    f"{name}={theirs} but this run samples with {name}={ours}"
                    f" (set by the trainer); omit {name} or send {ours}",
                    param=name,
                )

    def models(self) -> list[str]:
        names = [policy_name(self.policy_version)]
        if self.open is not None:
            names += sorted({s.model for s in self.open.sessions} - set(names))
        return names

    def _generate_once(self, request: TurnRequest, ids: list[int], param: str) -> Any:
        """One unrecorded turn of the current policy from `ids` (a sessionless request)."""
        self.check_sampling(request)
        limit = request.max_tokens or self.sampling.max_new_tokens
        if not ids or len(ids) + limit > self.max_context:
            raise context_error(len(ids), limit, self.max_context, param)
        # A seed of its own: sampling never touches the global generator the run may use.
        sampling = replace(
            self.sampling, max_new_tokens=limit, stop=request.stop, seed=secrets.randbits(62)
        )

        def generate() -> Any:
            self.check_model(request, None)  # the weights may have changed while it waited
            return self.policy.generate_ids([ids], sampling)[0]

        deadline = time.monotonic() + self.request_timeout
        while True:
            with self._loop_guard:
                loop = self._interjections
                future = None if loop is None else loop.submit(generate)
            if future is not None:  # a step's loop runs it between two forward passes
                try:
                    return future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    future.cancel()
                    raise ServeError(
                        504,
                        f"not generated within --request-timeout ({self.request_timeout:g} s): "
                        "the open step's episode loop did not reach it",
                        code="request_timeout",
                    ) from None
            if self.model_lock.acquire(timeout=0.05):
                try:
                    return generate()
                finally:
                    self.model_lock.release()
            if time.monotonic() > deadline:
                raise ServeError(
                    504,
                    f"not generated within --request-timeout ({self.request_timeout:g} s): the "
                    "trainer was changing the policy's weights all that time",
                    code="request_timeout",
                )

    def generate_policy(self, request: TurnRequest) -> dict[str, Any]:
        """A sessionless chat turn of the current policy (not recorded)."""
        prompt = self.chat.encode_prompt(request.messages, request.tools)
        generation = self._generate_once(request, prompt, "messages")
        text = self.chat.turn_text(generation.token_ids, request.messages)
        extra = {"policy_version": self.policy_version}
        reply, _ = turn_reply(
            request, generation, text, self.call_format, self.chat.tokenizer, extra
        )
        return reply

    def complete_text(self, request: TurnRequest, prompt: str) -> dict[str, Any]:
        """A sessionless text completion of the current policy (not recorded)."""
        ids = self.chat.encode_text(prompt)
        generation = self._generate_once(request, ids, "prompt")
        return {
            "id": f"cmpl-{time.time_ns():x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "text": generation.text,
                    "logprobs": None,
                    "finish_reason": "length" if generation.finish_reason == "length" else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(generation.token_ids),
                "total_tokens": len(ids) + len(generation.token_ids),
            },
        }

    def work_item(self, session: Session) -> dict[str, Any]:
        from copes.envs.tasks.base import task_to_dict

        return {
            "session": session.id,
            "base_url": f"{self.base_url}/s/{session.id}/v1",
            "model": session.model,
            "task": task_to_dict(session.task),
        }

    # ------------------------------------------------------------------ HTTP
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on (host, port) in a background thread (port 0: a free one); returns the
        base URL. A non-loopback address needs an API key."""
        import uvicorn

        from copes.serve.app import create_app

        if not is_loopback(host) and not self.api_key:
            raise ValueError(
                f"serving on {host} (not a loopback address) needs an API key: "
                "set --api-key or COPES_API_KEY"
            )
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        bound = sock.getsockname()[1]
        # Keep-alive well past a turn's wait: a session's connection idles while the batch
        # serves others, and a connection closed under a client's next request is an error.
        config = uvicorn.Config(
            create_app(self), log_level="warning", access_log=False, timeout_keep_alive=600,
            backlog=4096,
        )  # fmt: skip
        self._http = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._http.run, kwargs={"sockets": [sock]}, name="copes-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._http.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{bound}")
            time.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{bound}"
        logger.info("serving %s on %s/v1", policy_name(self.policy_version), self.base_url)
        return self.base_url

    def stop(self, linger: float = 0.0) -> None:
        """Tell clients the run is over (`/copes/v1/ask` answers done) and, after `linger`
        seconds for polling clients to hear it, stop serving."""
        self.finished = True
        if self.open is not None:
            self.open.fail("the server stopped")
        if self._http is not None and linger > 0:
            time.sleep(linger)
        if self._http is not None:
            self._http.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._http = None
