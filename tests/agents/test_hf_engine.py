"""The HF backend's episode loop (copes.agents.hf.engine, kv_batch, sampling) on the real tiny
agent: KV caches kept across turns give the turns that turn-by-turn generation gives."""

import pytest
import torch

from copes.agents.episodes import EpisodeFeed
from copes.agents.hf import HFPolicy
from copes.agents.hf.kv_batch import KVBatch, SlotBatch
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout
from copes.agents.sampling import filtered_logits, sample_tokens, stream
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

CPU = torch.device("cpu")


def make_envs(kind, n):
    if kind == "math":
        return [tool_math_env(tasks=[t]) for t in synthetic_math_tasks("validation", n, seed=1)]
    return [tool_qa_env(tasks=[t]) for t in synthetic_qa_tasks("validation", n, seed=1)]


def next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_slot_batch_matches_a_fresh_forward(tiny_policy):
    """Rows join (prefilled in a KVBatch), leave (the last rows fill their slots), come back
    with more tokens, and the buffers grow: every row's logits stay those of a fresh forward
    pass over its whole sequence."""
    model, pad = tiny_policy.model, tiny_policy.tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(10, 1000, (n,), generator=gen).tolist()

    def check(rows, logits):
        for seq, row_logits in zip(rows, logits, strict=True):
            assert torch.allclose(row_logits.float(), next_logits(model, seq), atol=1e-4)

    with torch.no_grad():
        sequences = [ids(n) for n in (5, 17, 9, 30)]
        prefill = KVBatch.empty(4, CPU)
        check(sequences, prefill.forward(model, sequences, pad))
        batch = SlotBatch(capacity=6, device=CPU)
        batch.add(prefill)
        running = list(sequences)  # the token lists, in slot order
        parked = None
        for step in range(130):
            tokens = ids(len(running))
            for seq, token in zip(running, tokens, strict=True):
                seq.append(token)
            logits = batch.forward(model, tokens)
            if step % 10 == 0 or step in (6, 13, 41):  # (fresh forward passes are slow)
                check(running, logits)
            if step == 5:  # two rows leave; the last row moves into the first gap
                parked_rows = [running[0], running[2]]
                parked, order = batch.remove([0, 2])
                running = [running[slot] for slot in order]
                assert parked.rows == 2 and order == [3, 1]
            if step == 12:  # they come back with a chunk each (tool output), then a new row
                chunks = [ids(3), ids(11)]
                for seq, chunk in zip(parked_rows, chunks, strict=True):
                    seq.extend(chunk)
                check(parked_rows, parked.forward(model, chunks, pad))
                batch.add(parked)
                running += parked_rows
                newcomer = ids(150)  # longer than any row so far: the batch widens
                prefill = KVBatch.empty(1, CPU)
                check([newcomer], prefill.forward(model, [newcomer], pad))
                batch.add(prefill)
                running.append(newcomer)
                buffer = batch.layers[0][0]
            if step == 40:
                _, order = batch.remove([4])  # the longest row leaves: padding is trimmed
                running = [running[slot] for slot in order]
                assert batch.start > 0
    assert batch.rows == 4 and batch.layers[0][0] is not buffer  # re-allocated since


def test_kv_batch_concat_and_compact_keep_the_logits(tiny_policy):
    model, pad = tiny_policy.model, tiny_policy.tokenizer.pad_token_id
    first, second = [[11, 12, 13], [14, 15, 16, 17, 18, 19]], [[20, 21, 22, 23]]
    with torch.no_grad():
        a, b = KVBatch.empty(2, CPU), KVBatch.empty(1, CPU)
        a.forward(model, first, pad)
        b.forward(model, second, pad)
        merged = KVBatch.concat([a, b.take([0])]).compact()
        assert merged.mask.sum(dim=1).tolist() == [3, 6, 4]
        logits = merged.forward(model, [[30], [31, 32], [33]], pad)
    expected = [[*first[0], 30], [*first[1], 31, 32], [*second[0], 33]]
    for row, seq in enumerate(expected):
        assert torch.allclose(logits[row].float(), next_logits(model, seq), atol=1e-4)


