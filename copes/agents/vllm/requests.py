"""`EngineRequests`: every generation of a `VLLMPolicy` as requests of its one engine.

vLLM's `LLMEngine` schedules all the requests it holds at every step (continuous batching).
copes never calls `LLM.generate`: it steps the engine until *every* request in it is done
and returns them all, so a sessionless request interjected into an episode loop would
swallow the loop's turns. Here each caller adds its own requests and steps the engine until
they are finished; what finishes meanwhile for another caller waits here until that caller
takes it. All of it runs on one thread at a time (the lock makes misuse wait, not corrupt).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from copes.agents.policy import FinishReason, Generation, SamplingConfig


class EngineRequests:
    """The requests of one `vllm.LLMEngine` (`llm.llm_engine`), by the ids copes gave them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self._finished: dict[str, Any] = {}  # request id -> its final RequestOutput, in order
        self._lock = threading.RLock()
        self.steps = 0  # engine steps taken through this object

    def add(self, prompt: Sequence[int], params: Any, adapter: Any = None) -> str:
        """Queue one request (a token-id prompt, its `SamplingParams`, an optional
        `LoRARequest`); the engine schedules it at its next step. Returns its id."""
        from vllm.inputs import TokensPrompt

        if not prompt:
            raise ValueError("every prompt needs at least one token")
        request_id = f"copes-{next(self._ids)}"
        with self._lock:
            self.engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=list(prompt)), params,
                lora_request=adapter,
            )  # fmt: skip
        return request_id

    def step(self) -> None:
        """One step of the engine (every request it holds advances); the requests it
        finished are kept for their callers."""
        with self._lock:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("stepping a vLLM engine that holds no request")
            for output in self.engine.step():
                if output.finished:
                    self._finished[output.request_id] = output
            self.steps += 1

    def take_finished(self, request_ids: Iterable[str]) -> list[tuple[str, Any]]:
        """The finished requests among `request_ids`, in the order they finished (each
        handed out once)."""
        wanted = set(request_ids)
        with self._lock:
            done = [i for i in self._finished if i in wanted]
            return [(i, self._finished.pop(i)) for i in done]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests a caller gave up on (its loop raised): the engine stops computing
        them and nothing of theirs is kept."""
        ids = list(request_ids)
        with self._lock:
            if ids:
                self.engine.abort_request(ids)
            for request_id in ids:
                self._finished.pop(request_id, None)

    def run(self, requests: Sequence[tuple[Sequence[int], Any, Any]]) -> list[Any]:
        """Add (prompt, params, adapter) requests and step until every one of them is
        finished; their outputs in the order given."""
        ids = [self.add(*request) for request in requests]
        outputs: dict[str, Any] = {}
        try:
            while len(outputs) < len(ids):
                self.step()
                outputs.update(self.take_finished(i for i in ids if i not in outputs))
        except BaseException:
            self.abort(i for i in ids if i not in outputs)
            raise
        return [outputs[i] for i in ids]


def request_params(
    sampling: SamplingConfig,
    seed: int | None,
    stop: Sequence[str] | None = None,
    max_tokens: int | None = None,
) -> Any:
    """vLLM `SamplingParams` of one request: `sampling` (its stops and length unless given),
    stop strings kept in the output, the sampled tokens' log-probs, only the final output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = sampling.stop if stop is None else stop
    return SamplingParams(
        max_tokens=sampling.max_new_tokens if max_tokens is None else max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(stops) or None,
        include_stop_str_in_output=True,
        seed=seed,
        logprobs=0,  # the sampled token's own log-prob
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def generation_of(tokenizer: Any, prompt: list[int], completion: Any) -> Generation:
    """A finished vLLM `CompletionOutput` as copes' `Generation` (the text decoded as the
    transformers backend decodes it; the sampled tokens' own log-probs)."""
    ids = list(completion.token_ids)
    logprobs = [
        float(step[token].logprob) for token, step in zip(ids, completion.logprobs, strict=True)
    ]
    reason: FinishReason
    if completion.finish_reason == "length":
        reason = "length"
    elif isinstance(completion.stop_reason, str):
        reason = "stop"
    else:
        reason = "eos"
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Generation(text, ids, logprobs, reason, prompt_token_ids=prompt)


__all__ = ["EngineRequests", "generation_of", "request_params"]
