"""Population evaluation across Ray actors: only seeds and rewards on the wire.

Every ES member is a pure function of (seed, step) (`CoPES.ask`), so W policy replicas, each in
a Ray actor (`ReplicaWorker`: a transformers model today, one vLLM engine per GPU later), share
each step's population. The driver (`RayPopulation`) hands (step, member) to whichever actor is
free; the actor perturbs, rolls out the member's task batch with the same `TaskRollout` as one
process would, restores, and returns a `MemberResult`. Then every actor, and the driver's own
replica (the reference: checkpoints, validation, checksums), applies the same `tell`. A dead
actor's member is re-run elsewhere, and a replacement rebuilds its weights from the latest
checkpoint plus the seed log. Design, payload sizes and recipes: docs/scaling.md.

Ray is optional (`pip install "copes[ray]"`) and `copes.optimizers` never imports it: the
trainer chooses this evaluator with `--workers`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from copes.optimizers.base import MemberResult
from copes.optimizers.es import CoPES, evaluate_member
from copes.weights import Perturbation

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.optimizers.configs import CoPESConfig
    from copes.train.task_rollout import TaskRollout

logger = logging.getLogger(__name__)

PolicyFactory = Callable[[str], "Policy"]  # a model folder (or hub id) -> a policy replica


class ReplicaMismatchError(RuntimeError):
    """Replicas that applied the same updates hold different weights."""


def import_ray() -> Any:
    """Ray, or an error that says how to get it (it is an optional extra)."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'training with --workers needs Ray, which is not installed: pip install "copes[ray]" '
            "(or use --workers 0 to evaluate the population in this process)"
        ) from exc
    return ray


@dataclass
class ReplicaSpec:
    """How to build one replica; sent once to every actor (paths and settings, no weights).

    Args:
        policy_factory: builds a policy from a model folder or hub id; called with
            `model_path` or with a checkpoint folder when an actor is rebuilt. Pluggable so a
            vLLM-engine-per-GPU replica needs only another factory.
        model_path: the initial model (the same folder or hub id on every node).
        rollout_factory: builds the run's training `TaskRollout` (tasks, envs, sampling),
            so every actor chooses exactly the tasks the one-process loop would.
        optimizer_config: the driver's `CoPESConfig` (members and updates follow from it).
        cpus_per_worker, gpus_per_worker: Ray resources of one actor (one placement-group
            bundle); gpus_per_worker = 1 is one replica per GPU.
        torch_threads: torch intra-op threads inside an actor (1 on shared CPUs).
    """

    policy_factory: PolicyFactory
    model_path: str
    rollout_factory: Callable[[], TaskRollout]
    optimizer_config: CoPESConfig
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    torch_threads: int = 1


class ReplicaWorker:
    """One policy replica in a Ray actor: evaluates members and applies every update.

    Built at the weights of the start of `step` (after steps 0..step-1): from
    `checkpoint` if that folder is readable here, else from the initial model, then the
    logged rewards of the later steps are replayed (updates only, no rollouts).
    """

    def __init__(
        self,
        spec: ReplicaSpec,
        checkpoint: tuple[str, int] | None,
        history: dict[int, list[float]],
        step: int,
    ) -> None:
        import torch

        torch.set_num_threads(spec.torch_threads)
        source, first = spec.model_path, 0
        if checkpoint is not None and Path(checkpoint[0]).is_dir():
            source, first = checkpoint
        missing = [s for s in range(first, step) if s not in history]
        if missing:
            raise RuntimeError(
                f"cannot rebuild a replica: no logged rewards for steps {missing[:5]} after "
                f"{source}; is the run's es_log.jsonl complete?"
            )
        self.policy = spec.policy_factory(source)
        if source != spec.model_path:
            from copes.checkpoint import load_master_state

            master = load_master_state(Path(source))
            if master is not None:  # the fp32 master a bf16 checkpoint cannot hold
                self.policy.weights().load_master_state(master)
        self.optimizer = CoPES(spec.optimizer_config)
        entries = [{"step": s, "rewards": history[s]} for s in range(first, step)]
        self.optimizer.replay(entries, self.policy.weights())
        self.rollout = spec.rollout_factory()
        self._members: tuple[int, list[Perturbation]] | None = None
        self.built_from = {"source": source, "replayed_steps": len(entries), "pid": os.getpid()}

    def info(self) -> dict[str, Any]:
        """Where this replica came from and its process id (also a readiness probe)."""
        return self.built_from

    def evaluate(self, step: int, member: int) -> MemberResult:
        if self._members is None or self._members[0] != step:
            self._members = (step, self.optimizer.ask(step))
        return evaluate_member(self.policy, self.rollout, self._members[1][member], step)

    def tell(self, step: int, rewards: list[float]) -> None:
        self.optimizer.tell(step, self.optimizer.ask(step), rewards, self.policy.weights())

    def checksum(self) -> str:
        return self.policy.weights().checksum()

    def close(self) -> None:
        self.rollout.close()


