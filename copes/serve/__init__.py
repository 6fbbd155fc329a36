"""An OpenAI-compatible endpoint over a copes policy and every ES member, so that any agent
written against `openai.OpenAI(base_url=...)` is post-trained by changing its base URL and
returning a reward (docs/serving.md).

The public face: `PolicyServer` (the state and the HTTP server), `ServedEvaluator` (an
ES/CoPES step's members as sessions), `ServedRollout` (the policy's sessions: GRPO groups,
validation), the harnesses (`InProcessHarness`, `HttpHarness`, `EnvLoop`) and `StepFailed`.
"""

from copes.serve.harness import EnvLoop, load_harness
from copes.serve.server import PolicyServer
from copes.serve.steps import SessionSpec, StepFailed
from copes.serve.training import (
    HttpHarness,
    InProcessHarness,
    ServedEvaluator,
    ServedRollout,
)

__all__ = [
    "EnvLoop",
    "HttpHarness",
    "InProcessHarness",
    "PolicyServer",
    "ServedEvaluator",
    "ServedRollout",
    "SessionSpec",
    "StepFailed",
    "load_harness",
]
