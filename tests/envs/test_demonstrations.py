"""Protocol demonstrations (copes.envs.demonstrations): played through a real env in every
call format, their calls written by the code whose inverse parses them, their tool output
real, and their tokens prompt."""

from __future__ import annotations

import json

import pytest

from copes.envs.demonstrations import DEMONSTRATIONS, play, transcript_digest
from copes.envs.parsing import CALL_FORMATS, TurnParser, format_answer, format_call
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.tools.base import FunctionTool


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_every_format_writes_calls_its_parser_reads_back(call_format) -> None:
    code = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    one = FunctionTool(str, "python", "run", code)
    two = FunctionTool(str, "convert", "units", {
        "type": "object", "required": ["value", "unit"],
        "properties": {"value": {"type": "number"}, "unit": {"type": "string"}}})  # fmt: skip
    parser = TurnParser({t.name: t for t in (one, two)}, call_format)  # type: ignore[arg-type]
    from copes.envs.parsing import split_reasoning

    for tool, arguments in ((one, {"code": 'x = "a\\nb"\nprint(x, 6 * 7)'}),
                            (two, {"value": 2.5, "unit": "km"})):  # fmt: skip
        turn = split_reasoning(format_call(call_format, tool, arguments))[1]
        parsed = parser.parse(turn)
        assert (parsed.kind, parsed.tool_name, parsed.arguments) == (
            "tool_call",
            tool.name,
            arguments,
        ), turn
    answer = parser.parse(split_reasoning(format_answer(call_format, "1517"))[1])
    assert (answer.kind, answer.answer) == ("answer", "1517")


@pytest.mark.parametrize("call_format", CALL_FORMATS)
@pytest.mark.parametrize("make", [tool_math_env, tool_qa_env])
def test_examples_play_before_the_task_in_every_format(make, call_format) -> None:
    env = make(call_format=call_format, demonstrations=2, limit=2, system_prompt="Be brief.")
    _, info = env.reset(options={"task_index": 1})
    messages = info["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[-1]["role"] == "user" and env.unwrapped.task.question in messages[-1]["content"]
    played = messages[1:-1]
    assert played == env.unwrapped.demonstration_messages
    kind = "math" if make is tool_math_env else "qa"
    examples = DEMONSTRATIONS[kind][:2]
    users = [m for m in played if m["role"] == "user"]
    assert [e.task.question in u["content"] for e, u in zip(examples, users, strict=True)]
    tools = [m for m in played if m["role"] == "tool"]
    assert len(tools) == sum(len(e.calls) for e in examples)
    if kind == "math":  # the sandbox ran the calls
        assert [t["content"] for t in tools] == ["1517", "819.0"]
    else:  # BM25 over the example's own passages: the fact the answer needs came back first
        assert "born in Szeged" in tools[1]["content"].split("\n\n")[0]
    finals = [m for m in played if m["role"] == "assistant" and "<answer>" in m["content"]]
    assert len(finals) == 2
    step = env.step(format_answer(call_format, env.unwrapped.task.answers[0]))
    assert step[2] and step[4]["correct"] and step[4]["turn"] == 1  # the task's own turns
    env.close()


def test_the_transcript_is_fixed_and_its_count_checked() -> None:
    first = play("math", 2, call_format="tags")
    assert transcript_digest(first) == transcript_digest(play("math", 2, call_format="tags"))
    assert play("math", 1, call_format="tags") == first[:4]
    assert play("math", 0, call_format="tags") == []
    with pytest.raises(ValueError, match="from 0 to 2"):
        tool_math_env(demonstrations=3, limit=1)
    with pytest.raises(ValueError, match="call the python tool"):
        tool_math_env(demonstrations=1, limit=1, tools=[FunctionTool(str, "calc", "c", {})])


def test_demonstration_tokens_are_prompt(tiny_policy) -> None:
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout

    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0)
    lengths = {}
    for count in (0, 2):
        env = tool_math_env(demonstrations=count, limit=1, max_turns=1)
        [trajectory] = rollout(tiny_policy, [env], sampling, options=[{"task_index": 0}])
        env.close()
        lengths[count] = trajectory.prompt_length
        prompt = tiny_policy.tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length])
        assert ("print(37 * 48 - 259)" in prompt) == bool(count)
        assert not any(trajectory.generated_mask[: trajectory.prompt_length])
    assert lengths[2] > lengths[0] + 100


def test_copes_eval_records_the_examples_and_refuses_to_mix_counts(tiny_agent_dir, tmp_path):
    from copes.evaluation.cli import main as eval_main

    out = tmp_path / "eval"
    flags = ["--model", str(tiny_agent_dir), "--benchmarks", "synthetic-math,synthetic-qa",
             "--limit", "2", "-n", "1", "--pass-k", "1", "--max-new-tokens", "24",
             "--max-turns", "2", "--device", "cpu", "--quiet", "--out", str(out)]  # fmt: skip
    assert eval_main([*flags, "--demonstrations", "1"]) == 0
    config = json.loads((out / "eval_config.json").read_text())
    math_played = play("math", 1, call_format="tags")
    assert config["demonstrations"]["count"] == 1
    assert config["demonstrations"]["sha256"]["synthetic-math"] == transcript_digest(math_played)
    assert config["demonstrations"]["sha256"]["synthetic-qa"] != transcript_digest(math_played)
    assert eval_main([*flags, "--demonstrations", "2"]) == 2  # other samples: refused
    assert eval_main([*flags, "--demonstrations", "1"]) == 0  # the same: resumed
    assert eval_main([*flags, "--demonstrations", "5", "--out", str(tmp_path / "x")]) == 2
