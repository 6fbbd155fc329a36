"""HFPolicy on the real tiny agent: determinism, stop strings, padding, log-probs."""

import pytest
import torch

from copes.agents.policy import SamplingConfig

QUESTION = [{"role": "user", "content": "What is 1234 * 5678?\n\nGive the final answer."}]
OTHER = [{"role": "user", "content": "In which city was Rira Fengura born?"}]


def test_seeded_sampling_is_reproducible(tiny_policy):
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=7)
    a = tiny_policy.generate([QUESTION, OTHER], sampling)
    b = tiny_policy.generate([QUESTION, OTHER], sampling)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    c = tiny_policy.generate([QUESTION, OTHER], SamplingConfig(max_new_tokens=24, seed=8))
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_left_padding_batched_equals_unbatched_greedy(tiny_policy):
    greedy = SamplingConfig(max_new_tokens=20, temperature=0.0)
    long_prompt = [{"role": "user", "content": "A shop sells 38 pens for 1290 coins. " * 4}]
    batched = tiny_policy.generate([QUESTION, long_prompt, OTHER], greedy)
    alone = [tiny_policy.generate([c], greedy)[0] for c in (QUESTION, long_prompt, OTHER)]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]


def test_stop_strings_end_the_turn(tiny_policy):
    sampling = SamplingConfig(max_new_tokens=48, temperature=0.0, stop=("</python>",))
    gen = tiny_policy.generate([QUESTION], sampling)[0]
    text = tiny_policy.tokenizer.decode(gen.token_ids)
    if gen.finish_reason == "stop":
        assert text.endswith("</python>") or "</python>" in text[-12:]
        prefix = tiny_policy.tokenizer.decode(gen.token_ids[:-1])
        assert "</python>" not in prefix  # cut at the first token that completes the stop
    # a stop string that appears immediately ends generation after its token
    first = tiny_policy.tokenizer.decode(gen.token_ids[:1])
    forced = SamplingConfig(max_new_tokens=48, temperature=0.0, stop=(first,))
    out = tiny_policy.generate([QUESTION], forced)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1


def test_logprobs_match_a_fresh_forward_pass(tiny_policy):
    gen = tiny_policy.generate([OTHER], SamplingConfig(max_new_tokens=16, seed=3))[0]
    ids = torch.tensor([gen.prompt_token_ids + gen.token_ids])
    with torch.no_grad():
        logits = tiny_policy.model(ids).logits[0].float()
    start = len(gen.prompt_token_ids)
    logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    expected = logp.gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_finish_reasons_and_lengths(tiny_policy):
    gen = tiny_policy.generate([QUESTION], SamplingConfig(max_new_tokens=3, seed=1))[0]
    assert len(gen.token_ids) <= 3 and len(gen.logprobs) == len(gen.token_ids)
    assert gen.finish_reason in ("length", "eos", "stop")


def test_bfloat16_generation_runs(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    policy = HFPolicy.from_pretrained(tiny_agent_dir, device="cpu", dtype="bf16")
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    gen = policy.generate([QUESTION], SamplingConfig(max_new_tokens=8, temperature=0.0))[0]
    assert gen.token_ids and all(lp <= 0 for lp in gen.logprobs)


def test_bad_inputs_are_explained(tmp_path):
    from copes.agents.hf import HFPolicy

    with pytest.raises(FileNotFoundError, match="could not load model"):
        HFPolicy.from_pretrained(tmp_path / "missing", device="cpu")
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
