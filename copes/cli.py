"""Command lines: `copes-train`.

Every field of `TrainConfig` and of the optimizer configs (`CoPESConfig`, `GRPOConfig`) is a
flag (`--population-size 40`), with its default and one-line help; `--config FILE` (YAML or
TOML, same names) sets many at once and flags override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHARED_WITH_TRAIN = {"seed"}  # optimizer fields that take the run's value
# Other names of a flag: the run folder is --output-dir in copes-eval and in TRL too.
ALIASES = {"out_dir": ("--output-dir",)}


def _base_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    return annotation


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls: type, title: str, skip: set[str] = frozenset()
) -> list[str]:
    """One flag per field of `cls` (default None: the dataclass default applies)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip or any(a.dest == f.name for a in parser._actions):
            continue
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = f.metadata.get("help", "")
        # the flag's own default is None (the dataclass default applies): say the real one
        text = help_ if "default" in help_ else f"{help_} (default: {default})"
        choices = (
            typing.get_args(hints[f.name])
            if typing.get_origin(hints[f.name]) is typing.Literal
            else None
        )
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif typing.get_origin(kind) is tuple:
            group.add_argument(flag, dest=f.name, nargs="+", default=None, help=text)
        else:
            group.add_argument(
                flag, *ALIASES.get(f.name, ()), dest=f.name, type=kind, default=None,
                choices=choices, help=text,
            )  # fmt: skip
        names.append(f.name)
    return names