@pytest.mark.parametrize("kind", ["math", "qa"])
def test_episode_loop_gives_the_turn_by_turn_tokens_under_greedy(tiny_policy, kind):
    assert tiny_policy.supports_episodes and not tiny_policy.serves_members
    greedy = SamplingConfig(max_new_tokens=48, temperature=0.0)
    turns = rollout(tiny_policy, make_envs(kind, 6), greedy, continuous_batching=False)
    loop = rollout(tiny_policy, make_envs(kind, 6), greedy)
    assert loop.stats.generate_calls == 1 and loop.stats.engine["decode_steps"] > 0
    assert turns.stats.generate_calls > 1 and not turns.stats.engine
    for a, b in zip(turns, loop, strict=True):
        assert a.token_ids == b.token_ids
        assert a.generated_mask == b.generated_mask
        assert (a.end_reason, a.turns, a.reward) == (b.end_reason, b.turns, b.reward)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_more_episodes_than_the_batch_holds(tiny_policy):
    small = HFPolicy(tiny_policy.model, tiny_policy.tokenizer, batch_size=2)
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0)
    expected = rollout(tiny_policy, make_envs("math", 5), greedy)
    got = rollout(small, make_envs("math", 5), greedy)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]


def episodes(policy, prompts, sampling, turns=1):
    """`generate_episodes` with `turns` turns per episode (a fixed "tool output" after each);
    returns every episode's turns."""
    got = {i: [] for i in range(len(prompts))}
    follow = policy.chat.encode_text("<|im_end|>\n<|im_start|>user\n42<|im_end|>\n")

    def record(index, generation):
        got[index].append(generation)
        return None if len(got[index]) == turns else follow

    policy.generate_episodes(prompts, sampling, record)
    return [got[i] for i in range(len(prompts))]


def single_turns(policy, prompts, sampling):
    return [turns[0] for turns in episodes(policy, prompts, sampling)]


def test_single_turns_match_generate_ids(tiny_policy):
    """With no next turn, the loop is a continuous-batching `generate_ids`: the same greedy
    tokens, stop strings and finish reasons."""
    chat = tiny_policy.chat
    questions = ["What is 12 * 34?", "Who wrote the book?", "A shop sells 38 pens. " * 5]
    prompts = [chat.encode_prompt([{"role": "user", "content": q}]) for q in questions]
    for sampling in (
        SamplingConfig(max_new_tokens=40, temperature=0.0, stop=("</python>", "</answer>")),
        SamplingConfig(max_new_tokens=5, temperature=0.0),
    ):
        expected = tiny_policy.generate_ids(prompts, sampling)
        got = single_turns(tiny_policy, prompts, sampling)
        for prompt, mine, theirs in zip(prompts, got, expected, strict=True):
            assert mine.token_ids == theirs.token_ids
            assert (mine.finish_reason, mine.text) == (theirs.finish_reason, theirs.text)
            assert mine.prompt_token_ids == prompt
            assert torch.allclose(
                torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-4
            )


def test_each_episode_samples_from_its_own_stream(tiny_policy):
    chat = tiny_policy.chat
    questions = ["What is 12 * 34?", "Who wrote the book?", "A shop sells 38 pens. " * 5]
    prompts = [chat.encode_prompt([{"role": "user", "content": q}]) for q in questions]
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=11)
    together = episodes(tiny_policy, prompts, sampling, turns=3)
    again = episodes(tiny_policy, prompts, sampling, turns=3)
    assert [[t.token_ids for t in e] for e in together] == [[t.token_ids for t in e] for e in again]
    # episode 0 draws from the stream of (seed, 0), whatever else shares the batch
    alone = episodes(tiny_policy, prompts[:1], sampling, turns=3)
    assert [t.token_ids for t in alone[0]] == [t.token_ids for t in together[0]]
    other = episodes(tiny_policy, prompts, SamplingConfig(max_new_tokens=24, seed=12), turns=3)
    assert [[t.token_ids for t in e] for e in other] != [[t.token_ids for t in e] for e in together]


