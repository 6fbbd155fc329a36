"""The low-rank noise family of `WeightSpace`: rank-r deltas per matrix inside a row
subspace, regenerated from seeds, with the same restore/update/shard contracts as the
full-rank family."""

import math

import numpy as np
import pytest
import torch

from copes.optimizers.configs import CoPESConfig
from copes.optimizers.es import CoPES
from copes.weights import Perturbation, Shard, Subspace, WeightSpace


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(40, 12, generator=gen, dtype=torch.float32)),
        ("norm.weight", torch.ones(12, dtype=torch.float32)),
        ("proj.weight", torch.randn(24, 12, generator=gen, dtype=torch.float32)),
        ("proj.bias", torch.zeros(24, dtype=torch.float32)),
    ]


def _space(tensors=None, **kwargs) -> WeightSpace:
    return WeightSpace(tensors or _tensors(), **kwargs)


def _delta(space: WeightSpace, member: Perturbation) -> dict[str, torch.Tensor]:
    before = {n: t.clone() for n, t in space.named_tensors()}
    space.perturb(member)
    delta = {n: t - before[n] for n, t in space.named_tensors()}
    space.restore()
    return delta


def test_member_delta_is_rank_r_inside_its_rows_and_vectors_hold_still():
    space = _space()
    subspace = Subspace(partition_seed=3, num_subspaces=4, index=1)
    member = Perturbation(0, seed=11, subspace=subspace, sigma=0.1, rank=2)
    delta = _delta(space, member)
    assert not delta["norm.weight"].any() and not delta["proj.bias"].any()
    for name in ("embed.weight", "proj.weight"):
        rows = space.row_mask(name, subspace)
        assert delta[name][~rows].abs().max() == 0  # nothing outside the subspace's rows
        assert delta[name][rows].abs().min() > 0
        assert torch.linalg.matrix_rank(delta[name], rtol=1e-4) == 2
    factors = space.low_rank_factors(member)  # what an adapter serves: the same delta
    for name, (a, b) in factors.items():
        torch.testing.assert_close(a @ b.T, delta[name], rtol=0, atol=1e-6)


def test_row_subspaces_partition_every_matrix_row_and_are_equal_in_size():
    space = _space()
    k = 4
    masks = [
        torch.cat([space.row_mask(n, Subspace(5, k, i)) for n in ("embed.weight", "proj.weight")])
        for i in range(k)
    ]
    stacked = torch.stack(masks)
    assert torch.equal(stacked.sum(0), torch.ones(64, dtype=torch.long))  # disjoint, covering
    assert [int(m.sum()) for m in masks] == [16] * k  # 64 rows dealt 4 ways, across matrices
    assert space.num_matrix_rows == 64


def test_noise_is_unit_scale_and_regenerated_from_the_seed():
    big = [("w", torch.zeros(256, 512))]
    space = _space(big)
    member = Perturbation(0, seed=5, sigma=1.0, rank=4)
    delta = _delta(space, member)["w"]
    assert abs(float(delta.std()) - 1.0) < 0.1  # A B^T / sqrt(r): entries of variance 1
    assert torch.equal(delta, _delta(_space(big), member)["w"])  # same seed, fresh space
    other = _delta(space, Perturbation(0, seed=6, sigma=1.0, rank=4))["w"]
    assert not torch.equal(delta, other)


def test_restore_is_exact_and_update_is_the_coefficient_sum_of_the_deltas():
    space = _space()
    original = {n: t.clone() for n, t in space.named_tensors()}
    members = [
        Perturbation(m, seed=100 + m, subspace=Subspace(9, 2, m % 2), sigma=1.0, rank=3)
        for m in range(4)
    ]
    deltas = [_delta(space, m) for m in members]
    for name, tensor in space.named_tensors():
        assert torch.equal(tensor, original[name])
    coefficients = [0.5, -1.0, 0.25, 2.0]
    space.update(members, coefficients, learning_rate=0.1)
    for name, tensor in space.named_tensors():
        moved = sum(c * d[name] for c, d in zip(coefficients, deltas, strict=True))
        expected = original[name] + 0.1 * moved
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6)


def test_antithetic_sign_mirrors_the_delta():
    space = _space()
    plus = _delta(space, Perturbation(0, seed=3, sign=1, sigma=0.2, rank=1))
    minus = _delta(space, Perturbation(1, seed=3, sign=-1, sigma=0.2, rank=1))
    for name in plus:
        torch.testing.assert_close(plus[name], -minus[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dim", [0, 1])
def test_shards_apply_exactly_the_part_of_the_full_delta_they_hold(dim):
    full = torch.randn(24, 12, dtype=torch.float32)
    member = Perturbation(0, seed=4, subspace=Subspace(2, 3, 2), sigma=0.3, rank=2)
    whole = _delta(_space([("w", full.clone())]), member)["w"]
    start, stop = (8, 16) if dim == 0 else (4, 10)
    part = full.narrow(dim, start, stop - start).contiguous()
    shard = Shard(full_shape=(24, 12), dim=dim, start=start, stop=stop)
    space = _space([("w", part.clone())], shards={"w": shard})
    local = _delta(space, member)["w"]
    torch.testing.assert_close(local, whole.narrow(dim, start, stop - start), rtol=0, atol=1e-6)
    space.update([member], [1.0], learning_rate=1.0)  # update lands on the same coordinates
    torch.testing.assert_close(space.named_tensors()[0][1] - part, local / 0.3, rtol=0, atol=1e-6)


def test_copes_asks_low_rank_members_and_replays_bit_exactly():
    config = CoPESConfig(
        population_size=8, num_subspaces=4, sigma=0.05, learning_rate=0.1, noise="lowrank",
        noise_rank=2,
    )  # fmt: skip
    opt = CoPES(config)
    members = opt.ask(0)
    assert {m.rank for m in members} == {2}
    assert members[0].sigma == pytest.approx(0.05 * math.sqrt(4))
    space, replica = _space(), _space()
    rewards = np.linspace(0.0, 1.0, 8)
    opt.tell(0, members, rewards, space)
    CoPES(config).replay([{"step": 0, "rewards": rewards.tolist()}], replica)
    assert space.checksum() == replica.checksum() != _space().checksum()
    # the 1-D tensors never moved
    for (_, tensor), (_, start) in zip(space.named_tensors(), _tensors(), strict=True):
        if tensor.dim() == 1:
            assert torch.equal(tensor, start)


def test_config_rejects_bad_noise_settings_and_too_many_subspaces_for_the_rows():
    with pytest.raises(ValueError, match="noise must be full or lowrank"):
        CoPESConfig(noise="sparse")
    with pytest.raises(ValueError, match="noise_rank must be >= 1"):
        CoPESConfig(noise="lowrank", noise_rank=0)
    opt = CoPES(CoPESConfig(population_size=8, num_subspaces=8, noise="lowrank"))
    tiny = WeightSpace([("w", torch.zeros(4, 64)), ("b", torch.zeros(64))])
    with pytest.raises(ValueError, match="only 4 matrix rows"):
        opt.tell(0, opt.ask(0), np.arange(8.0), tiny)
    assert CoPESConfig().perturbation_rank == 0  # the paper's full-rank noise by default