def _coerce(action: argparse.Action, value: Any, source: str) -> Any:
    """A config file's value as its flag would parse it (a YAML string for an int flag is
    an error naming the setting, never a string that fails somewhere inside the run)."""
    flag = "/".join(action.option_strings)
    if value is None:
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{source}: {flag} must be true or false, got {value!r}")
        return value
    if action.nargs == "+":
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{source}: {flag} must be a list, got {value!r}")
        return value
    kind = action.type
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{source}: {flag} must be {'an integer' if kind is int else 'a number'}, "
                f"got {value!r}"
            ) from None
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{source}: {flag} must be an integer, got {value!r}")
        value = int(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{source}: {flag} must be one of {list(action.choices)}, got {value!r}")
    return value


def read_config_file(path: str) -> dict[str, Any]:
    """Settings from a YAML or TOML file; keys may use - or _."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {path} does not exist (or is not a file)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text (a binary file?)") from None
    if file.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path} is not valid TOML ({exc})") from None
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {path} is not valid YAML ({exc})") from None
    else:
        raise ValueError(f"config file {path}: use .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of setting: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def train_parser(prog: str = "copes-train") -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    from copes.optimizers.table import OPTIMIZERS
    from copes.train import TrainConfig

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Post-train a tool-using agent with ES, CoPES, GRPO or LoRA-GRPO.",
    )
    parser.add_argument("--config", help="YAML or TOML file of settings (flags override it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and memory, exit")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error too"
    )
    train_names = add_dataclass_flags(parser, TrainConfig, "run")
    optimizer_names: list[str] = []
    groups: dict[type, list[str]] = {}  # one flag group per config, titled by its optimizers
    for spec in OPTIMIZERS.values():
        groups.setdefault(spec.config, []).append(spec.name)
    for config, names in groups.items():
        title = " / ".join(names) + " (only with --optimizer " + " or ".join(names) + ")"
        optimizer_names += add_dataclass_flags(parser, config, title, SHARED_WITH_TRAIN)
    return parser, train_names, optimizer_names


def parse_train_args(
    argv: Sequence[str] | None, prog: str = "copes-train"
) -> tuple[Any, dict[str, Any], argparse.Namespace]:
    from copes.train import TrainConfig

    parser, train_names, optimizer_names = train_parser(prog)
    args = parser.parse_args(argv)
    settings = read_config_file(args.config) if args.config else {}
    unknown = set(settings) - set(train_names) - set(optimizer_names)
    if unknown:
        parser.error(f"unknown setting(s) in {args.config}: {', '.join(sorted(unknown))}")
    actions = {a.dest: a for a in parser._actions}
    settings = {k: _coerce(actions[k], v, args.config) for k, v in settings.items()}
    for name in train_names + optimizer_names:
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    train = {k: v for k, v in settings.items() if k in train_names}
    optimizer = {k: v for k, v in settings.items() if k in optimizer_names and k not in train_names}
    for name in ("learning_rate",):  # shared names land with the optimizer
        if name in settings:
            optimizer[name] = settings[name]
    config = TrainConfig(**train)
    from copes.train import optimizer_config

    optimizer_config(config, optimizer)  # a flag this optimizer does not use fails now
    return config, optimizer, args


def vllm_slot_rank(rank: int) -> int | None:
    """The rank vLLM's LoRA slots get for rank-`rank` members; None where vllm is not
    installed (the plan then counts the members at rank r and says so in its key)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from copes.agents.vllm.policy import lora_slot_rank

    return lora_slot_rank(rank)


def dry_run(config: Any, optimizer_overrides: dict[str, Any]) -> dict[str, Any]:
    """The plan: settings, the model's shape, and the theoretical memory of each optimizer.

    Any decoder transformers builds as a causal LM: the shape comes from its config alone,
    the model built on the meta device (no weights read, nothing allocated).
    """
    from copes.agents.models import model_config
    from copes.memory import ModelShape, compare_optimizers
    from copes.train import public_settings

    if config.model == "tiny":  # its shape, without building it (a few minutes)
        from copes.agents.tiny import model_config as tiny_config

        path, config_ = "tiny (shape from TinyAgentConfig; not built)", tiny_config()
    else:  # a folder's, the hub's or a GGUF file's config: no weights read or converted
        path, config_ = model_config(config.model)
    shape = ModelShape.from_config(config_)
    seq_len = config.max_context or config.max_turns * config.max_new_tokens + 512
    estimates = compare_optimizers(shape, seq_len, generation_batch_size=config.batch_size)
    if config.population_eval == "batched":  # the run's own optimizer, N copies in one batch
        from copes.memory import estimate_memory
        from copes.train import lora_population, optimizer_config

        lora_population(config, optimizer_overrides)  # refused as the run would refuse it

        opt_config = optimizer_config(config, optimizer_overrides)
        size, rank = opt_config.population_size, opt_config.perturbation_rank
        noise = f", --noise lowrank r={rank}" if rank else ""
        slot_rank = rank
        if config.backend == "vllm":  # vLLM's LoRA slots have its padded rank
            slot_rank = vllm_slot_rank(rank)
            noise += (
                f", vLLM LoRA slots of rank {slot_rank}"
                if slot_rank
                else ", vLLM's padded slot rank unknown: vllm is not installed"
            )
        estimates[f"{config.optimizer} (--population-eval batched{noise}, N={size})"] = (
            estimate_memory(
                config.optimizer, shape, seq_len=seq_len, batch_size=size * config.batch_size,
                population_copies=size, population_rank=slot_rank or rank,
            )
        )  # fmt: skip
    memory = {
        name: {"total_gib": round(e.total / 2**30, 3), **e.as_dict()}
        for name, e in estimates.items()
    }
    plan = {
        "train": public_settings(config),
        "optimizer_overrides": optimizer_overrides,
        # counted on the meta device; layer types, window, linear state, experts (if any)
        "model": {
            "path": path,
            "parameters": shape.num_parameters,
            "layers": shape.num_layers,
            **shape.describe(),
        },
        "sequence_length_assumed": seq_len,
        "memory_bytes": memory,
    }
    print(json.dumps(plan, indent=2, default=str))
    return plan


def train_main(argv: Sequence[str] | None = None, prog: str = "copes-train") -> int:
    """Entry point of `copes-train` (and `copes-serve`, which is copes-train with
    ``--harness http`` by default); returns the exit status (2 on a user error)."""
    from copes.errors import run_command

    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    return run_command(prog, lambda: _train(argv, prog), debug)


def _train(argv: Sequence[str] | None, prog: str = "copes-train") -> int:
    config, optimizer_overrides, args = parse_train_args(argv, prog)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.dry_run:
        dry_run(config, optimizer_overrides)
        return 0
    from copes.train import Trainer

    trainer = Trainer(config, optimizer_overrides)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    print(json.dumps(summary, indent=2))
    return 0


def main_train() -> None:
    sys.exit(train_main())


if __name__ == "__main__":
    main_train()