def test_episodes_arriving_one_by_one_reuse_a_prompt_prefix_and_keep_their_tokens(tiny_policy):
    """As they come, episodes start one at a time: the KV of the prompt prefix they share with
    an earlier episode's prompt is reused (only the rest is prefilled), and every turn is the
    one the deterministic loop gives with all episodes at once (float64: rounding cannot flip
    a token)."""
    policy = HFPolicy(tiny_policy.model.to(torch.float64), tiny_policy.tokenizer)
    chat = policy.chat
    rules = "Answer in tags. Use the calculator for arithmetic, then answer. " * 3
    questions = ["What is 12 * 34?", "Who wrote the book?", "A shop sells 38 pens.", "2 + 2?"]
    prompts = [
        chat.encode_prompt([{"role": "system", "content": rules}, {"role": "user", "content": q}])
        for q in questions
    ]
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=5)
    follow = chat.encode_text("<|im_end|>\n<|im_start|>user\n42<|im_end|>\n")

    def play(feed):
        got = {i: [] for i in range(len(prompts))}

        def record(index, generation):
            got[index].append(generation)
            arriving = feed.as_they_come and index + 1 < len(prompts)
            if len(got[index]) == 1 and arriving:  # the next episode arrives
                feed.arrive(index + 1, prompts[index + 1])
            return None if len(got[index]) == 2 else follow

        stats = policy.generate_episodes(feed, sampling, record)
        return [[t.token_ids for t in got[i]] for i in range(len(prompts))], stats

    try:
        together, all_at_once = play(EpisodeFeed.of(prompts))
        feed = EpisodeFeed(len(prompts), schedule="as-they-come")
        feed.arrive(0, prompts[0])
        one_by_one, stats = play(feed)
    finally:
        tiny_policy.model.to(torch.float32)
    assert one_by_one == together
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    follows = sum(len(follow) + 1 for _ in prompts)  # the turn's last token leads each
    assert stats["prefill_tokens"] == sum(map(len, prompts)) - 3 * shared + follows
    assert all_at_once["prefill_tokens"] == sum(map(len, prompts)) - 3 * shared + follows


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "llama+lora"])
def test_later_turns_match_generate_ids_on_the_whole_sequence(tiny_policy, architecture):
    """KV caches kept across turns (and across re-arranged batches) give the turns that
    `generate_ids` gives from scratch on the whole sequence, for other architectures too
    (rotary and learned position embeddings), and through a peft wrapper (LoRA-GRPO)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from copes.agents.hf.kv_batch import cache_argument

    architecture, _, lora = architecture.partition("+")
    tokenizer = tiny_policy.tokenizer
    size = {"n_embd": 32, "n_layer": 2, "n_head": 2} if architecture == "gpt2" else {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64}  # fmt: skip
    config = AutoConfig.for_model(
        architecture, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, pad_token_id=tokenizer.pad_token_id, **size,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = HFPolicy(AutoModelForCausalLM.from_config(config), tokenizer)
    if lora:  # wrapped after the policy was made, as GRPO does
        peft = pytest.importorskip("peft")
        adapter = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        policy.model = peft.get_peft_model(policy.model, adapter).eval()
    assert policy.supports_episodes and cache_argument(policy.model) == "cache"
    questions = ["What is 12 * 34?", "Who wrote it? " * 6, "x"]
    prompts = [policy.chat.encode_prompt([{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingConfig(max_new_tokens=20, temperature=0.0)
    turns = []

    def tool_output(index, generation):  # episodes of different lengths and tool outputs
        turns.append(generation)
        return None if len(generation.prompt_token_ids) > 90 else [5, 6, 7, 8, 9][: 1 + 2 * index]

    policy.generate_episodes(prompts, greedy, tool_output)
    assert len(turns) > len(prompts)
    for turn in turns:
        assert policy.generate_ids([turn.prompt_token_ids], greedy)[0].token_ids == turn.token_ids


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0),
                                                       (1.3, 0, 0.8), (0.9, 10, 0.5)])  # fmt: skip
def test_filters_are_the_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    got = filtered_logits(logits, sampling)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.allclose(got[~got.isinf()], expected[~expected.isinf()])


def test_sampling_follows_the_distribution_and_its_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    rng = stream(0)
    tokens = sample_tokens(logits, SamplingConfig(temperature=1.0), [rng] * len(logits))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    top2 = sample_tokens(logits[:500], SamplingConfig(top_k=2), [rng] * 500)
    assert set(top2.tolist()) == {0, 1}
    nucleus = sample_tokens(logits[:500], SamplingConfig(top_p=0.6), [rng] * 500)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 alone is not 0.6 of the mass
