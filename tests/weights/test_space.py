"""The weight-space engine: seeded noise, exact subspaces, exact restore, fp32 updates."""

import math

import pytest
import torch

from copes.seeding import derive_seed
from copes.weights import (
    KEEP_PARTITION_BYTES,
    Perturbation,
    Shard,
    Subspace,
    WeightSpace,
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


@pytest.mark.parametrize("keep_partition_bytes", [KEEP_PARTITION_BYTES, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_members_in_one_space_equal_each_member_in_a_fresh_one(dtype, keep_partition_bytes):
    """`perturb` keeps the step's partition (or, too large for that, the current subspace's
    positions) for the next members: bit for bit what drawing everything anew gives, whatever
    order the subspaces come in, and a later step's partition replaces it."""
    members = [Perturbation(m, 200 + m // 2, Subspace(7 + m // 8, 3, k), 1 - 2 * (m % 2), 0.1)
               for m, k in enumerate([0, 0, 1, 1, 2, 2, 0, 1, 2, 0])]  # fmt: skip
    tensors = make_tensors(dtype)
    space = WeightSpace(tensors, chunk_size=64, keep_partition_bytes=keep_partition_bytes)
    for member in members:
        space.perturb(member)
        fresh = make_tensors(dtype)
        WeightSpace(fresh, chunk_size=64, keep_partition_bytes=0).perturb(member)
        assert torch.equal(flat(tensors), flat(fresh)), member
        space.restore()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_with_its_partition_kept_equals_one_keeping_a_subspace_at_a_time(dtype):
    """Members then the update, twice: the space keeping the whole partition (d int32) and one
    keeping only the current subspace's positions (d / K) hold bit-identical weights, and
    neither keeps anything once its step is updated."""
    d = sum(t.numel() for _, t in make_tensors())
    spaces, weights = [], []
    for keep in (KEEP_PARTITION_BYTES, 4 * d - 1):  # 4 * d - 1: the partition does not fit
        tensors = make_tensors(dtype)
        space = WeightSpace(tensors, chunk_size=64, keep_partition_bytes=keep)
        for step in range(2):
            members = [Perturbation(m, 10 * step + m, Subspace(step, 4, m // 2), 1 - 2 * (m % 2),
                                    sigma=0.1) for m in range(8)]  # fmt: skip
            for member in members:
                space.perturb(member)
                space.restore()
            kept = space.kept_bytes()
            space.update(members, [0.3, -1.0, 2.0, 0.5, -0.2, 1.1, 0.7, -0.4], learning_rate=0.01)
            assert space.kept_bytes() == 0
        spaces.append((kept, space.checksum()))
        weights.append(flat(tensors))
    (whole, whole_sum), (last, last_sum) = spaces
    assert whole == 4 * d  # the whole partition; the other: its last subspace's positions
    assert last == 4 * WeightSpace(make_tensors(), chunk_size=64).subspace_sizes(1, 4)[3]
    assert whole_sum == last_sum and torch.equal(weights[0], weights[1])


def test_an_update_draws_each_partition_once_and_sums_every_members_noise_exactly():
    """Members of two partitions (one update): the master moves by lr x the sum of each
    member's regenerated noise, accumulated in member order, bit for bit."""
    members = [Perturbation(m, 300 + m, Subspace(7 + m % 2, 2, m // 2 % 2), sigma=0.1)
               for m in range(6)]  # fmt: skip
    coefficients = [0.5, -1.0, 2.0, 0.0, 1.5, -0.5]
    tensors = make_tensors()
    before = flat(tensors).clone()
    WeightSpace(tensors, chunk_size=64).update(members, coefficients, learning_rate=0.01)
    total = torch.zeros_like(before)
    for p, c in zip(members, coefficients, strict=True):
        if c == 0.0:
            continue
        probe = WeightSpace([(n, torch.zeros_like(t)) for n, t in make_tensors()], chunk_size=64)
        probe.perturb(Perturbation(p.member, p.seed, p.subspace, p.sign, sigma=1.0))
        total += c * flat(probe.named_tensors())
    assert torch.equal(flat(tensors), before + 0.01 * total)


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


def test_row_slice_views_of_a_fused_tensor_are_updated_in_place():
    fused = torch.randn(10, 6)  # like vLLM's qkv_proj: q rows then k rows
    original = fused.clone()
    space = WeightSpace([("q", fused[0:6]), ("k", fused[6:10])], chunk_size=16)
    space.perturb(Perturbation(0, seed=3, sigma=0.1))
    assert not torch.equal(fused, original)  # the writes landed in the fused storage
    space.restore()
    assert torch.equal(fused, original)
    with pytest.raises(ValueError, match="contiguous"):
        WeightSpace([("t", torch.randn(4, 6).t())])


def _sharded(full, dim, parts, chunk_size):
    """One WeightSpace per tensor-parallel rank, each holding `full` tensors' slices."""
    spaces = []
    for rank in range(parts):
        tensors, shards = [], {}
        for name, tensor in full:
            if tensor.dim() == 2 or dim == 0:
                size = tensor.shape[dim] // parts
                start, stop = rank * size, (rank + 1) * size
                local = tensor.narrow(dim, start, size).contiguous()
                shards[name] = Shard(tuple(tensor.shape), dim, start, stop)
            else:  # a replicated bias next to column-sharded weights
                local = tensor.clone()
            tensors.append((name, local))
        spaces.append(WeightSpace(tensors, chunk_size=chunk_size, shards=shards))
    return spaces


def _gather(spaces, names, dim, full):
    out = {}
    for i, (name, tensor) in enumerate(full):
        parts = [s.named_tensors()[i][1] for s in spaces]
        out[name] = torch.cat(parts, dim) if parts[0].shape != tensor.shape else parts[0]
        assert names[i] == name
    return out


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("k", [1, 3])
def test_shards_see_exactly_the_full_tensors_perturbation_and_update(dim, k):
    gen = torch.Generator().manual_seed(1)
    full = [("w", torch.randn(12, 10, generator=gen)), ("b", torch.randn(12, generator=gen))]
    reference = WeightSpace([(n, t.clone()) for n, t in full], chunk_size=37)
    spaces = _sharded(full, dim, 2, chunk_size=37)
    assert all(s.num_coordinates == reference.num_coordinates for s in spaces)
    member = Perturbation(0, seed=9, subspace=Subspace(4, k, k - 1), sigma=0.5)
    for space in (reference, *spaces):
        space.perturb(member)
    names = [n for n, _ in full]
    gathered = _gather(spaces, names, dim, full)
    for name, tensor in reference.named_tensors():
        assert torch.equal(gathered[name], tensor), name
    members = [member, Perturbation(1, seed=10, subspace=Subspace(4, k, 0), sign=-1)]
    for space in (reference, *spaces):
        space.update(members, [0.7, -1.3], learning_rate=0.05)
    gathered = _gather(spaces, names, dim, full)
    for name, tensor in reference.named_tensors():
        assert torch.equal(gathered[name], tensor), name
    local_mask = spaces[1].subspace_mask("w", member.subspace)
    full_mask = reference.subspace_mask("w", member.subspace)
    start = 6 if dim == 0 else 5
    assert torch.equal(local_mask, full_mask.narrow(dim, start, local_mask.shape[dim]))


def test_shard_validation():
    with pytest.raises(ValueError, match="outside"):
        Shard((4, 4), 0, 2, 6)
    with pytest.raises(ValueError, match="expects"):
        WeightSpace([("w", torch.zeros(3, 4))], shards={"w": Shard((4, 4), 0, 0, 2)})
    with pytest.raises(ValueError, match="not in the space"):
        WeightSpace([("w", torch.zeros(3, 4))], shards={"v": Shard((4, 4), 0, 0, 2)})
