"""CoPES and ES: the update rule, its ablation flags, and learning on a known optimum."""

import numpy as np
import pytest
import torch

from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory
from copes.optimizers.configs import es_config
from copes.optimizers.es import CoPES, CoPESConfig, centered_ranks
from copes.weights import Perturbation, WeightSpace


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(40, 30, generator=gen)), ("b", torch.randn(77, generator=gen))]


def noise_of(member: Perturbation, like) -> torch.Tensor:
    """eps of one member over all coordinates (sigma 1, sign +1), from the engine's streams."""
    zeros = [(n, torch.zeros_like(t)) for n, t in like]
    probe = WeightSpace(zeros, chunk_size=256)
    probe.perturb(Perturbation(member.member, member.seed, member.subspace, 1, sigma=1.0))
    return torch.cat([t.reshape(-1) for _, t in probe.named_tensors()])


def flat(pairs):
    return torch.cat([t.reshape(-1) for _, t in pairs])


def test_k1_is_exactly_qiu_es_bit_for_bit():
    config = es_config(population_size=6, learning_rate=0.01, sigma=0.02, seed=3)
    theta = tensors()
    start = flat(theta).clone()
    space = WeightSpace(theta, chunk_size=256)
    opt = CoPES(config)
    members = opt.ask(0)
    rewards = [0.1, 0.5, 0.2, 0.9, 0.0, 0.4]
    opt.tell(0, members, rewards, space)

    # Qiu et al.: theta += alpha * (1/N) * sum_n z_n eps_n, z = (r - mean) / std
    r = np.asarray(rewards)
    z = (r - r.mean()) / r.std()
    acc = torch.zeros_like(start)
    for member, z_n in zip(members, z, strict=True):
        acc += float(z_n / len(r)) * noise_of(member, theta)
    reference = start + 0.01 * acc
    assert torch.equal(flat(theta), reference)  # bit-identical, not just close


def test_copes_update_matches_the_paper_formula():
    config = CoPESConfig(population_size=8, num_subspaces=4, learning_rate=0.01, seed=1)
    theta = tensors()
    start = flat(theta).clone()
    space = WeightSpace(theta, chunk_size=256)
    opt = CoPES(config)
    members = opt.ask(5)
    rewards = np.array([0.0, 1.0, 0.5, 0.5, 0.2, 0.8, 1.0, 0.0])
    opt.tell(5, members, rewards.tolist(), space)
    r_hat = (rewards - rewards.mean()) / rewards.std()  # joint: one mean, one std
    expected = torch.zeros_like(start)
    for member, rh in zip(members, r_hat, strict=True):
        # g_k = (1/N_k) sum_i r_hat eps_{k,i}, eps living on S_k only
        expected += float(rh / 2) * noise_of(member, theta)
    assert torch.allclose(flat(theta) - start, 0.01 * expected, atol=1e-6)


def test_members_subspaces_and_dimension_aware_sigma():
    opt = CoPES(CoPESConfig(population_size=12, num_subspaces=4, sigma=1e-3))
    members = opt.ask(0)
    assert [m.subspace.index for m in members] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert all(m.sigma == pytest.approx(2e-3) for m in members)  # sqrt(4) * sigma
    assert len({m.seed for m in members}) == 12
    assert members[0].subspace.partition_seed != opt.ask(1)[0].subspace.partition_seed
    unscaled = CoPES(CoPESConfig(population_size=12, num_subspaces=4, scale_sigma=False))
    assert unscaled.ask(0)[0].sigma == 1e-3


def test_antithetic_pairs_share_seeds_with_opposite_signs():
    members = CoPES(CoPESConfig(population_size=8, num_subspaces=2, antithetic=True)).ask(0)
    for a, b in zip(members[::2], members[1::2], strict=True):
        assert a.seed == b.seed and (a.sign, b.sign) == (1, -1) and a.subspace == b.subspace


