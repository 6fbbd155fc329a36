"""Every user error of copes-train and copes-eval is one line naming what was wrong and how
to fix it, exit code 2, no traceback; `--debug` shows the traceback."""

import pytest

from copes.cli import train_main
from copes.evaluation.cli import main as eval_main


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    (tmp_path / "bad.toml").write_text("steps = \n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "abc.yaml").write_text("population-size: abc\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty_model").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text("[1, 2]")
    (tmp_path / "garbage_run").mkdir()
    (tmp_path / "garbage_run" / "config.json").write_text("{oops")
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_bytes(b'{"question": "\xff\xfe", "answer": "#### 1"}\n')
    return tmp_path


def check(code: int, capsys, expected: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert expected in err, err


TRAIN_CASES = [
    (["--config", "{d}/bad.yaml"], "is not valid YAML"),
    (["--config", "{d}/bad.toml"], "is not valid TOML"),
    (["--config", "{d}/missing.yaml"], "does not exist"),
    (["--config", "{d}/list.yaml"], "must hold a mapping"),
    (["--config", "{d}/binary.yaml"], "is not UTF-8 text"),
    (["--config", "{d}/abc.yaml"], "--population-size must be an integer, got 'abc'"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--out-dir", "{d}/a_file/run"], "cannot create the run folder"),
    (["--out-dir", "/proc/copes-run"], "cannot create the run folder"),
    (["--resume", "--out-dir", "{d}/foreign"], "is not a copes run config"),
    (["--resume", "--out-dir", "{d}/garbage_run"], "is not a copes run config"),
    (["--model", "{d}/empty_model"], "has no config.json"),
    (["--benchmark", "gsm8k", "--data-dir", "{d}/data"], "is not UTF-8 text"),
    (["--keep-checkpoints", "-1"], "keep_checkpoints must be >= 1"),
]


@pytest.mark.parametrize(("flags", "expected"), TRAIN_CASES)
def test_copes_train_user_errors(family_dir, files, tmp_path, capsys, flags, expected):
    base = ["--model", str(family_dir("qwen2")), "--out-dir", str(tmp_path / "run"),
            "--steps", "1", "--no-progress", "--no-tensorboard"]  # fmt: skip
    check(train_main([*base, *(f.format(d=files) for f in flags)]), capsys, expected)


EVAL_CASES = [
    (["--out", "{d}/a_file"], "is a file"),
    (["--out", "{d}/a_file/eval"], "cannot create the folder"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--limit", "-1"], "--limit must be >= 1"),
    (["--out", "{d}/foreign"], None),  # an eval_config.json there that is not one: below
    (["--model", "{d}/empty_model"], "has no config.json"),
    (["--benchmarks", "gsm8k", "--data-dir", "{d}/data"], "is not UTF-8 text"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
]


@pytest.mark.parametrize(("flags", "expected"), EVAL_CASES)
def test_copes_eval_user_errors(family_dir, files, tmp_path, capsys, flags, expected):
    if expected is None:
        (files / "foreign" / "eval_config.json").write_text("[1, 2]")
        expected = "is not an evaluation config"
    base = ["--model", str(family_dir("qwen2")), "--out", str(tmp_path / "eval"),
            "--benchmarks", "synthetic-math", "--limit", "1", "-n", "1", "--pass-k", "1",
            "--quiet"]  # fmt: skip
    check(eval_main([*base, *(f.format(d=files) for f in flags)]), capsys, expected)


def test_debug_shows_the_traceback(files):
    with pytest.raises(ValueError, match="is not valid YAML"):
        train_main(["--config", str(files / "bad.yaml"), "--debug"])


def test_an_internal_error_keeps_its_traceback(monkeypatch, family_dir, tmp_path):
    import copes.train.loop

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(copes.train.loop, "build_policy", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        train_main(["--model", str(family_dir("qwen2")), "--out-dir", str(tmp_path / "r")])
