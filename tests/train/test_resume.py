"""A run folder is written only once the run is accepted, and --resume refuses any setting
that changes what is trained or generated, naming each difference (one line, exit 2)."""

import json

import pytest

from copes.cli import train_main


@pytest.fixture
def base_argv(family_dir, family_data_dir, tmp_path):
    data = family_data_dir
    return [
        "--model", str(family_dir("qwen2")), "--call-format", "native", "--optimizer", "copes",
        "--benchmark", "gsm8k", "--data-dir", str(data), "--train-split", "test",
        "--eval-split", "test", "--num-train-tasks", "1", "--eval-tasks", "1",
        "--batch-size", "1", "--population-size", "2", "--num-subspaces", "2",
        "--max-turns", "3", "--max-new-tokens", "64", "--device", "cpu", "--no-tensorboard",
        "--no-progress", "--out-dir", str(tmp_path / "run"), "--steps", "1",
    ]  # fmt: skip


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_refused_run_leaves_the_folder_as_it_was(base_argv, tmp_path, capsys):
    assert train_main(base_argv) == 0
    config = (tmp_path / "run" / "config.json").read_bytes()
    capsys.readouterr()
    assert train_main([*base_argv, "--sigma", "0.3"]) == 2
    assert "already holds a run" in one_line_error(capsys)
    assert (tmp_path / "run" / "config.json").read_bytes() == config
    for changed, named in (
        (["--sigma", "0.3"], "sigma: 0.001 -> 0.3"),
        (["--max-new-tokens", "4"], "max_new_tokens: 64 -> 4"),
        (["--call-format", "tags"], "call_format: 'native' -> 'tags'"),
    ):
        assert train_main([*base_argv, "--resume", *changed]) == 2
        assert named in one_line_error(capsys)
        assert (tmp_path / "run" / "config.json").read_bytes() == config
    assert train_main([*base_argv, "--resume", "--steps", "2", "--checkpoint-every", "1"]) == 0
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records if '"train"' in r] == [0, 1]


@pytest.mark.parametrize("keep", ["0", "-1"])
def test_keep_checkpoints_below_one_is_a_user_error(base_argv, tmp_path, capsys, keep):
    assert train_main([*base_argv, "--keep-checkpoints", keep]) == 2
    assert "keep_checkpoints must be >= 1" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()
