"""The weight-space engine: seeded noise, exact subspaces, exact restore, fp32 updates."""

import math

import pytest
import torch

from copes.optimizers.perturb import (
    Perturbation,
    Subspace,
    WeightSpace,
    derive_seed,
    sigma_for_subspaces,
)


def make_tensors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        ("layer.weight", torch.randn(37, 23, generator=gen).to(dtype)),
        ("layer.bias", torch.randn(23, generator=gen).to(dtype)),
        ("head.weight", torch.randn(5, 101, generator=gen).to(dtype)),
    ]


def flat(space_tensors):
    return torch.cat([t.detach().float().reshape(-1) for _, t in space_tensors])


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_subspaces_are_disjoint_equal_and_cover_everything(k):
    tensors = make_tensors()
    space = WeightSpace(tensors, chunk_size=64)
    masks = [
        torch.cat([space.subspace_mask(n, Subspace(7, k, i)).reshape(-1) for n, _ in tensors])
        for i in range(k)
    ]
    counts = torch.stack(masks).sum(0)
    assert torch.equal(counts, torch.ones_like(counts))  # disjoint and covering
    sizes = [int(m.sum()) for m in masks]
    assert max(sizes) - min(sizes) <= 1  # equal (exactly, when k divides d)
    assert sizes == space.subspace_sizes(7, k)
    if space.num_coordinates % k == 0:
        assert len(set(sizes)) == 1


def test_partition_is_random_per_step_and_replayable():
    space = WeightSpace(make_tensors(), chunk_size=64)
    a = space.subspace_mask("layer.weight", Subspace(1, 4, 0))
    assert torch.equal(a, space.subspace_mask("layer.weight", Subspace(1, 4, 0)))
    assert not torch.equal(a, space.subspace_mask("layer.weight", Subspace(2, 4, 0)))


def test_perturbation_stays_inside_its_subspace_and_restore_is_exact():
    tensors = make_tensors()
    before = flat(tensors).clone()
    space = WeightSpace(tensors, chunk_size=50)
    sub = Subspace(3, 4, 2)
    space.perturb(Perturbation(member=0, seed=11, subspace=sub, sigma=0.1))
    mask = torch.cat([space.subspace_mask(n, sub).reshape(-1) for n, _ in tensors])
    diff = flat(tensors) - before
    assert torch.all(diff[~mask] == 0)
    assert torch.all(diff[mask] != 0)
    space.restore()
    assert torch.equal(flat(tensors), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_restore_is_bit_exact(dtype):
    tensors = make_tensors(dtype)
    originals = [t.clone() for _, t in tensors]
    space = WeightSpace(tensors, chunk_size=128)
    for seed in range(5):
        space.perturb(Perturbation(member=seed, seed=seed, sigma=0.02))
        space.restore()
    for (_, t), o in zip(tensors, originals, strict=True):
        assert torch.equal(t, o) and t.dtype == dtype


def test_noise_is_gaussian_seeded_and_independent_of_tensor_order():
    a = WeightSpace([("x", torch.zeros(20000)), ("y", torch.zeros(300))], chunk_size=4096)
    a.perturb(Perturbation(member=0, seed=5, sigma=1.0))
    x = dict(a.master_state())  # master untouched by perturb
    assert torch.all(x["x"] == 0)
    noise_x = a.named_tensors()[0][1].clone()
    assert abs(noise_x.mean().item()) < 0.05 and abs(noise_x.std().item() - 1) < 0.05
    b = WeightSpace([("y", torch.zeros(300)), ("x", torch.zeros(20000))], chunk_size=4096)
    b.perturb(Perturbation(member=0, seed=5, sigma=1.0))
    assert torch.equal(b.named_tensors()[1][1], noise_x)
    c = WeightSpace([("x", torch.zeros(20000))], chunk_size=4096)
    c.perturb(Perturbation(member=0, seed=6, sigma=1.0))
    assert not torch.equal(c.named_tensors()[0][1], noise_x)


def test_update_is_weighted_sum_of_regenerated_noise():
    tensors = make_tensors()
    before = flat(tensors).clone()
    space = WeightSpace(tensors, chunk_size=64)
    members = [
        Perturbation(0, 101, Subspace(9, 2, 0)),
        Perturbation(1, 102, Subspace(9, 2, 1)),
        Perturbation(2, 103, sign=-1),
    ]
    coefficients = [0.5, -1.0, 2.0]
    expected = torch.zeros_like(before)
    for p, c in zip(members, coefficients, strict=True):
        probe = WeightSpace([(n, torch.zeros_like(t)) for n, t in tensors], chunk_size=64)
        probe.perturb(Perturbation(p.member, p.seed, p.subspace, p.sign, sigma=1.0))
        expected += c * flat(probe.named_tensors())
    space.update(members, coefficients, learning_rate=0.01)
    assert torch.allclose(flat(tensors) - before, 0.01 * expected, atol=1e-6)


def test_fp32_update_is_not_lost_on_bf16_weights():
    weights = torch.ones(4096, dtype=torch.bfloat16)
    space = WeightSpace([("w", weights)], chunk_size=1024)
    member = Perturbation(0, seed=1)
    for _ in range(200):  # each step moves weights by ~1e-5: below half an ulp of bf16 at 1.0
        space.update([member], [1.0], learning_rate=1e-5)
    moved = space.master_state()["w"] - 1.0
    assert moved.abs().mean().item() > 1e-3  # 200 * 1e-5 * E|eps| ~ 1.6e-3
    assert (weights.float() != 1.0).any()  # and the bf16 working copy follows the master


def test_checksum_and_master_state_round_trip():
    a = WeightSpace(make_tensors(), chunk_size=64)
    b = WeightSpace(make_tensors(), chunk_size=64)
    assert a.checksum() == b.checksum()
    a.update([Perturbation(0, 1)], [1.0], 1e-3)
    assert a.checksum() != b.checksum()
    b.load_master_state({k: v.clone() for k, v in a.master_state().items()})
    assert a.checksum() == b.checksum()


def test_errors_and_helpers():
    with pytest.raises(ValueError, match="unique"):
        WeightSpace([("a", torch.zeros(2)), ("a", torch.zeros(2))])
    with pytest.raises(TypeError, match="floating"):
        WeightSpace([("i", torch.zeros(2, dtype=torch.long))])
    with pytest.raises(ValueError, match="index"):
        Subspace(0, 4, 4)
    assert derive_seed(1, "a") == derive_seed(1, "a") != derive_seed(1, "b")
    assert sigma_for_subspaces(1e-3, 4) == pytest.approx(2e-3)
    assert sigma_for_subspaces(1e-3, 4, scale=False) == 1e-3
    assert math.isclose(sigma_for_subspaces(1.0, 1), 1.0)