class RayPopulation:
    """Evaluates ES/CoPES populations on W Ray actors; the trainer's `--workers W`.

    Built where the run is built and given to the optimizer then; Ray starts (a local
    cluster, or `address`), the placement group is reserved and the actors are created on
    the first step (`start`), after the run was accepted.

    Args:
        spec: how every actor builds its replica.
        policy: the driver's policy, whose weights the replicas must match (checksums).
        workers: W, the number of actors (one placement-group bundle each).
        run_dir: the run folder; replacements rebuild from its latest checkpoint, and a
            resumed run's actors start from it plus `es_log.jsonl`.
        address: a Ray cluster to join; None starts a local one (unless Ray is already up).
        checksum_every: compare every replica's checksum with the driver's every M steps
            (and after any replacement); 0 only at start.
        max_member_failures: a member whose evaluation killed this many actors is an error
            (a deterministic crash, e.g. out of memory), not a fault to retry forever.
    """

    def __init__(
        self,
        spec: ReplicaSpec,
        policy: Policy,
        workers: int,
        run_dir: str | Path,
        address: str | None = None,
        checksum_every: int = 10,
        max_member_failures: int = 2,
        ready_timeout: float = 600.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.ray = import_ray()  # a missing install fails now, before the run starts
        self.spec = spec
        self._policy = policy
        self.num_workers = workers
        self.run_dir = Path(run_dir)
        self.address = address
        self.checksum_every = checksum_every
        self.max_member_failures = max_member_failures
        self.ready_timeout = ready_timeout
        self.restarts = 0
        self.rebuilds: list[dict[str, Any]] = []  # built_from of every replacement actor
        self._owns_ray = False
        self._group: Any = None  # the placement group, reserved by `start`
        self._workers: list[Any] = []
        self._history: dict[int, list[float]] = {}  # step -> rewards: what replicas replay
        self._steps_applied = 0  # the replicas hold the weights after this many steps
        self._tells: dict[Any, int] = {}  # the current step's pending tells
        self._restarts_before = 0
        self._evaluate_seconds = 0.0

    def _connect(self) -> None:
        """Start (or join) Ray and reserve one placement-group bundle per worker."""
        ray, workers = self.ray, self.num_workers
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(
                address=self.address,
                num_cpus=None if self.address else max(1, int(workers * self.spec.cpus_per_worker)),
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        try:
            self._group = self._reserve(workers, local=self._owns_ray and self.address is None)
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False
            raise
        self._actor_class = ray.remote(ReplicaWorker)

    # ------------------------------------------------------------------ actors
    def _reserve(self, workers: int, local: bool) -> Any:
        """A placement group of one bundle per worker, reserved before any actor starts."""
        from ray.util.placement_group import placement_group

        ray, spec = self.ray, self.spec
        bundle = {"CPU": spec.cpus_per_worker}
        if spec.gpus_per_worker:
            bundle["GPU"] = spec.gpus_per_worker
        if local:  # a local cluster will not grow: say so now, not after a timeout
            have = ray.cluster_resources()
            short = [k for k, v in bundle.items() if v * workers > have.get(k, 0)]
            if short:
                raise RuntimeError(
                    f"{workers} workers need {bundle} each but this machine offers {have} "
                    f"(short of {short}); lower --workers or join a cluster with --ray-address"
                )
        group = placement_group([bundle] * workers, strategy="PACK")  # fill a node, then the next
        if not self._wait(group.ready(), timeout=self.ready_timeout):
            raise RuntimeError(
                f"Ray could not reserve {workers} workers of {bundle} each within "
                f"{self.ready_timeout:.0f} s; the cluster has {ray.cluster_resources()}. Lower "
                "--workers, or add nodes/GPUs to the cluster."
            )
        return group

    def _wait(self, ref: Any, timeout: float) -> bool:
        ready, _ = self.ray.wait([ref], timeout=timeout)
        return bool(ready)

    def _create(self, slot: int) -> Any:
        """A new actor in placement-group bundle `slot`, at the weights of the current step."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import copes
        from copes.checkpoint import latest_checkpoint, load_state

        # Actors import the driver's copes: prepend its source root (an editable checkout or
        # site-packages; a folder missing on another node is simply ignored there).
        root = str(Path(copes.__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        checkpoint = latest_checkpoint(self.run_dir)
        base = (
            None if checkpoint is None else (str(checkpoint), int(load_state(checkpoint)["step"]))
        )
        actor = self._actor_class.options(
            num_cpus=self.spec.cpus_per_worker,
            num_gpus=self.spec.gpus_per_worker,
            max_restarts=0,  # replaced by hand: a restarted actor must rebuild its weights
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, slot),
            # Ray runs workers at nice 15; these do the run's compute, so give them the
            # driver's priority (one-process rollouts run at 0) and one OpenMP thread each.
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": pythonpath,
                    "OMP_NUM_THREADS": str(self.spec.torch_threads),
                    "RAY_worker_niceness": "0",
                }
            },
        )
        return actor.remote(self.spec, base, self._history, self._steps_applied)

    def start(self, step: int, checksum: str | None = None) -> None:
        """Start Ray, create the W actors at the weights of the start of `step` and wait for
        them; with the driver's `checksum`, check that they rebuilt exactly its weights."""
        from copes.run_log import read_jsonl

        if self._group is None:
            self._connect()
        log = self.run_dir / "es_log.jsonl"
        entries = read_jsonl(log) if log.exists() else []
        self._history = {int(e["step"]): e["rewards"] for e in entries if e["step"] < step}
        self._steps_applied = step
        self._workers = [self._create(slot) for slot in range(self.num_workers)]
        infos = self.ray.get([w.info.remote() for w in self._workers], timeout=self.ready_timeout)
        logger.info("%d Ray workers ready: %s", self.num_workers, infos)
        if checksum is not None:
            self.verify(checksum, step - 1 if step else None)

    def _replace(self, slot: int) -> Any:
        """Kill what is left of the actor in `slot` and start its replacement; its ready ref."""
        self.restarts += 1
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(self._workers[slot], no_restart=True)
        self._workers[slot] = self._create(slot)
        return self._workers[slot].info.remote()

    def _is_death(self, exc: BaseException) -> bool:
        return isinstance(exc, self.ray.exceptions.RayActorError)

    def worker_pids(self) -> list[int]:
        """Process id of every live actor (for monitoring and the fault-tolerance test)."""
        return [info["pid"] for info in self.ray.get([w.info.remote() for w in self._workers])]

    # ------------------------------------------------------------------ one step
    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        """A `PopulationEvaluator`: the members on the actors (started on first use); the
        replicas get the step's rewards at once, to apply while the driver does."""
        policy = self._policy
        if not self._workers:
            self.start(step, policy.weights().checksum())
        if self._steps_applied != step:
            raise RuntimeError(
                f"the workers are at step {self._steps_applied} but the optimizer is at {step}"
            )
        self._restarts_before = self.restarts
        start = time.perf_counter()
        results = self._evaluate(step, len(members))
        self._evaluate_seconds = time.perf_counter() - start
        rewards = [r.reward for r in results]
        self._history[step] = rewards  # before the tells: a replacement now replays this step
        self._steps_applied = step + 1
        self._tells = {
            self._workers[slot].tell.remote(step, rewards): slot
            for slot in range(len(self._workers))
        }
        return results

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        """The driver applied `step`: wait for the replicas, compare checksums when due."""
        self._finish_tells(self._tells)
        if self.restarts != self._restarts_before or (
            self.checksum_every and (step + 1) % self.checksum_every == 0
        ):
            self.verify(self._policy.weights().checksum(), step)
        return {
            "workers": self.num_workers,
            "worker_restarts": self.restarts,
            "population_seconds": self._evaluate_seconds,
        }

    def _evaluate(self, step: int, population_size: int) -> list[MemberResult]:
        """Hand members to free actors one at a time; re-run the members of dead actors."""
        ray = self.ray
        queue = deque(range(population_size))
        idle = deque(range(len(self._workers)))
        running: dict[Any, tuple[int, int]] = {}  # result ref -> (slot, member)
        starting: dict[Any, int] = {}  # replacement's ready ref -> slot
        failures: dict[int, int] = {}
        results: dict[int, MemberResult] = {}
        while len(results) < population_size:
            while queue and idle:
                slot, member = idle.popleft(), queue.popleft()
                running[self._workers[slot].evaluate.remote(step, member)] = (slot, member)
            (ref,), _ = ray.wait([*running, *starting], num_returns=1)
            if ref in starting:
                slot = starting.pop(ref)
                try:
                    info = ray.get(ref)
                except Exception as exc:
                    if not self._is_death(exc):
                        raise
                    starting[self._replace(slot)] = slot  # died while starting: again
                    continue
                self.rebuilds.append(info)
                logger.warning("worker %d replaced: %s", slot, info)
                idle.append(slot)
                continue
            slot, member = running.pop(ref)
            try:
                results[member] = ray.get(ref)
                idle.append(slot)
            except Exception as exc:
                if not self._is_death(exc):
                    raise
                failures[member] = failures.get(member, 0) + 1
                if failures[member] >= self.max_member_failures:
                    raise RuntimeError(
                        f"member {member} of step {step} killed {failures[member]} workers; "
                        "a crash that repeats is not a lost node (out of memory?)"
                    ) from exc
                logger.warning("worker %d died during step %d; re-running member %d", slot,
                               step, member)  # fmt: skip
                queue.appendleft(member)
                starting[self._replace(slot)] = slot
        for ref, slot in starting.items():  # replacements still starting join the tells
            self._await_replacement(ref, slot)
        return [results[m] for m in range(population_size)]

    def _await_replacement(self, ref: Any, slot: int) -> None:
        try:
            info = self.ray.get(ref, timeout=self.ready_timeout)
        except self.ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(
                f"the replacement of worker {slot} did not start within {self.ready_timeout:.0f} s"
                " (a lost node whose GPU/CPU bundle Ray cannot place elsewhere?); resume the run "
                "with --resume once the cluster has room for every worker"
            ) from exc
        self.rebuilds.append(info)
        logger.warning("worker %d replaced: %s", slot, info)

    def _finish_tells(self, tells: dict[Any, int]) -> None:
        """Wait for every actor's update; a dead one is replaced (it replays this step too)."""
        for ref, slot in tells.items():
            try:
                self.ray.get(ref)
            except Exception as exc:
                if not self._is_death(exc):
                    raise
                logger.warning("worker %d died while updating; replacing it", slot)
                self._await_replacement(self._replace(slot), slot)

    def verify(self, expected: str, step: int | None = None) -> None:
        """Every replica's checksum must equal the driver's; a mismatch is an error."""
        sums = self.ray.get([w.checksum.remote() for w in self._workers])
        bad = [(slot, s) for slot, s in enumerate(sums) if s != expected]
        if bad:
            where = f"after step {step}" if step is not None else "now"
            raise ReplicaMismatchError(
                f"replica checksums differ from the driver's ({expected[:12]}) {where}: "
                + ", ".join(f"worker {slot}: {s[:12]}" for slot, s in bad)
                + ". The update uses only seeds and rewards, so this means the workers run a "
                "different copes/torch version, dtype or device than the driver, or a replica "
                "was changed outside the optimizer."
            )

    def close(self) -> None:
        """Stop the actors, free the placement group, and stop Ray if this object started it
        (nothing to do if it never started)."""
        ray = self.ray
        for worker in self._workers:
            with contextlib.suppress(Exception):  # dead or stuck: killed below anyway
                ray.get(worker.close.remote(), timeout=30)
            ray.kill(worker, no_restart=True)
        self._workers = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
