"""Benchmark loaders on fixture files in the real public schemas (values invented)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from copes.envs.tasks.builtin import BENCHMARKS, load_benchmark
from copes.envs.tasks.io import SchemaError, load_records
from copes.envs.tasks.math_benchmarks import (
    load_aime24,
    load_aime25,
    load_gsm8k,
    load_math,
    load_math500,
)
from copes.envs.tasks.qa_benchmarks import load_2wiki, load_flashrag, load_hotpotqa, load_musique

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


def fixture(name: str) -> Path:
    return FIXTURES / name


# ---------------------------------------------------------------- io


def test_load_records_reads_jsonl_json_and_data_wrapper(tmp_path):
    assert len(load_records(fixture("gsm8k.jsonl"), split="test")) == 4
    assert len(load_records(fixture("2wiki_dev.json"), split="dev")) == 3
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"question": "q", "answer": "#### 1"}]}))
    assert load_records(wrapped, split="test") == [{"question": "q", "answer": "#### 1"}]
    assert len(load_records(str(fixture("gsm8k.jsonl")), split="test", limit=2)) == 2


def test_load_records_reads_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = load_records(fixture("gsm8k.jsonl"), split="test")
    path = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    assert load_records(path, split="test") == records
    tasks = load_gsm8k(path)
    assert [t.answers for t in tasks] == [("14",), ("8750",), ("30",), ("2350",)]


def test_directory_picks_the_file_of_the_split(tmp_path):
    shutil.copy(fixture("gsm8k.jsonl"), tmp_path / "test.jsonl")
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 5"}\n')
    assert len(load_records(tmp_path, split="test")) == 4
    assert len(load_records(tmp_path, split="train")) == 1
    # "dev" files serve the "validation" split
    shutil.copy(fixture("musique_ans_v1.0_dev.jsonl"), tmp_path / "musique_dev.jsonl")
    assert len(load_records(tmp_path, split="validation")) == 4
    with pytest.raises(FileNotFoundError, match=r"no file for split 'other'.*test\.jsonl"):
        load_records(tmp_path, split="other")
    (tmp_path / "test.parquet").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"2 files .* match split 'test'.*test\.jsonl, test\.parquet"
    ):
        load_records(tmp_path, split="test")


def test_malformed_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "#### 1"}\n\n{"question": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 3 is not valid JSON"):
        load_records(bad, split="test")
    not_objects = tmp_path / "rows.jsonl"
    not_objects.write_text('{"question": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl': record 1 is a list"):
        load_records(not_objects, split="test")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"a": 1},\n {"a": ]')
    with pytest.raises(ValueError, match=r"broken\.json' is not valid JSON: .* line 2"):
        load_records(broken, split="test")
    scalar = tmp_path / "scalar.json"
    scalar.write_text('{"rows": []}')
    with pytest.raises(ValueError, match=r"JSON dict with keys \['rows'\].*\{\"data\""):
        load_records(scalar, split="test")
    parquet = tmp_path / "x.parquet"
    parquet.write_text("not parquet")
    with pytest.raises(ValueError, match=r"x\.parquet' is not a readable Parquet file"):
        load_records(parquet, split="test")


def test_missing_local_file_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl' does not exist"):
        load_records(tmp_path / "nope.jsonl", split="test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records("data/nope.parquet", split="test")


def test_json_file_holding_jsonl_is_read_line_by_line(tmp_path):
    path = tmp_path / "dev.json"  # some mirrors name JSONL files .json
    shutil.copy(fixture("flashrag_hotpotqa_dev.jsonl"), path)
    assert [r["id"] for r in load_records(path, split="dev")] == ["dev_0", "dev_1", "dev_2"]


def fake_hub(monkeypatch, tables: dict[tuple[str, str | None], list[dict]]) -> list[tuple]:
    """Replace `datasets.load_dataset` with in-memory tables keyed by (hub id, config)."""
    import datasets

    calls: list[tuple] = []

    def load_dataset(path, name=None, *, split):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(tables[(path, name)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr("copes.envs.tasks.io.hub_reachable", lambda timeout=2.0: True)
    return calls


def test_an_unreachable_hub_fails_at_once_naming_data_dir(monkeypatch):
    import datasets

    from copes.envs.tasks.builtin import load_benchmark

    def never(*args, **kwargs):
        raise AssertionError("load_dataset must not be tried (it retries for ~30 s)")

    monkeypatch.setattr(datasets, "load_dataset", never)
    monkeypatch.setattr("copes.envs.tasks.io.hub_reachable", lambda timeout=2.0: False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ConnectionError, match="--data-dir"):
        load_benchmark("gsm8k", split="test", limit=1)


def test_hub_ids_go_to_load_dataset_with_config_and_limit(monkeypatch):
    records = load_records(fixture("gsm8k.jsonl"), split="test")
    calls = fake_hub(monkeypatch, {("openai/gsm8k", "main"): records})
    tasks = load_gsm8k(limit=2)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [t.answers for t in tasks] == [("14",), ("8750",)]


def test_math_from_hub_loads_subject_configs(monkeypatch):
    algebra = load_records(fixture("math_algebra.jsonl"), split="test")
    geometry = [{**algebra[0], "type": "Geometry"}]
    calls = fake_hub(
        monkeypatch,
        {
            ("EleutherAI/hendrycks_math", "algebra"): algebra,
            ("EleutherAI/hendrycks_math", "geometry"): geometry,
        },
    )
    tasks = load_math(subjects=["algebra", "geometry"])
    assert [c[1] for c in calls] == ["algebra", "geometry"]
    assert [t.id for t in tasks][-2:] == ["math-test-algebra-3", "math-test-geometry-0"]
    with pytest.raises(ValueError, match=r"unknown subjects \['algebr'\]"):
        load_math(subjects=["algebr"])


def test_aime25_opencompass_hub_id_loads_both_parts(monkeypatch):
    part = load_records(fixture("aime25_opencompass.jsonl"), split="test")
    calls = fake_hub(
        monkeypatch,
        {
            ("opencompass/AIME2025", "AIME2025-I"): part,
            ("opencompass/AIME2025", "AIME2025-II"): part[:2],
        },
    )
    tasks = load_aime25("opencompass/AIME2025")
    assert [c[1] for c in calls] == ["AIME2025-I", "AIME2025-II"]
    assert [t.id for t in tasks] == [f"AIME2025-I-{i}" for i in range(3)] + [
        "AIME2025-II-0",
        "AIME2025-II-1",
    ]
    assert len(load_aime25("opencompass/AIME2025", limit=3)) == 3


def test_unreachable_hub_says_how_to_use_local_files(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        load_gsm8k("copes-test/no-such-dataset")
    message = str(info.value)
    assert "could not load 'copes-test/no-such-dataset' (config 'main'), split 'test'" in message
    assert "Hugging Face hub" in message
    assert "pass the local .jsonl/.json/.parquet file" in message
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------- math


def test_gsm8k_gold_is_after_hashes_without_commas():
    tasks = load_gsm8k(fixture("gsm8k.jsonl"))
    assert [t.id for t in tasks] == [f"gsm8k-test-{i}" for i in range(4)]
    assert [t.answers for t in tasks] == [("14",), ("8750",), ("30",), ("2350",)]
    assert all(t.kind == "math" and t.source == "gsm8k" and not t.passages for t in tasks)
    assert tasks[0].question.startswith("Mira buys 3 notebooks")
    assert tasks[1].metadata["solution"].endswith("#### 8,750")
    assert [t.id for t in load_gsm8k(fixture("gsm8k.jsonl"), split="train", limit=2)] == [
        "gsm8k-train-0",
        "gsm8k-train-1",
    ]


def test_gsm8k_without_final_line_is_an_error(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "q", "answer": "2+2=4"}\n')
    with pytest.raises(SchemaError, match=r"record 0 has no final '#### <number>' line"):
        load_gsm8k(path)


def test_math500_keeps_answer_and_metadata():
    tasks = load_math500(fixture("math500.jsonl"))
    assert [t.id for t in tasks] == [
        "test/prealgebra/1021.json",
        "test/algebra/2117.json",
        "test/intermediate_algebra/412.json",
        "test/geometry/77.json",
    ]
    assert [t.answers[0] for t in tasks] == ["\\frac{1}{2}", "\\sqrt{3}", "(1,2)", "\\text{east}"]
    assert tasks[2].metadata["subject"] == "Intermediate Algebra"
    assert tasks[2].metadata["level"] == 3
    assert "boxed{(1,2)}" in tasks[2].metadata["solution"]
    assert tasks[0].question == "Compute $\\dfrac{3}{4} - \\dfrac{1}{4}$."


def test_math_gold_is_last_box_and_unboxed_records_are_skipped(caplog):
    with caplog.at_level(logging.WARNING):
        tasks = load_math(fixture("math_algebra.jsonl"))
    # record 2 has no \boxed{}: skipped, but ids of the others stay as in the full file
    assert [t.id for t in tasks] == [
        "math-test-algebra-0",
        "math-test-algebra-1",
        "math-test-algebra-3",
    ]
    assert [t.answers for t in tasks] == [("\\frac{1}{2}",), ("6",), ("[2,\\infty)",)]
    assert tasks[1].metadata["level"] == "Level 2"
    assert tasks[1].metadata["subject"] == tasks[1].metadata["type"] == "Algebra"
    assert "skipped 1 records" in caplog.text
    assert len(load_math(fixture("math_algebra.jsonl"), limit=2)) == 2
    with pytest.raises(ValueError, match="subjects"):
        load_math(fixture("math_algebra.jsonl"), subjects=["algebra"])


def test_aime24_and_aime25_both_shapes():
    aime24 = load_aime24(fixture("aime24.jsonl"))
    assert [(t.id, t.answers) for t in aime24] == [
        ("60", ("17",)),
        ("61", ("24",)),
        ("62", ("24",)),
    ]
    assert aime24[0].metadata["year"] == 2024
    assert aime24[0].metadata["url"].endswith("2024_AIME_I_Problems/Problem_1")
    assert aime24[0].source == "aime24"

    aime25 = load_aime25(fixture("aime25.jsonl"))
    assert [(t.id, t.answers) for t in aime25] == [("0", ("40",)), ("1", ("128",)), ("2", ("999",))]
    assert aime25[2].question == "Find the largest three-digit multiple of $37$."

    alt = load_aime25(fixture("aime25_opencompass.jsonl"), limit=2)
    assert [(t.id, t.answers, t.source) for t in alt] == [
        ("aime25-test-0", ("11",), "aime25"),
        ("aime25-test-1", ("1",), "aime25"),
    ]
    assert alt[1].question.startswith("What is the remainder when $7^{4}$")


def test_wrong_file_for_loader_lists_the_fields_it_has():
    with pytest.raises(SchemaError, match=r"math500: record 0 .* no 'problem' field; it has \["):
        load_math500(fixture("gsm8k.jsonl"))
    with pytest.raises(SchemaError, match=r"musique: record 0 \(id '5a8b57f25542995d1e6f1371'\)"):
        load_musique(fixture("hotpotqa_hub.jsonl"))


# ---------------------------------------------------------------- qa

HOTPOT_IDS = ["5a8b57f25542995d1e6f1371", "5a8c7595554299585d9e36b6", "5a85ea095542994775f606a8"]


@pytest.mark.parametrize("name", ["hotpotqa_hub.jsonl", "hotpot_dev_distractor_v1.json"])
def test_hotpotqa_hub_and_original_shapes_agree(name):
    tasks = load_hotpotqa(fixture(name))
    assert [t.id for t in tasks] == HOTPOT_IDS
    first = tasks[0]
    assert first.kind == "qa" and first.source == "hotpotqa"
    assert first.answers == ("Varn River",)
    assert first.question.startswith("Which river flows through the city")
    assert len(first.passages) == 10
    titles = [p.title for p in first.passages]
    assert titles[3] == "Glass Lantern Theatre" and titles[7] == "Ostrel"
    # sentences joined with single spaces, leading spaces of the originals dropped
    assert first.passages[7].text == (
        "Ostrel is a city in the north of Calvia. The Varn River flows through Ostrel."
    )
    assert first.metadata["supporting_titles"] == ["Glass Lantern Theatre", "Ostrel"]
    assert first.metadata["supporting_facts"] == [["Glass Lantern Theatre", 0], ["Ostrel", 1]]
    assert (first.metadata["type"], first.metadata["level"]) == ("bridge", "medium")
    assert tasks[1].answers == ("yes",)


def test_hotpotqa_shapes_give_equal_tasks():
    hub = load_hotpotqa(fixture("hotpotqa_hub.jsonl"))
    original = load_hotpotqa(fixture("hotpot_dev_distractor_v1.json"))
    assert hub == original
    assert [t.metadata for t in hub] == [t.metadata for t in original]
    assert len(load_hotpotqa(fixture("hotpotqa_hub.jsonl"), limit=1)) == 1


def test_2wiki_original_shape():
    tasks = load_2wiki(fixture("2wiki_dev.json"))
    assert tasks[0].id == "8813f87c0bdd11eba7f7acde48001122"
    assert [t.answers for t in tasks] == [("Lena Varga",), ("The Salt Harbour",), ("no",)]
    assert all(len(t.passages) == 10 for t in tasks)
    assert tasks[0].passages[0].title == "The Amber Road"
    assert (
        tasks[0].passages[6].text == "Tomas Varga was a film director. His mother was Lena Varga."
    )
    assert tasks[0].metadata["supporting_titles"] == ["The Amber Road", "Tomas Varga"]
    assert tasks[0].metadata["evidences"][1] == ["Tomas Varga", "mother", "Lena Varga"]
    assert tasks[2].metadata["type"] == "bridge_comparison"
    assert all(t.source == "2wiki" for t in tasks)


def test_2wiki_hub_struct_with_content_key(tmp_path):
    """Hub conversions store context as {"title": [..], "content": [[..]]}."""
    records = json.loads(fixture("2wiki_dev.json").read_text())
    for record in records:
        record["context"] = {
            "title": [title for title, _ in record["context"]],
            "content": [sentences for _, sentences in record["context"]],
        }
    path = tmp_path / "validation.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_2wiki(path) == load_2wiki(fixture("2wiki_dev.json"))


def test_unreadable_context_is_a_schema_error(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([{"_id": "x", "question": "q", "answer": "a", "context": [["t"]]}]))
    with pytest.raises(SchemaError, match=r"unreadable 'context'.*\[\[title, sentences\]"):
        load_2wiki(path)


def test_musique_aliases_passages_and_unanswerable():
    tasks = load_musique(fixture("musique_ans_v1.0_dev.jsonl"))
    assert [t.id for t in tasks] == [
        "2hop__131818_161450",
        "2hop__511454_120259",
        "3hop1__305282_282081_73772",
    ]
    first = tasks[0]
    assert first.answers == ("Dunmore County", "Dunmore")
    assert tasks[1].answers == ("1987",)
    assert tasks[2].answers == ("Velm", "Velm City")
    assert all(len(t.passages) == 20 for t in tasks)
    supporting = [p for p in first.passages if p.title in ("Ilse Marrow", "Pellham")]
    assert [p.id for p in supporting] == [str(i) for i in first.metadata["supporting_idx"]]
    assert first.metadata["supporting_titles"] == ["Ilse Marrow", "Pellham"]
    assert first.metadata["question_decomposition"][0]["answer"] == "Pellham"
    assert first.passages[int(supporting[1].id)].text == "Pellham is a town in Dunmore County."

    kept = load_musique(fixture("musique_ans_v1.0_dev.jsonl"), include_unanswerable=True)
    assert len(kept) == 4
    assert kept[2].answers == ("Oskar Lind", "O. Lind", "Lind")
    assert kept[2].metadata["answerable"] is False
    # limit counts tasks kept, not records read
    limited = load_musique(fixture("musique_ans_v1.0_dev.jsonl"), limit=3)
    assert [t.id for t in limited] == [t.id for t in tasks]


def test_flashrag_golden_answers_without_passages():
    tasks = load_flashrag(fixture("flashrag_hotpotqa_dev.jsonl"))
    assert [t.id for t in tasks] == ["dev_0", "dev_1", "dev_2"]
    assert tasks[0].answers == ("Varn River", "the Varn")
    assert all(t.passages == () and t.kind == "qa" for t in tasks)
    assert tasks[0].source == "flashrag-hotpotqa"
    assert tasks[0].metadata == {"type": "bridge", "level": "medium"}
    assert load_flashrag(fixture("flashrag_hotpotqa_dev.jsonl"), dataset="musique")[0].source == (
        "flashrag-musique"
    )


# ---------------------------------------------------------------- registry


def test_registry_defaults_match_the_documented_sources():
    expected = {
        "gsm8k": ("openai/gsm8k", "test", "math"),
        "math500": ("HuggingFaceH4/MATH-500", "test", "math"),
        "math": ("EleutherAI/hendrycks_math", "test", "math"),
        "aime24": ("HuggingFaceH4/aime_2024", "test", "math"),
        "aime25": ("math-ai/aime25", "test", "math"),
        "hotpotqa": ("hotpotqa/hotpot_qa", "validation", "qa"),
        "musique": ("dgslibisey/MuSiQue", "validation", "qa"),
    }
    for name, defaults in expected.items():
        spec = BENCHMARKS[name]
        assert (spec.name, (spec.source, spec.split, spec.kind)) == (name, defaults)
    assert BENCHMARKS["2wiki"].kind == "qa"
    assert BENCHMARKS["synthetic-math"].source is None
    # every registered benchmark's tasks carry its registry name as `source`
    flashrag = load_benchmark(
        "flashrag-2wikimultihopqa", source=fixture("flashrag_hotpotqa_dev.jsonl")
    )
    assert {t.source for t in flashrag} == {"flashrag-2wikimultihopqa"}


def test_load_benchmark_from_data_dir_file_and_folder(tmp_path):
    shutil.copy(fixture("gsm8k.jsonl"), tmp_path / "gsm8k.jsonl")
    tasks = load_benchmark("gsm8k", data_dir=tmp_path, limit=3)
    assert [t.answers[0] for t in tasks] == ["14", "8750", "30"]

    (tmp_path / "hotpotqa").mkdir()
    shutil.copy(fixture("hotpot_dev_distractor_v1.json"), tmp_path / "hotpotqa" / "dev.json")
    hotpot = load_benchmark("hotpotqa", data_dir=str(tmp_path))  # split "validation" finds dev
    assert [t.id for t in hotpot] == HOTPOT_IDS

    (tmp_path / "musique").mkdir()
    shutil.copy(fixture("musique_ans_v1.0_dev.jsonl"), tmp_path / "musique" / "validation.jsonl")
    assert len(load_benchmark("musique", data_dir=tmp_path)) == 3

    with pytest.raises(
        FileNotFoundError, match=r"no local files for benchmark 'aime24'.*aime24\.jsonl"
    ):
        load_benchmark("aime24", data_dir=tmp_path)


def test_load_benchmark_source_overrides_data_dir(tmp_path):
    tasks = load_benchmark("aime25", source=fixture("aime25_opencompass.jsonl"), data_dir=tmp_path)
    assert [t.answers[0] for t in tasks] == ["11", "1", "465"]
    wiki = load_benchmark("2wiki", source=str(fixture("2wiki_dev.json")), split="dev")
    assert [t.source for t in wiki] == ["2wiki"] * 3


def test_unknown_benchmark_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark 'gsm9k'; known benchmarks: gsm8k, "):
        load_benchmark("gsm9k")


def test_synthetic_benchmarks_are_generated_not_read():
    with pytest.raises(ValueError, match="generated, not read from files"):
        load_benchmark("synthetic-math", source="x.jsonl")
    pytest.importorskip("copes.envs.tasks.synthetic")
    tasks = load_benchmark("synthetic-math", limit=5, data_dir="/ignored")
    assert len(tasks) == 5 and all(t.kind == "math" for t in tasks)
    assert tasks == load_benchmark("synthetic-math", limit=5)
    qa = load_benchmark("synthetic-qa", split="validation", limit=3)
    assert len(qa) == 3 and all(t.kind == "qa" and t.passages for t in qa)


def test_missing_synthetic_module_is_explained(monkeypatch):
    import sys

    import copes.envs.tasks

    monkeypatch.delattr(copes.envs.tasks, "synthetic", raising=False)
    monkeypatch.setitem(sys.modules, "copes.envs.tasks.synthetic", None)
    with pytest.raises(
        ModuleNotFoundError, match=r"'synthetic-qa' needs copes/envs/tasks/synthetic"
    ):
        load_benchmark("synthetic-qa", limit=2)
