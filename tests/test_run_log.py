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


def test_a_rebuilt_train_record_has_the_optimizers_reward_numbers_bit_for_bit_and_nothing_else():
    """What es_log.jsonl holds (member rewards, token and second totals) gives the train
    record's reward mean/std/max exactly as CoPES computed them; what it does not hold
    (accuracy, timings, sigma) is left out, and the record says it was rebuilt."""
    import json

    from copes.optimizers.base import MemberResult
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES
    from copes.run_log import rebuild_train_record

    optimizer = CoPES(CoPESConfig(population_size=6, num_subspaces=2))
    rewards = [0.1, 1 / 3, 0.7, 0.0, 2 / 7, 0.9]
    results = [MemberResult(m, r, accuracy=0.5) for m, r in enumerate(rewards)]
    stats = optimizer.step_stats(4, optimizer.ask(4), results, update_seconds=0.01)
    entry = json.loads(json.dumps({**stats.log, "tokens": 900, "seconds": 12.5}))  # on disk
    previous = {"step": 3, "rewards": [0.0] * 6, "tokens": 700, "seconds": 10.0}

    record = rebuild_train_record(entry, previous)
    for key in ("reward_mean", "reward_std", "reward_max"):
        assert record[key] == stats.metrics[key]  # ==, not approx
    assert record["generated_tokens"] == 200 and record["generated_tokens_total"] == 900
    assert record["seconds_total"] == 12.5 and record["rebuilt_from"] == "es_log.jsonl"
    assert record["kind"] == "train" and record["step"] == 4
    assert not {"accuracy", "sigma", "generation_seconds", "reward_subspace_0"} & set(record)
    # Without the previous step's entry the step's own token count is unknown: left out.
    assert "generated_tokens" not in rebuild_train_record(entry, None)
    assert rebuild_train_record({**entry, "step": 0}, None)["generated_tokens"] == 900


def test_resume_keeps_the_validation_of_the_resume_step_and_puts_rebuilt_records_in_order(
    tmp_path,
):
    """Resumed at step 2: train records of steps 0-1 and validations of steps 0-2 stay (the
    validation of step 2 was measured with the weights the run resumes with); later ones go;
    a rebuilt train record of step 1 lands where the loop wrote it."""
    from copes.run_log import MetricsLog

    log = MetricsLog(tmp_path, report_to=())
    for kind, step in [("validation", 0), ("train", 0), ("validation", 1), ("validation", 2),
                       ("train", 2), ("validation", 3)]:  # fmt: skip
        log.log(kind, step, {"reward_mean": 0.5})
    rebuilt = {"kind": "train", "step": 1, "reward_mean": 0.25, "rebuilt_from": "es_log.jsonl"}
    log.resume_at(2, [rebuilt])
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records] == [
        ("validation", 0), ("train", 0), ("validation", 1), ("train", 1), ("validation", 2),
    ]  # fmt: skip
    assert records[3] == rebuilt
    assert log.has("validation", 2) and not log.has("train", 2)
