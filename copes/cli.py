"""Command lines: `copes-train`.

Every field of `TrainConfig` and of the chosen optimizer's config (`CoPESConfig`,
`GRPOConfig`) is a flag (`--population-size 40`), made by transformers' `HfArgumentParser`
(the convention TRL's users know) with its default and one-line help; `--config FILE` (YAML or
TOML, same names) sets many at once and flags override it. Parsing returns the typed
settings: a `TrainConfig` and the optimizer's own config, nothing else travels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: where its help already says it, it is not added again."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _is_bool(annotation: Any) -> bool:
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


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


def _pre_parse(argv: Sequence[str] | None) -> tuple[str | None, dict[str, Any]]:
    """(`--config` file, its settings): read before the parser is made, since the optimizer
    it names decides which flags exist."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return known.config, read_config_file(known.config) if known.config else {}


def _optimizer_named(argv: Sequence[str] | None, settings: dict[str, Any]) -> str:
    """--optimizer from the command line, else the config file, else TrainConfig's default."""
    from copes.train import TrainConfig

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--optimizer")
    known, _ = pre.parse_known_args(argv)
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "optimizer")
    return str(known.optimizer or settings.get("optimizer") or default)


def train_parser(optimizer: str = "copes", prog: str = "copes-train") -> Any:
    """The `HfArgumentParser` of `copes-train --optimizer OPTIMIZER`: the run's flags and this
    optimizer's (its table defaults shown), plus --config, --dry-run, --verbose, --debug.

    transformers is imported for it (about 1.5 s, no torch); `--help` pays that once.
    """
    from transformers import HfArgumentParser

    from copes.optimizers.table import OPTIMIZERS, get_optimizer
    from copes.train import TrainConfig

    spec = get_optimizer(optimizer)
    others = ", ".join(f"--optimizer {name} --help" for name in OPTIMIZERS if name != optimizer)
    # The optimizer's `seed` is the run's: the run's --seed, added second, replaces it
    # (conflict_handler="resolve"), and both configs are built from the one value.
    parser = HfArgumentParser(
        (spec.config, TrainConfig), prog=prog, conflict_handler="resolve",
        formatter_class=_HelpFormatter,
        description="Post-train a tool-using agent with ES, CoPES, GRPO or LoRA-GRPO. The "
        f"optimizer flags below are --optimizer {optimizer}'s ({spec.summary}); see {others}.",
    )  # fmt: skip
    # HfArgumentParser gives a --no-X only to a flag that defaults to true; copes-train has
    # always taken --no-X for every switch (--no-lora, --no-enable-thinking).
    groups = {g.title: g for g in parser._action_groups}
    for config in (spec.config, TrainConfig):
        hints = typing.get_type_hints(config)
        switches = [f.name for f in dataclasses.fields(config)
                    if _is_bool(hints[f.name]) and f.default is not True]  # fmt: skip
        for name in switches:
            flag = name.replace("_", "-")
            groups[config._argument_group_name].add_argument(
                f"--no-{flag}", dest=name, action="store_false", default=argparse.SUPPRESS,
                help=f"--{flag} false",
            )  # fmt: skip
    parser.set_defaults(**spec.defaults, **spec.fixed)  # plain ES's N = 30, K = 1: shown
    parser.add_argument("--config", help="YAML or TOML file of settings (flags override it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and memory, exit")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error too"
    )
    return parser


def _file_value(name: str, annotation: Any, value: Any, source: str) -> Any:
    """A config file's value as its flag would parse it (a YAML string for an int flag is
    an error naming the setting, never a string that fails somewhere inside the run)."""
    flag = "--" + name.replace("_", "-")
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if value is None:
        return None
    if _is_bool(annotation):
        if not isinstance(value, bool):
            raise ValueError(f"{source}: {flag} must be true or false, got {value!r}")
        return value
    if typing.get_origin(annotation) is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{source}: {flag} must be a list, got {value!r}")
        return list(value)
    if typing.get_origin(annotation) is typing.Literal:
        if value not in args:
            raise ValueError(f"{source}: {flag} must be one of {args}, got {value!r}")
        return value
    kind = args[0] if args else annotation
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value  # as written: a float would round a large integer (a seed)
    if kind in (int, float):
        what = "an integer" if kind is int else "a number"
        try:
            if isinstance(value, bool):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {flag} must be {what}, got {value!r}") from None
        if kind is int:
            if not number.is_integer():
                raise ValueError(f"{source}: {flag} must be an integer, got {value!r}")
            return int(number)
        return number
    return value


