"""`copes-train` command lines: help states each default once; the README job parses."""

import re


def test_help_states_each_default_once():
    from copes.cli import train_parser

    parser = train_parser()
    text = " ".join(parser.format_help().split())
    assert "(default: None) (default:" not in text
    assert "--sigma SIGMA sigma: full-space noise scale (Qiu et al.: 1e-3) (default: 0.001)" in text
    for action in parser._actions:
        if action.help and action.option_strings and action.dest not in ("help",):
            assert len(re.findall(r"\(default", action.help)) <= 1, action.dest


def test_readme_main_job_parses_into_the_settings_it_promises():
    import shlex
    from pathlib import Path

    from copes.cli import parse_train_args

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "&& copes-train " in x)
    argv = shlex.split(line.split("&& copes-train ", 1)[1])
    config, optimizer, _ = parse_train_args(argv)
    assert (config.optimizer, config.env, config.model) == ("copes", "ToolMath-v0", "tiny")
    assert config.invalid_penalty > 0 and config.steps <= 30  # the shaping that moves it
    assert optimizer.num_subspaces >= 2 and optimizer.antithetic is True


def test_every_flag_of_both_commands_has_help():
    from copes.cli import train_parser
    from copes.evaluation.cli import build_parser

    for parser in (train_parser(), train_parser("grpo"), build_parser()):
        missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert not missing, (parser.prog, missing)


def test_dry_run_on_tiny_builds_nothing_and_gives_the_built_agents_shape(
    tmp_path, monkeypatch, capsys, tiny_agent_dir
):
    import json

    from copes.cli import train_main

    monkeypatch.setenv("COPES_CACHE", str(tmp_path / "cache"))
    assert train_main(["--dry-run", "--model", "tiny"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "cache").exists()  # no agent built
    built = json.loads((tiny_agent_dir / "copes_tiny.json").read_text())
    assert plan["model"]["parameters"] == built["parameters"]


def test_both_commands_take_output_dir():
    from copes.cli import parse_train_args
    from copes.evaluation.cli import build_parser

    config, _, _ = parse_train_args(["--output-dir", "runs/x"])
    assert config.out_dir == "runs/x"
    assert build_parser().parse_args(["--output-dir", "e", "--model", "m"]).out == "e"
    assert build_parser().parse_args(["--out", "e", "--model", "m"]).out == "e"


def test_help_imports_no_torch_and_flags_belong_to_their_optimizer(capsys):
    import subprocess
    import sys

    from copes.cli import train_main

    probe = "import sys, copes.cli; copes.cli.train_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr  # --help builds the parser: no torch
    assert train_main(["--optimizer", "grpo", "--population-size", "40"]) == 2
    err = capsys.readouterr().err
    assert "--population-size: not a setting of --optimizer grpo" in err
    assert train_main(["--optimizer", "copes", "--group-size", "4", "--kl-beta", "0.1"]) == 2
    assert "--group-size, --kl-beta: not a setting of --optimizer copes" in capsys.readouterr().err
    assert train_main(["--optimizer", "lora-grpo", "--no-lora"]) == 2
    assert "always has lora = True" in capsys.readouterr().err


def test_parsing_gives_the_typed_settings_the_trainer_takes(tmp_path):
    from copes.cli import parse_train_args
    from copes.optimizers.configs import CoPESConfig, GRPOConfig

    config, es, _ = parse_train_args(["--optimizer", "es", "--seed", "7"])
    assert isinstance(es, CoPESConfig) and (es.population_size, es.num_subspaces) == (30, 1)
    assert es.seed == config.seed == 7  # one seed: the run's
    _, lora, _ = parse_train_args(["--optimizer", "lora-grpo", "--adam-betas", "0.8", "0.99"])
    assert isinstance(lora, GRPOConfig) and lora.lora and lora.adam_betas == [0.8, 0.99]
    assert lora.samples_per_task == lora.group_size
    file = tmp_path / "run.yaml"
    file.write_text(
        "optimizer: copes\npopulation-size: '12'\nantithetic: true\nsteps: 3\n"
        "seed: 12345678901234567\n"
    )
    config, copes, _ = parse_train_args(["--config", str(file), "--no-antithetic", "--sigma=0.5"])
    assert (config.optimizer, config.steps) == ("copes", 3)
    assert config.seed == copes.seed == 12345678901234567  # not rounded through a float
    assert (copes.population_size, copes.antithetic, copes.sigma) == (12, False, 0.5)
    assert copes.samples_per_task == 1 and config.rollout_temperature == config.es_temperature


def test_a_config_file_value_of_the_wrong_type_names_its_setting(tmp_path, capsys):
    from copes.cli import train_main

    file = tmp_path / "run.yaml"
    file.write_text("population_size: 4.5\n")
    assert train_main(["--config", str(file), "--dry-run"]) == 2
    assert "--population-size must be an integer, got 4.5" in capsys.readouterr().err
    file.write_text("optimizer: grpo\nsigma: 0.1\n")
    assert train_main(["--config", str(file), "--dry-run"]) == 2
    assert "--sigma: not a setting of --optimizer grpo" in capsys.readouterr().err


def test_the_trainer_refuses_another_optimizers_config_or_another_seed(tmp_path):
    import pytest

    from copes.optimizers.configs import GRPOConfig
    from copes.train import TrainConfig, Trainer, optimizer_config

    config = TrainConfig(optimizer="copes", out_dir=str(tmp_path / "r"), steps=1)
    with pytest.raises(ValueError, match="takes a CoPESConfig, got GRPOConfig"):
        Trainer(config, GRPOConfig())
    other = TrainConfig(optimizer="copes", out_dir=str(tmp_path / "r"), steps=1, seed=3)
    with pytest.raises(ValueError, match=r"optimizer's seed \(0\) is not the run's \(3\)"):
        Trainer(other, optimizer_config(config))
    assert not (tmp_path / "r").exists()  # refused before the run folder is made
