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
                flag, dest=f.name, type=kind, default=None, choices=choices, help=text
            )
        names.append(f.name)
    return names


def read_config_file(path: str) -> dict[str, Any]:
    """Settings from a YAML or TOML file; keys may use - or _."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = file.read_text()
    if file.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        data = tomllib.loads(text)
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {path}: use .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of setting: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def train_parser() -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    from copes.optimizers.es import CoPESConfig
    from copes.train import TrainConfig

    parser = argparse.ArgumentParser(
        prog="copes-train",
        description="Post-train a tool-using agent with ES, CoPES, GRPO or LoRA-GRPO.",
    )
    parser.add_argument("--config", help="YAML or TOML file of settings (flags override it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and memory, exit")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    train_names = add_dataclass_flags(parser, TrainConfig, "run")
    optimizer_names = add_dataclass_flags(parser, CoPESConfig, "ES / CoPES", SHARED_WITH_TRAIN)
    try:
        from copes.optimizers.grpo import GRPOConfig

        optimizer_names += add_dataclass_flags(
            parser, GRPOConfig, "GRPO / LoRA-GRPO", SHARED_WITH_TRAIN
        )
    except ImportError:  # pragma: no cover - grpo needs nothing beyond torch
        pass
    return parser, train_names, optimizer_names


def parse_train_args(argv: Sequence[str] | None) -> tuple[Any, dict[str, Any], argparse.Namespace]:
    from copes.train import TrainConfig

    parser, train_names, optimizer_names = train_parser()
    args = parser.parse_args(argv)
    settings = read_config_file(args.config) if args.config else {}
    unknown = set(settings) - set(train_names) - set(optimizer_names)
    if unknown:
        parser.error(f"unknown setting(s) in {args.config}: {', '.join(sorted(unknown))}")
    for name in train_names + optimizer_names:
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    train = {k: v for k, v in settings.items() if k in train_names}
    optimizer = {k: v for k, v in settings.items() if k in optimizer_names and k not in train_names}
    for name in ("learning_rate",):  # shared names land with the optimizer
        if name in settings:
            optimizer[name] = settings[name]
    try:
        config = TrainConfig(**train)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return config, optimizer, args


def dry_run(config: Any, optimizer_overrides: dict[str, Any]) -> dict[str, Any]:
    """The plan: settings, the model's shape, and the theoretical memory of each optimizer."""
    from transformers import AutoConfig

    from copes.agents.hf import resolve_model_path
    from copes.optimizers.memory import ModelShape, compare_optimizers

    path = resolve_model_path(config.model)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(path))
    seq_len = config.max_context or config.max_turns * config.max_new_tokens + 512
    estimates = compare_optimizers(shape, seq_len, generation_batch_size=config.batch_size)
    memory = {
        name: {"total_gib": round(e.total / 2**30, 3), **e.as_dict()}
        for name, e in estimates.items()
    }
    plan = {
        "train": dataclasses.asdict(config),
        "optimizer_overrides": optimizer_overrides,
        "model": {"path": path, "parameters": shape.num_parameters, "layers": shape.num_layers},
        "sequence_length_assumed": seq_len,
        "memory_bytes": memory,
    }
    print(json.dumps(plan, indent=2, default=str))
    return plan


def train_main(argv: Sequence[str] | None = None) -> int:
    config, optimizer_overrides, args = parse_train_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.dry_run:
        dry_run(config, optimizer_overrides)
        return 0
    from copes.train import Trainer

    try:
        trainer = Trainer(config, optimizer_overrides)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"copes-train: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = trainer.run()
    except (FileExistsError, ImportError, ValueError) as exc:  # ImportError: --workers, no Ray
        print(f"copes-train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    print(json.dumps(summary, indent=2))
    return 0


def main_train() -> None:
    sys.exit(train_main())


if __name__ == "__main__":
    main_train()
