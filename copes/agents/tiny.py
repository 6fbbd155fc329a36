"""The embedded default agent: a 0.56M-parameter Qwen2 model built offline.

No weights can be downloaded on many machines, yet a new user should see the whole system
work in minutes on a CPU. So copes builds its own small tool-using agent, deterministically:

its recipe (`copes.agents.tiny_recipe`: a scripted expert's transcripts, a BPE tokenizer, a
Qwen2-architecture model taught to copy, then fine-tuned briefly on the expert's turns) is run
here into a normal Hugging Face folder, loadable by transformers and vLLM; this module is its
build, its cache and its command line.

The agent ships with the package (`copes/agents/tiny_agent/`, 2.3 MB), made by this recipe
once and pinned by digests: float32 training runs on each CPU's own kernels (MKL and ATen
pick AVX2 or AVX-512 code, Intel and AMD differ), so the same recipe builds another agent on
another machine (measured, seed 0: greedy math/QA 0.30/0.30 on an Intel Xeon, 0.11/0.23 on
an AVX2 AMD EPYC, 0.28/0.00 on an AVX-512 one). `ensure_tiny_agent()` returns the shipped
folder after checking its digest; a rebuild (`python -m copes.agents.tiny --rebuild`, or any
non-default config) goes to the cache folder and says whether it reproduced the shipped
weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from copes.agents.model_files import default_cache_dir, weights_digest
from copes.agents.models import SHIPPED_WEIGHTS_SHA256, shipped_tiny_agent
from copes.agents.tiny_recipe import (
    TinyAgentConfig,
    TrainPhase,
    build_model,
    collect_transcripts,
    copy_drills,
    encode_transcript,
    induction_drills,
    supervised_finetune,
    train_tokenizer,
    validation_accuracy,
)

logger = logging.getLogger(__name__)


def machine_info() -> dict[str, str]:
    """What the float32 arithmetic of a build or run depends on: torch, CPU, kernel set."""
    import platform

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# ---------------------------------------------------------------------- build
def build_tiny_agent(
    out_dir: str | Path, config: TinyAgentConfig | None = None, progress: bool = True
) -> dict[str, Any]:
    """Build the agent into `out_dir` (replaced atomically); return the build report.

    Runs on one CPU thread whatever the machine: the short SFT is chaotic in floating-point
    rounding, and another thread count gives another agent (measured: greedy math/QA 0.30 /
    0.30 on one thread, 0.06 / 0.00 on two, same recipe). One thread makes the build
    repeatable on one machine; another CPU's kernels still give another agent, which is why
    the default one ships (`shipped_tiny_agent`).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_tiny_agent(out_dir, config, progress)
    finally:
        torch.set_num_threads(threads)


def _build_tiny_agent(
    out_dir: str | Path, config: TinyAgentConfig | None, progress: bool
) -> dict[str, Any]:
    from copes.agents.chat import ChatFormat
    from copes.agents.hf.policy import HFPolicy
    from copes.envs.tasks.synthetic import synthetic_corpus_text

    config = config or TinyAgentConfig()
    out_dir = Path(out_dir)
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    conversations = collect_transcripts(config, progress)
    rendered = ["\n".join(m["content"] for m in c) for c in conversations]
    corpus = [*rendered, *synthetic_corpus_text(2000, seed=config.seed)]
    tokenizer = train_tokenizer(corpus, config.vocab_size)
    chat = ChatFormat(tokenizer)
    examples = [encode_transcript(chat, c) for c in conversations]
    examples += copy_drills(tokenizer, config.copy_drills, config.seed)
    model = build_model(tokenizer, config)
    copy_losses: list[float] = []
    if config.copy_pretrain_steps:
        n = config.copy_pretrain_steps * config.copy_batch_size
        copying = TrainPhase(
            "copy drills", config.copy_pretrain_steps, config.copy_batch_size,
            config.copy_learning_rate, warmup_steps=50, context_loss_weight=0.0, decay=False,
        )  # fmt: skip
        copy_losses = supervised_finetune(
            model, induction_drills(tokenizer, n, config.seed), copying,
            tokenizer.pad_token_id, config.seed, config.max_context, progress,
        )  # fmt: skip
    sft = TrainPhase(
        "warm-start SFT", config.sft_steps, config.batch_size, config.learning_rate,
        config.warmup_steps, config.context_loss_weight,
    )  # fmt: skip
    losses = supervised_finetune(
        model, examples, sft, tokenizer.pad_token_id, config.seed, config.max_context, progress
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # Validate what users will load (AutoTokenizer + the saved weights), not the objects
        # in memory: a tokenizer that loads differently must show up here as lost accuracy.
        policy = HFPolicy.from_pretrained(staging, device="cpu")
        accuracy = {
            "math": validation_accuracy(policy, "math", seed=config.seed),
            "qa": validation_accuracy(policy, "qa", seed=config.seed),
        }
        report = {
            "config": asdict(config),
            "fingerprint": config.fingerprint(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "transcripts": len(conversations),
            "sft_final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "copy_final_loss": sum(copy_losses[-20:]) / max(1, len(copy_losses[-20:])),
            "validation_accuracy_greedy_64": accuracy,
            "build_seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__,
            "built_on": machine_info(),
            "weights_sha256": weights_digest(staging),
        }
        (staging / "copes_tiny.json").write_text(json.dumps(report, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("tiny agent built in %.0f s: %s", report["build_seconds"], accuracy)
    return report


def ensure_tiny_agent(
    cache_dir: str | Path | None = None,
    config: TinyAgentConfig | None = None,
    rebuild: bool = False,
    progress: bool = True,
) -> Path:
    """The tiny agent's folder: the shipped one for the default recipe, else a build.

    With a non-default `config`, or `rebuild`, the agent is built into `cache_dir` (default
    `$COPES_CACHE` or `~/.cache/copes`) once and reused; a rebuild of the default recipe
    logs whether its weights equal the shipped ones (on another CPU they usually do not).
    """
    import fcntl

    config = config or TinyAgentConfig()
    if config == TinyAgentConfig() and not rebuild:
        return shipped_tiny_agent()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-agent-{config.fingerprint()}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tiny-agent.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild or not (target / "copes_tiny.json").exists():
            logger.info("building the tiny agent into %s (a few minutes)", target)
            build_tiny_agent(target, config, progress)
    if config == TinyAgentConfig():
        same = weights_digest(target) == SHIPPED_WEIGHTS_SHA256
        logger.info(
            "the rebuilt agent %s the shipped one%s",
            "equals" if same else "differs from",
            ""
            if same
            else " (float32 training differs between CPU kernels); `--model tiny` "
            f"still means the shipped agent, pass --model {target} to use this build",
        )
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Locate the shipped tiny agent, or build it again with its recipe."
    )
    parser.add_argument(
        "--cache-dir", default=None, help="where --rebuild writes (default: $COPES_CACHE or "
        "~/.cache/copes)"
    )  # fmt: skip
    parser.add_argument(
        "--rebuild", action="store_true",
        help="build the agent on this machine (minutes) and compare it with the shipped one",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.cache_dir is not None and not args.rebuild:
        parser.error("--cache-dir is where --rebuild writes; the shipped agent needs no cache")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_tiny_agent(args.cache_dir, rebuild=args.rebuild)
    report = json.loads((path / "copes_tiny.json").read_text())
    print(path)
    keys = ("parameters", "validation_accuracy_greedy_64", "build_seconds", "built_on")
    summary = {k: report[k] for k in keys if k in report}
    if args.rebuild:
        summary["equals_shipped_weights"] = weights_digest(path) == SHIPPED_WEIGHTS_SHA256
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
