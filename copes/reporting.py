"""Where metrics go besides metrics.jsonl: ``--report-to tensorboard,wandb,trackio`` (or none).

The same names as transformers' / TRL's `report_to`. Each reporter gets every record
(``train/reward_mean`` at its step, ``validation/accuracy``, an evaluation's
``gsm8k/pass@1``). A reporter whose library is missing is an error when the run is set up,
never a silent drop; wandb and trackio runs are named after the run folder and resumed with
it (the wandb run id is kept in ``<run>/wandb_run_id``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

REPORTERS = ("tensorboard", "wandb", "trackio")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


class Reporter(Protocol):
    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def parse_report_to(text: str | None) -> list[str]:
    """``"tensorboard,wandb"`` -> the names, each checked and importable; "none" -> []."""
    if text is None:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:
        raise ValueError(
            f"--report-to {','.join(unknown)}: unknown; choose from {', '.join(REPORTERS)} or none"
        )
    import importlib.util

    for name in names:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ValueError(
                f"--report-to {name} needs the {_PACKAGES[name]} package: pip install "
                f"{_PACKAGES[name]} (or drop {name} from --report-to)"
            )
    return list(dict.fromkeys(names))


class TensorBoardReporter:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbReporter:
    """One wandb run per run folder; offline works with ``WANDB_MODE=offline``."""

    def __init__(self, run_dir: Path, project: str, config: Mapping[str, Any]) -> None:
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        self._run = wandb.init(
            project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
            config=dict(config),
        )  # fmt: skip
        id_file.write_text(run_id + "\n")

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioReporter:
    """A trackio run (local by default: ``TRACKIO_DIR``), resumed under the same name."""

    def __init__(self, run_dir: Path, project: str, config: Mapping[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        self._run = trackio.init(
            project=project, name=run_dir.name, config=dict(config), resume="allow"
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def open_reporters(
    names: list[str], run_dir: Path, *, project: str, config: Mapping[str, Any]
) -> list[Reporter]:
    """The reporters `names` asks for, writing into or named after `run_dir`."""
    reporters: list[Reporter] = []
    for name in names:
        if name == "tensorboard":
            reporters.append(TensorBoardReporter(run_dir / "tensorboard"))
        elif name == "wandb":
            reporters.append(WandbReporter(run_dir, project, config))
        else:
            reporters.append(TrackioReporter(run_dir, project, config))
    return reporters


def scalars(prefix: str, values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of `values` as ``prefix/key`` (booleans and text dropped)."""
    return {
        f"{prefix}/{key}": float(value)
        for key, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
