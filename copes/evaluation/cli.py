"""`copes-eval`: pass@k of a tool-using agent on math and multi-hop QA benchmarks.

    copes-eval --model tiny --benchmarks gsm8k,hotpotqa --pass-k 1,4,16 -n 16 --out runs/eval

Prints a table and writes OUT/report.json, OUT/report.csv, one pass@k plot per benchmark and
OUT/samples.jsonl (every sample; rerunning the command resumes an interrupted evaluation).
With ``--baseline OTHER`` the other model is evaluated the same way into OUT/baseline/ and
every output shows both models and the difference.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copes.agents.loading import DTYPE_HELP
from copes.envs.parsing import CALL_FORMATS

logger = logging.getLogger(__name__)


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer, e.g. 1,4,16")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="copes-eval",
        description="Evaluate a tool-using agent: n samples per problem -> pass@k, mean@n, maj@n.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", help="'tiny', a local HF folder or a hub id (required)")
    parser.add_argument(
        "--benchmarks",
        default="synthetic-math",
        help="comma-separated registered names (copes.registry): gsm8k, math500, aime24, "
        "aime25, hotpotqa, 2wiki, musique, synthetic-math, synthetic-qa, rg:<reasoning-gym "
        "dataset>, or another package's",
    )
    parser.add_argument(
        "--pass-k", type=_ints, default=None,
        help="k values, e.g. 1,4,16 (default: those of 1,4,16 that do not exceed n)",
    )  # fmt: skip
    parser.add_argument(
        "-n",
        "--num-samples",
        dest="n",
        type=int,
        default=16,
        help="samples per problem (>= every k)",
    )
    parser.add_argument("--baseline", help="a second model, evaluated into OUT/baseline/")
    parser.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="generation backend: hf (transformers, CPU or GPU) or vllm (GPU; docs/gpu.md)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vllm: GPUs one engine spans"
    )
    parser.add_argument("--data-dir", help="local benchmark files (see docs/evaluation.md)")
    parser.add_argument(
        "--env-kwargs",
        help="JSON object for every benchmark's env factory, e.g. open-domain QA over a "
        'corpus index: \'{"corpus_index": "indexes/wiki18"}\' (docs/retrieval.md)',
    )
    parser.add_argument(
        "--split",
        help="the split of every benchmark (default: each one's evaluation split, e.g. gsm8k "
        "test, hotpotqa validation); a --data-dir folder's file whose name holds it",
    )
    parser.add_argument("--limit", type=int, help="first N problems of each benchmark")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument(
        "--top-p", type=float, default=0.95, help="nucleus sampling: keep this much mass"
    )
    parser.add_argument("--max-new-tokens", type=int, default=512, help="per turn")
    parser.add_argument("--max-turns", type=int, default=4, help="agent turns per episode")
    parser.add_argument(
        "--demonstrations",
        type=int,
        default=0,
        help="worked examples of the call protocol played as earlier turns before every task "
        "(0-2; copes.envs.demonstrations): how an instruct model that never saw the protocol "
        "learns it in context",
    )
    parser.add_argument(
        "--call-format",
        default="tags",
        choices=("native", *CALL_FORMATS),
        help="tool calls: tags, or native (what the model's chat template teaches)",
    )
    parser.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reasoning models: the chat template's enable_thinking (unset: its default)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        help="JSON object of extra chat-template variables, e.g. "
        '\'{"date_string": "26 Jul 2024"}\'',
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds every sampling batch")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, auto")
    parser.add_argument(
        "--dtype",
        default=None,
        help=f"{DTYPE_HELP} (default: bf16 on GPU, fp32 on CPU)",
    )
    parser.add_argument(
        "--batch-episodes", type=int, default=64, help="episodes rolled out together"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="vllm: GiB for the KV cache (default on a CPU: what --batch-episodes rows need, "
        "copes.agents.vllm.kv_space; on a GPU: vLLM's own share of the GPU)",
    )
    parser.add_argument(
        "--no-resume", action="store_true", help="discard samples already in OUT and start over"
    )
    parser.add_argument(
        "--regenerate-changed",
        action="store_true",
        help="resume: roll out again the samples of tasks whose data changed since they were "
        "generated (their task_digest differs; refused otherwise)",
    )
    parser.add_argument(
        "--save-messages", action="store_true", help="store every conversation in samples.jsonl"
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="re-grade the samples in OUT (and OUT/baseline) without generating",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    parser.add_argument(
        "--report-to",
        default="none",
        help="also send the results to: tensorboard, wandb, trackio (comma-separated) or none",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error too"
    )
    parser.add_argument(
        "--output-dir", "--out", dest="out", required=True, help="output folder (--out too)"
    )
    return parser


def check_envs(benchmarks: Sequence[Any], args: argparse.Namespace) -> None:
    """Load each benchmark's first task and build its env on it, so a missing file, a wrong
    --split, a wrong --env-kwargs (an index folder that is not one, an unknown argument) or
    an open-domain QA file without a retriever fails before a model is loaded."""
    from copes.envs.core import EpisodeRules
    from copes.registry import parse_env_kwargs

    env_kwargs = parse_env_kwargs(args.env_kwargs, grading=False)
    if args.demonstrations:
        env_kwargs["demonstrations"] = args.demonstrations
    rules = EpisodeRules(max_turns=args.max_turns)
    for benchmark in benchmarks:
        tasks = benchmark.load_tasks(split=args.split, data_dir=args.data_dir, limit=1)
        if not tasks:
            raise ValueError(f"benchmark {benchmark.name!r} split {args.split!r} has no tasks")
        try:
            env = benchmark.make_env(tasks, rules=rules, **env_kwargs)
        except TypeError as exc:
            flags = " and ".join(
                f for f, on in (("--env-kwargs", args.env_kwargs), ("--demonstrations",
                                 args.demonstrations)) if on
            )  # fmt: skip
            raise ValueError(
                f"{flags or 'the env options'}: {benchmark.name}'s env refused them "
                f"({str(exc)[:160]})"
            ) from None
        env.close()


def _evaluate_one(model: str, out: Path, args: argparse.Namespace, sampling: Any) -> Any:
    import torch

    from copes.agents.chat import template_kwargs_for
    from copes.agents.loading import load_policy
    from copes.evaluation.runner import evaluate
    from copes.registry import parse_env_kwargs

    policy = load_policy(
        model, backend=args.backend, device=args.device, dtype=args.dtype,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_gib=args.kv_cache_gib, rows=args.batch_episodes,
        weight_access=False,  # an evaluation only generates: vLLM's own (faster) CPU layout
        chat_template_kwargs=template_kwargs_for(args.enable_thinking, args.chat_template_kwargs),
    )  # fmt: skip
    try:
        report = evaluate(
            policy,
            args.benchmarks,
            n=args.n,
            ks=args.pass_k,
            sampling=sampling,
            limit=args.limit,
            data_dir=args.data_dir,
            out_dir=out,
            resume=not args.no_resume,
            batch_episodes=args.batch_episodes,
            progress=not args.quiet,
            max_turns=args.max_turns,
            save_messages=args.save_messages,
            model_name=model,
            call_format=args.call_format,
            regenerate_changed=args.regenerate_changed,
            env_kwargs=parse_env_kwargs(args.env_kwargs, grading=False),
            split=args.split,
            demonstrations=args.demonstrations,
        )
    finally:
        policy.close()  # a vLLM engine frees its GPU memory before the baseline's
        del policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report


def run(args: argparse.Namespace) -> int:
    from copes.agents.chat import template_kwargs_for
    from copes.agents.policy import SamplingConfig
    from copes.evaluation.report import format_table, write_report
    from copes.evaluation.rescore import rescore
    from copes.evaluation.resume import read_eval_config
    from copes.evaluation.samples import check_stored_samples
    from copes.evaluation.summary import check_ks, default_ks
    from copes.registry import resolve_benchmarks

    out = Path(args.out)
    baseline_out = out / "baseline"
    if args.rescore:
        report = rescore(out)
        baseline = rescore(baseline_out) if (baseline_out / "samples.jsonl").exists() else None
        if baseline is not None:
            write_report(baseline, baseline_out)
    else:
        # Everything that can be wrong with the arguments fails before a model is loaded.
        from copes.agents.loading import check_dtype
        from copes.envs.demonstrations import check_count
        from copes.errors import UserError, check_device

        if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
            raise UserError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
        if args.limit is not None and args.limit < 1:
            raise UserError(f"--limit must be >= 1 (problems per benchmark), got {args.limit}")
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; name a folder (it is created if missing)")
        check_device(args.device)
        check_dtype(args.dtype)
        if args.pass_k is None:
            args.pass_k, dropped = default_ks(args.n)
            if dropped:
                print(
                    f"copes-eval: pass@k for k = {', '.join(map(str, args.pass_k))}; "
                    f"{', '.join(map(str, dropped))} need more than n = {args.n} samples "
                    "(--pass-k chooses)",
                    file=sys.stderr,
                )
        check_ks(args.pass_k, args.n)
        check_count("math", args.demonstrations)  # both kinds have as many examples
        if not args.no_resume:
            read_eval_config(out)  # a foreign file there fails now, not after the model loads
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {out}: cannot create the folder ({exc.strerror})") from None
        check_envs(resolve_benchmarks(args.benchmarks), args)
        template_kwargs_for(args.enable_thinking, args.chat_template_kwargs)
        if not args.no_resume:  # samples of tasks that changed since: refused now too
            for folder in [out, baseline_out] if args.baseline else [out]:
                check_stored_samples(
                    folder, args.benchmarks, n=args.n, limit=args.limit,
                    data_dir=args.data_dir, regenerate_changed=args.regenerate_changed,
                    split=args.split,
                )  # fmt: skip
        from copes.reporting import parse_report_to

        parse_report_to(args.report_to)
        sampling = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        report = _evaluate_one(args.model, out, args, sampling)
        baseline = None
        if args.baseline:
            baseline = _evaluate_one(args.baseline, baseline_out, args, sampling)
            write_report(baseline, baseline_out)
    paths = write_report(report, out, baseline)
    report_results(report, out, args)
    print(format_table(report, baseline))
    print(f"\nwrote {paths['json']}, {paths['csv']} and {len(paths['plots'])} plot(s) in {out}")
    return 0


def report_results(report: Any, out: Path, args: argparse.Namespace) -> None:
    """Each benchmark's pass@k, mean@n and maj@n to the --report-to reporters (step 0)."""
    from copes.reporting import open_reporters, parse_report_to

    names = parse_report_to(args.report_to)
    if not names:
        return
    values: dict[str, float] = {}
    for name, result in report.benchmarks.items():
        values.update({f"{name}/pass@{k}": v for k, v in result.pass_at_k.items()})
        values[f"{name}/mean@{result.n}"] = result.mean_at_n
        values[f"{name}/maj@{result.n}"] = result.maj_at_n
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))}
    for reporter in open_reporters(names, out, project="copes-eval", config=config):
        reporter.log(values, 0)
        reporter.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `copes-eval`; returns the exit status (2 on a usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None and not args.rescore:
        parser.error("--model is required (or --rescore to re-grade the samples in --out)")
    if args.regenerate_changed and (args.rescore or args.no_resume):
        parser.error(
            "--regenerate-changed re-generates stored samples on resume; drop it with "
            + ("--rescore (which generates nothing)" if args.rescore else "--no-resume")
        )
    if args.quiet:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from copes.errors import run_command

    return run_command("copes-eval", lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
