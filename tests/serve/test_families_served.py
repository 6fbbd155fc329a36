"""The served endpoint on the families with new call formats: a gpt-oss (harmony) turn comes
back with its analysis channel as `reasoning_content` and its `to=functions.python` message
as an OpenAI tool call; a Mistral call's id is one its template takes back (9 characters),
and the conversation the client sends back renders to the real tool turn."""

import json

import pytest

from copes.agents.policy import SamplingConfig

pytestmark = pytest.mark.slow


def serve(family_dir, name, call_format):
    import families

    from copes.agents.hf import HFPolicy
    from copes.serve import PolicyServer

    family = families.FAMILIES[name]
    policy = HFPolicy.from_pretrained(
        family_dir(name), device="cpu", chat_template_kwargs=family.template_kwargs or None
    )
    server = PolicyServer(policy, SamplingConfig(max_new_tokens=64, temperature=0.0), call_format)
    server.start()
    return server, families


def first_turn(server, families, call_format):
    import httpx

    env = families.make_env(call_format)  # the family's scripted question, as the env asks it
    try:
        _, info = env.reset(options={"task": families.make_task()})
    finally:
        env.close()
    # The env's own tool schemas: the prompt the family model was trained on.
    body = {"model": "policy@0", "messages": info["messages"][:1], "tools": info["tools"]}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return info["messages"][:1], info["tools"], reply.json()["choices"][0]


def test_a_harmony_turn_is_served_as_reasoning_and_a_tool_call(family_dir):
    server, families = serve(family_dir, "gpt_oss", "harmony")
    try:
        _, _, choice = first_turn(server, families, server.call_format)
    finally:
        server.stop()
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "Multiply with the tool."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "python"
    assert json.loads(call["function"]["arguments"]) == {"code": "print(12 * 34)"}
    assert "<|channel|>" not in (message["content"] or "")


def test_a_mistral_call_id_is_one_the_template_takes_back(family_dir):
    server, families = serve(family_dir, "mistral_nemo", "mistral")
    try:
        messages, tools, choice = first_turn(server, families, server.call_format)
        [call] = choice["message"]["tool_calls"]
        assert call["id"] == "a1b2c3d4e"  # the id the model wrote (9 alphanumerics)
        conversation = [
            *messages,
            choice["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "408"},
        ]
        rendered = server.chat.render(conversation, tools)
        assert rendered.endswith(
            '[TOOL_RESULTS]{"content": 408, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]'
        )
    finally:
        server.stop()
