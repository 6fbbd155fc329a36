"""An evaluation's numbers from its samples: pass@k, mean@n, maj@n and the episode rates
(tool use, protocol use, invalid turns, undone arithmetic), per benchmark."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from copes.agents.rollout import mean_of_said
from copes.evaluation.passk import majority_at_n, mean_at_n, pass_at_k
from copes.evaluation.report import BenchmarkResult
from copes.registry import Benchmark

DEFAULT_KS = (1, 4, 16)


def default_ks(n: int) -> tuple[list[int], list[int]]:
    """(the default k that n samples allow, those left out): pass@k needs k <= n."""
    return [k for k in DEFAULT_KS if k <= n], [k for k in DEFAULT_KS if k > n]


def check_ks(ks: Iterable[int], n: int) -> list[int]:
    """`ks` sorted and deduplicated; ValueError unless every k is in [1, n]."""
    if n < 1:
        raise ValueError(f"n (samples per problem) must be >= 1, got {n}")
    ks = sorted(set(int(k) for k in ks))
    if not ks:
        raise ValueError("no k given for pass@k; pass e.g. ks=[1, 4, 16]")
    if ks[0] < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={ks[0]}")
    if ks[-1] > n:
        too_big = [k for k in ks if k > n]
        raise ValueError(
            f"pass@k needs k <= n samples per problem: k={too_big} with n={n}; "
            f"raise n to at least {too_big[-1]} or drop those k"
        )
    return ks


def summarize(
    benchmark: Benchmark,
    samples_by_task: dict[str, list[dict[str, Any]]],
    ks: Sequence[int],
) -> BenchmarkResult:
    """Per-problem pass@k, mean@n and maj@n averaged over problems (in the given order)."""
    if not samples_by_task:
        raise ValueError(f"benchmark {benchmark.name!r} has no samples to summarize")
    pass_sums = dict.fromkeys(ks, 0.0)
    mean_sum = maj_sum = 0.0
    all_samples: list[dict[str, Any]] = []
    for task_id, samples in samples_by_task.items():
        samples = sorted(samples, key=lambda r: int(r["sample"]))
        n, c = len(samples), sum(bool(r["correct"]) for r in samples)
        if n < max(ks):
            raise ValueError(
                f"{benchmark.name} problem {task_id!r} has {n} samples, fewer than k={max(ks)}; "
                f"finish the evaluation (resume it) before computing pass@{max(ks)}"
            )
        for k in ks:
            pass_sums[k] += pass_at_k(n, c, k)
        mean_sum += mean_at_n([r["reward"] for r in samples])
        maj_sum += majority_at_n(
            [r["prediction"] for r in samples],
            [bool(r["correct"]) for r in samples],
            benchmark.normalize,
        )
        all_samples.extend(samples)
    problems = len(samples_by_task)
    per_problem = {len(s) for s in samples_by_task.values()}
    total = len(all_samples)
    return BenchmarkResult(
        benchmark=benchmark.name,
        num_problems=problems,
        n=per_problem.pop() if len(per_problem) == 1 else min(per_problem),
        pass_at_k={k: pass_sums[k] / problems for k in ks},
        mean_at_n=mean_sum / problems,
        maj_at_n=maj_sum / problems,
        mean_tool_calls=sum(r["tool_calls"] for r in all_samples) / total,
        mean_turns=sum(r["turns"] for r in all_samples) / total,
        mean_generated_tokens=sum(r["generated_tokens"] for r in all_samples) / total,
        end_reasons=dict(sorted(Counter(r["end_reason"] for r in all_samples).items())),
        protocol_use_rate=sum(
            r["tool_calls"] > 0 or r["end_reason"] == "answer" for r in all_samples
        )
        / total,
        tool_use_rate=sum(r["tool_calls"] > 0 for r in all_samples) / total,
        invalid_rate=sum(r["end_reason"] == "invalid" for r in all_samples) / total,
        undone_arithmetic_rate=_undone_arithmetic_rate(all_samples),
    )


def _undone_arithmetic_rate(samples: list[dict[str, Any]]) -> float | None:
    """The share of samples refused for arithmetic left undone (issue 48); None unless every
    answered sample's grade says (QA graders never do; samples graded before issue 48 did
    not). A sample without an answer was refused nothing."""
    return mean_of_said(
        r.get("grade", {}).get("undone_arithmetic") if r.get("prediction") is not None else False
        for r in samples
    )
