"""The append-only JSONL logs: torn tails are dropped, damage elsewhere is an error."""

import pytest

from copes.run_log import append_jsonl, drop_torn_tail, read_jsonl


def test_torn_last_line_is_ignored_then_dropped(tmp_path):
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"step": 0}, sync=True)
    append_jsonl(path, {"step": 1})
    with open(path, "a") as handle:
        handle.write('{"step": 2, "rew')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    drop_torn_tail(path)
    append_jsonl(path, {"step": 2})
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_damage_before_the_last_line_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path, hint="fix it")
    assert read_jsonl(tmp_path / "missing.jsonl") == []
