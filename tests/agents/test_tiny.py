"""The embedded tiny agent, built from scratch by the suite (tests/conftest.py)."""

import json

import pytest


def test_folder_is_a_normal_hugging_face_model(tiny_agent_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    assert model.config.model_type == "qwen2"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 2e7  # "a few million"
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # digits one per token; tool tags are single ordinary tokens that survive decoding
    assert tokenizer.tokenize("90817") == ["9", "0", "8", "1", "7"]
    ids = tokenizer("<python>x</python>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<python>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<python>x</python>"


def test_build_report(tiny_agent_dir):
    report = json.loads((tiny_agent_dir / "copes_tiny.json").read_text())
    accuracy = report["validation_accuracy_greedy_64"]
    assert set(accuracy) == {"math", "qa"} and all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert report["transcripts"] == 3000 and report["sft_final_loss"] < 4.0


def test_warm_start_knows_the_tool_format(tiny_policy):
    """The agent calls the right tool with well-formed tags, then answers (accuracy aside)."""
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.envs.presets import tool_math_env, tool_qa_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    greedy = SamplingConfig(max_new_tokens=96, temperature=0.0)
    for make_env, tasks, tool in (
        (tool_math_env, synthetic_math_tasks("validation", 16, seed=11), "python"),
        (tool_qa_env, synthetic_qa_tasks("validation", 16, seed=11), "search"),
    ):
        batch = rollout(tiny_policy, [make_env(tasks=[t]) for t in tasks], greedy)
        first_turns = [t.messages[1]["content"] for t in batch]
        assert sum(f"<{tool}>" in turn and f"</{tool}>" in turn for turn in first_turns) >= 12
        assert sum(t.end_reason == "answer" for t in batch) >= 8


def test_cached_agent_is_reused(tiny_agent_dir):
    from copes.agents.tiny import ensure_tiny_agent

    stamp = (tiny_agent_dir / "copes_tiny.json").stat().st_mtime_ns
    again = ensure_tiny_agent(cache_dir=tiny_agent_dir.parent, progress=False)
    assert again == tiny_agent_dir
    assert (again / "copes_tiny.json").stat().st_mtime_ns == stamp


def test_tiny_name_resolves_through_the_cache(tiny_agent_dir, monkeypatch):
    from copes.agents.hf import resolve_model_path

    monkeypatch.setenv("COPES_CACHE", str(tiny_agent_dir.parent))
    assert resolve_model_path("tiny") == str(tiny_agent_dir)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_expert_mistake_rate_is_validated():
    from copes.agents.scripted import ScriptedExpert

    with pytest.raises(ValueError, match="mistake_rate"):
        ScriptedExpert(mistake_rate=1.5)