def parse_train_args(
    argv: Sequence[str] | None, prog: str = "copes-train"
) -> tuple[Any, Any, argparse.Namespace]:
    """(`TrainConfig`, the optimizer's config, the command's own switches) of a command
    line; a flag of another optimizer is an error naming it."""
    from copes.optimizers.table import OPTIMIZERS, get_optimizer
    from copes.train import TrainConfig

    source, settings = _pre_parse(argv)
    spec = get_optimizer(_optimizer_named(argv, settings))
    parser = train_parser(spec.name, prog)
    hints = {**typing.get_type_hints(spec.config), **typing.get_type_hints(TrainConfig)}
    every = {name for s in OPTIMIZERS.values() for name in s.flags()}
    unknown = set(settings) - set(hints) - every
    if unknown:
        parser.error(f"unknown setting(s) in {source}: {', '.join(sorted(unknown))}")
    spec.refuse_unused(set(settings) - set(typing.get_type_hints(TrainConfig)))
    parser.set_defaults(
        **{k: _file_value(k, hints[k], v, str(source)) for k, v in settings.items()}
    )
    # Not `parse_args_into_dataclasses`: it hands each name to one dataclass only, and the
    # run and its optimizer share --seed.
    namespace, rest = parser.parse_known_args(argv)
    values = vars(namespace)
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
    theirs = {f"--{n.replace('_', '-')}": n for n in every} | {f"--{n}": n for n in every}
    spec.refuse_unused(theirs[f] for f in flags if f in theirs)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    config = TrainConfig(**{f.name: values.pop(f.name) for f in dataclasses.fields(TrainConfig)})
    optimizer = spec.config(
        **{
            f.name: config.seed if f.name == "seed" else values.pop(f.name)
            for f in dataclasses.fields(spec.config)
        }
    )
    spec.check(optimizer)
    return config, optimizer, argparse.Namespace(**values)


def vllm_slot_rank(rank: int) -> int | None:
    """The rank vLLM's LoRA slots get for rank-`rank` members; None where vllm is not
    installed (the plan then counts the members at rank r and says so in its key)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from copes.agents.vllm.policy import lora_slot_rank

    return lora_slot_rank(rank)


def dry_run(config: Any, optimizer: Any) -> dict[str, Any]:
    """The plan: settings, the model's shape, and the theoretical memory of each optimizer.

    Any decoder transformers builds as a causal LM: the shape comes from its config alone,
    the model built on the meta device (no weights read, nothing allocated).
    """
    from copes.agents.models import model_config
    from copes.memory import ModelShape, compare_optimizers
    from copes.train import public_settings

    if config.model == "tiny":  # its shape, without building it (a few minutes)
        from copes.agents.tiny_recipe import model_config as tiny_config

        path, config_ = "tiny (shape from TinyAgentConfig; not built)", tiny_config()
    else:  # a folder's, the hub's or a GGUF file's config: no weights read or converted
        path, config_ = model_config(config.model)
    shape = ModelShape.from_config(config_)
    seq_len = config.max_context or config.max_turns * config.max_new_tokens + 512
    estimates = compare_optimizers(shape, seq_len, generation_batch_size=config.batch_size)
    if config.population_eval == "batched":  # the run's own optimizer, N copies in one batch
        from copes.memory import estimate_memory
        from copes.train import lora_population

        lora_population(config, optimizer)  # refused as the run would refuse it
        size, rank = optimizer.population_size, optimizer.perturbation_rank
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
        "optimizer": dataclasses.asdict(optimizer),
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
    config, optimizer, args = parse_train_args(argv, prog)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.dry_run:
        dry_run(config, optimizer)
        return 0
    from copes.train import Trainer

    trainer = Trainer(config, optimizer)
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