def test_joint_versus_per_subspace_standardization():
    rewards = [0.0, 0.2, 0.8, 1.0]  # subspace 0 is worse than subspace 1
    joint = CoPES(CoPESConfig(population_size=4, num_subspaces=2)).coefficients(rewards)
    per = CoPES(
        CoPESConfig(population_size=4, num_subspaces=2, standardization="per_subspace")
    ).coefficients(rewards)
    assert joint[0] < 0 and joint[1] < 0  # joint keeps the cross-subspace ranking
    assert per[0] < 0 < per[1] and per[2] < 0 < per[3]  # per-subspace throws it away
    assert np.allclose(per[:2], per[2:])


def test_rank_shaping_and_constant_rewards():
    opt = CoPES(CoPESConfig(population_size=4, num_subspaces=1, rank_shaping=True))
    assert np.allclose(opt.coefficients([0.0, 100.0, 1.0, 2.0]), opt.coefficients([0, 3, 1, 2]))
    assert np.all(opt.coefficients([0.5] * 4) == 0)  # no signal, no update
    assert np.allclose(centered_ranks(np.array([3.0, 1.0, 2.0])), [0.5, -0.5, 0.0])
    assert np.allclose(centered_ranks(np.array([1.0, 1.0])), [0.0, 0.0])


def test_schedules():
    opt = CoPES(CoPESConfig(lr_schedule="linear", sigma_schedule="cosine", schedule_steps=10))
    assert opt.learning_rate_at(0) == pytest.approx(5e-4)
    assert opt.learning_rate_at(10) == pytest.approx(5e-5)
    assert opt.sigma_at(5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"population_size": 30, "num_subspaces": 4}, "divisible"),
        ({"sigma": 0.0}, "sigma"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"population_size": 1, "num_subspaces": 1}, ">= 2"),
        ({"population_size": 6, "num_subspaces": 2, "antithetic": True}, "even"),
    ],
)
def test_invalid_settings_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CoPESConfig(**kwargs)


def test_more_subspaces_than_coordinates_is_an_error():
    space = WeightSpace([("w", torch.zeros(3))])
    opt = CoPES(CoPESConfig(population_size=8, num_subspaces=4))
    with pytest.raises(ValueError, match="coordinates"):
        opt.tell(0, opt.ask(0), [0.0] * 8, space)


def test_state_dict_round_trip_and_replay():
    config = CoPESConfig(population_size=8, num_subspaces=2, seed=4)
    live, replayed = tensors(), tensors()
    opt = CoPES(config)
    space = WeightSpace(live)
    log = []
    for step in range(3):
        rewards = list(np.random.default_rng(step).random(8))
        opt.tell(step, opt.ask(step), rewards, space)
        log.append({"step": step, "rewards": rewards})
    fresh = CoPES()
    fresh.load_state_dict(opt.state_dict())
    assert fresh.config == config and fresh.step_count == 3
    CoPES(config).replay(log, WeightSpace(replayed))
    assert torch.equal(flat(live), flat(replayed))


class ToyPolicy:
    """A tiny real Qwen2 LM; reward = p(target token | prompt): a known optimum at 1."""

    def __init__(self):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        )  # fmt: skip
        self.model = Qwen2ForCausalLM(config).eval()
        self.space = WeightSpace.from_module(self.model)
        self.prompt = torch.tensor([[1, 5, 9]])
        self.target = 7

    def weights(self):
        return self.space

    def reward(self):
        with torch.no_grad():
            logits = self.model(self.prompt).logits[0, -1]
        return torch.softmax(logits, -1)[self.target].item()

    def rollout(self, policy, step, member=None):
        traj = Trajectory("toy", [], [], [], [], 0, reward=self.reward())
        return RolloutBatch([traj], RolloutStats())


@pytest.mark.parametrize("num_subspaces", [1, 4])
def test_es_and_copes_learn_a_known_optimum(num_subspaces):
    toy = ToyPolicy()
    before = toy.reward()
    config = CoPESConfig(
        population_size=16, num_subspaces=num_subspaces, sigma=0.05, learning_rate=0.2, seed=0
    )
    opt = CoPES(config)
    for _ in range(25):
        stats = opt.step(toy, toy.rollout)
    assert stats.metrics["reward_mean"] >= 0
    assert toy.reward() > before + 0.3, (before, toy.reward())
