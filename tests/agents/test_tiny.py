"""The embedded tiny agent: the shipped folder, its digests, and the recipe that builds it."""

import json

import pytest

from copes.agents.tiny_recipe import TinyAgentConfig


def test_folder_is_a_normal_hugging_face_model(tiny_agent_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    assert model.config.model_type == "qwen2"
    # 0.56M: two layers, the shape that learns to copy within the build (docs/agents.md)
    assert 3e5 < sum(p.numel() for p in model.parameters()) < 2e7
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # digits one per token (Qwen2's split); tool tags are single ordinary tokens
    assert tokenizer.tokenize("90817") == list("90817")
    ids = tokenizer("<python>x</python>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<python>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<python>x</python>"


def test_build_report(tiny_agent_dir):
    report = json.loads((tiny_agent_dir / "copes_tiny.json").read_text())
    accuracy = report["validation_accuracy_greedy_64"]
    assert set(accuracy) == {"math", "qa"} and all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert report["transcripts"] == 4500 and report["sft_final_loss"] < 1.0
    assert report["copy_final_loss"] < 1.0  # induction formed: chance is ln(1024) = 6.9
    # the warm start is partial, as the issue asks (15-50%); measured on the reloaded folder
    assert 0.15 <= accuracy["math"] <= 0.6 and 0.15 <= accuracy["qa"] <= 0.6


@pytest.mark.slow
def test_the_shipped_agent_scores_its_recorded_accuracy_here(tiny_agent_dir):
    """The report's greedy accuracy was measured on the build machine's kernels; here the
    same weights may decode a token differently (float32), but only now and then: within
    3 of 64 tasks (docs/results.md measures how often on other kernel sets)."""
    import torch

    from copes.agents.hf import HFPolicy
    from copes.agents.tiny_recipe import validation_accuracy

    report = json.loads((tiny_agent_dir / "copes_tiny.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build measured it
    try:
        policy = HFPolicy.from_pretrained(tiny_agent_dir, device="cpu")
        for kind, recorded in report["validation_accuracy_greedy_64"].items():
            measured = validation_accuracy(policy, kind, seed=report["config"]["seed"])
            assert abs(measured - recorded) <= 3 / 64, kind
    finally:
        torch.set_num_threads(threads)


def test_saved_tokenizer_loads_as_it_was_trained(tiny_agent_dir):
    """transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which rebuilds Qwen2's
    pre-tokenizer around the saved vocabulary: the build must have trained with exactly that
    pipeline, or every prompt would be tokenized differently from the SFT data."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from copes.agents.tiny_recipe import collect_transcripts

    as_trained = Tokenizer.from_file(str(tiny_agent_dir / "tokenizer.json"))
    as_loaded = AutoTokenizer.from_pretrained(tiny_agent_dir)
    config = TinyAgentConfig(math_transcripts=3, qa_transcripts=3)
    for conversation in collect_transcripts(config, progress=False):
        for message in conversation:
            text = message["content"]
            expected = as_trained.encode(text, add_special_tokens=False).ids
            assert as_loaded(text, add_special_tokens=False)["input_ids"] == expected


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


def test_the_shipped_agent_is_the_recorded_one():
    from copes.agents import model_files, models, tiny

    folder = models.shipped_tiny_agent()
    assert tiny.ensure_tiny_agent() == folder  # the default recipe never builds
    assert model_files.files_digest(folder) == models.SHIPPED_FILES_SHA256
    assert model_files.weights_digest(folder) == models.SHIPPED_WEIGHTS_SHA256
    report = json.loads((folder / "copes_tiny.json").read_text())
    assert report["weights_sha256"] == models.SHIPPED_WEIGHTS_SHA256  # the build's own record
    assert report["fingerprint"] == TinyAgentConfig().fingerprint()


def test_a_changed_shipped_file_is_refused(tmp_path, monkeypatch):
    import shutil

    from copes.agents import models

    copy = tmp_path / "tiny_agent"
    shutil.copytree(models.shipped_tiny_agent(), copy)
    monkeypatch.setattr(models, "SHIPPED_DIR", copy)
    assert models.shipped_tiny_agent() == copy
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(RuntimeError, match="do not match their recorded digest"):
        models.shipped_tiny_agent()
    (copy / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="missing"):
        models.shipped_tiny_agent()


@pytest.mark.slow
def test_the_recipe_builds_once_into_the_cache_and_reuses_it(tmp_path):
    """The build path itself (the shipped agent is its full-size output): a small recipe."""
    from transformers import AutoModelForCausalLM

    from copes.agents.model_files import weights_digest
    from copes.agents.tiny import ensure_tiny_agent

    small = TinyAgentConfig(
        math_transcripts=12, qa_transcripts=12, copy_pretrain_steps=3, copy_batch_size=4,
        sft_steps=4, batch_size=2, copy_drills=8, warmup_steps=1,
    )  # fmt: skip
    built = ensure_tiny_agent(cache_dir=tmp_path, config=small, progress=False)
    assert built == tmp_path / f"tiny-agent-{small.fingerprint()}"
    report = json.loads((built / "copes_tiny.json").read_text())
    assert report["transcripts"] == 24 and report["weights_sha256"] == weights_digest(built)
    assert report["built_on"]["cpu_capability"]
    assert AutoModelForCausalLM.from_pretrained(built).config.model_type == "qwen2"
    stamp = (built / "copes_tiny.json").stat().st_mtime_ns
    assert ensure_tiny_agent(cache_dir=tmp_path, config=small, progress=False) == built
    assert (built / "copes_tiny.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_tiny_name_resolves_to_the_shipped_agent(tiny_agent_dir, monkeypatch, tmp_path):
    from copes.agents.models import SHIPPED_DIR, resolve_model_path

    monkeypatch.setenv("COPES_CACHE", str(tmp_path))  # no cache is read or written
    assert resolve_model_path("tiny") == str(SHIPPED_DIR)
    assert list(tmp_path.iterdir()) == []
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_expert_mistake_rate_is_validated():
    from copes.agents.scripted import ScriptedExpert

    with pytest.raises(ValueError, match="mistake_rate"):
        ScriptedExpert(mistake_rate=1.5)


def test_induction_drills_repeat_a_stretch_of_their_context():
    from copes.agents.tiny_recipe import TAG_TOKENS, induction_drills, train_tokenizer

    tokenizer = train_tokenizer(["a few words to learn from"] * 5, 300)
    drills = induction_drills(tokenizer, 50, seed=3)
    assert drills == induction_drills(tokenizer, 50, seed=3)  # seeded
    tags = set(tokenizer.convert_tokens_to_ids(TAG_TOKENS))
    for ids, mask in drills:
        target = [i for i, m in zip(ids, mask, strict=True) if m]
        head = ids[: len(ids) - len(target)]
        assert 9 <= len(target) <= 29 and mask == [0] * len(head) + [1] * len(target)
        # the repeat's first token ends the context; the rest of the stretch is the target
        stretch = [head[-1], *target]
        assert any(head[i : i + len(stretch)] == stretch for i in range(len(head) - 1))
        assert not tags & set(ids) and min(ids) >= 3  # no specials or tool tags inside
