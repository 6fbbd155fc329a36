"""GRPO — group relative policy optimization — the gradient baseline (full-parameter or LoRA).

Source: Shao et al. 2024, "DeepSeekMath" (GRPO); options from Yu et al. 2025, "DAPO"
(asymmetric clip, token-mean loss) and Liu et al. 2025, "Understanding R1-Zero-Like Training"
(Dr. GRPO: no std scaling).

One step with G samples per task (`group_size`):

1. `rollout(policy, step)` returns G trajectories per task, grouped by `Trajectory.task_id`;
2. advantage of trajectory i in its task's group: A_i = (r_i - mean(r)) / (std(r) + 1e-4)
   (`scale_rewards="group"`, std with Bessel's correction as in TRL) or A_i = r_i - mean(r)
   (`"none"`, Dr. GRPO); a group whose rewards are all equal has A = 0 (no signal);
3. for every token t the model generated (`generated_mask` = 1; prompts and tool outputs are
   never trained on), ratio_t = exp(log pi(t) - log pi_old(t)) and the per-token loss is
   -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps_high) * A) + beta * KL_t, with KL_t the
   k3 estimator exp(ref - new) - (ref - new) - 1 against a frozen reference (beta > 0 only);
4. aggregate (`token_mean` over every generated token of the batch, or `sequence_mean`),
   accumulate gradients over micro-batches, clip the gradient norm, one AdamW step;
   `updates_per_batch` > 1 repeats 3-4 on the same batch (PPO epochs).

log pi_old is the rollout's own `Trajectory.logprobs`: the sampling-time log-probs under the
raw model distribution (temperature 1, no top-p/top-k), so the first update compares like with
like. Sampling with temperature != 1 (or top-p/top-k) draws tokens from a different
distribution than the one those log-probs describe: the rollout is then off-policy and the
ratio does not correct for it. Trajectories with A = 0 contribute exactly zero gradient when
beta = 0, so they are not forwarded at all (they still count in the loss's denominator).

The model is trained in its own dtype: full-parameter GRPO wants fp32 weights (a 1e-6 AdamW
step vanishes in bf16). With `lora=True` the policy's model is wrapped by peft
(`policy.set_trainable_model` installs the PeftModel, so generation uses the adapted model)
and only the adapter is trained; the reference for the KL is then the same model with the
adapter off.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

import torch

from copes.agents.rollout import undone_arithmetic_rate
from copes.optimizers.base import RolloutFn, StepStats, load_checkpoint_weights
from copes.optimizers.configs import _STRUCTURAL, GRPOConfig

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.agents.rollout import Trajectory

logger = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-4


def group_advantages(
    rewards: Sequence[float], task_ids: Sequence[str], scale_rewards: str = "group"
) -> torch.Tensor:
    """Per-trajectory advantages relative to the other samples of the same task.

    A group of one, or whose rewards are all equal, gets advantages of exactly 0.
    """
    r = torch.tensor(list(rewards), dtype=torch.float64)
    advantages = torch.zeros_like(r)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, task_id in enumerate(task_ids):
        groups[task_id].append(i)
    for members in groups.values():
        g = r[members]
        if len(members) < 2 or bool((g == g[0]).all()):
            continue
        centered = g - g.mean()
        if scale_rewards == "group":
            centered = centered / (g.std() + ADVANTAGE_EPS)
        advantages[members] = centered
    return advantages.float()


def token_logprobs(
    model: Any, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_id: int
) -> list[torch.Tensor]:
    """log pi(token) of every masked-in token of each sequence, under `model` (fp32).

    Right-pads the sequences into one batch; only the logits from the first masked-in
    position on are computed (`logits_to_keep`), and log-softmax runs only on masked-in rows.
    """
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    target = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (seq, mask) in enumerate(zip(sequences, masks, strict=True)):
        ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[row, : len(seq)] = 1
        target[row, : len(seq)] = torch.tensor(list(mask), dtype=torch.bool)
    target[:, 0] = False  # the first token has no context to be predicted from
    first = int(target.any(dim=0).nonzero()[0]) if target.any() else width - 1
    keep = width - (first - 1)  # logits at positions first-1 .. width-1
    logits = model(
        input_ids=ids.to(device),
        attention_mask=attention.to(device),
        logits_to_keep=keep,
        use_cache=False,
    ).logits[:, :-1]  # position p predicts token p + 1
    target, ids = target[:, first:].to(device), ids[:, first:].to(device)
    out = []
    for row in range(len(sequences)):
        rows = logits[row][target[row]].float()
        chosen = rows.gather(-1, ids[row][target[row], None])[:, 0]
        out.append(chosen - torch.logsumexp(rows, dim=-1))
    return out


class GRPO:
    """GRPO on an `HFPolicy`-like policy (anything with a trainable torch `.model`).

    Args:
        config: hyper-parameters.
        policy: its `.model` is trained in place (wrapped by peft first when `config.lora`).
    """

    replays = False  # a step depends on sampled tokens and AdamW state: checkpoints resume it

    def __init__(self, config: GRPOConfig, policy: Policy) -> None:
        self.config = config
        self.step_count = 0
        if not policy.trainable:
            raise TypeError(
                f"GRPO trains a TrainablePolicy (a torch module it owns); this "
                f"{type(policy).__name__} is not one (a vLLM policy needs trainable=True)"
            )
        self.policy = policy
        model = policy.trainable_model
        if config.lora:
            model = _wrap_lora(model, config)
            policy.set_trainable_model(model)
        self.model = model
        if config.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        self.reference = None
        if config.kl_beta > 0 and not config.lora:  # LoRA: the reference is the adapter off
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the policy's model has no trainable parameters (requires_grad)")
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.learning_rate,
            betas=tuple(config.adam_betas),
            weight_decay=config.weight_decay,
        )
        pad = policy.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    # ------------------------------------------------------------------ one step
    def step(self, policy: Policy, rollout: RolloutFn, step: int | None = None) -> StepStats:
        """Sample G trajectories per task, then `updates_per_batch` clipped-surrogate updates.

        Metrics: reward_mean/std and accuracy (fraction `correct`) of the batch;
        advantage_std; zero_variance_groups (fraction of tasks whose G rewards are all equal);
        tokens (generated tokens); trained_trajectories (A != 0 or KL on); and, averaged over
        the updates and per trained token: loss, clip_fraction (tokens whose gradient the clip
        removed), approx_kl (old -> new, k3), ratio_mean, kl (to the reference, beta > 0);
        grad_norm (before clipping) and skipped_update (a non-finite gradient).
        """
        step = self.step_count if step is None else step
        batch = rollout(policy, step)
        start = time.perf_counter()
        cfg = self.config
        groups = _check_batch(batch, cfg.group_size)
        rewards = [t.reward for t in batch]
        advantages = group_advantages(rewards, [t.task_id for t in batch], cfg.scale_rewards)
        tokens = [sum(t.generated_mask[1:]) for t in batch]  # position 0 is never a target
        train = [  # A = 0 and no KL term: exactly zero gradient, so not forwarded at all
            i for i, n in enumerate(tokens) if n > 0 and (advantages[i] != 0 or cfg.kl_beta > 0)
        ]
        size = cfg.micro_batch_size
        micro = [train[i : i + size] for i in range(0, len(train), size)]
        denominators = (sum(tokens), sum(1 for n in tokens if n > 0))
        reference_cache: dict[int, list[torch.Tensor]] = {}
        self.model.train()
        try:
            updates = [
                self._update(batch, advantages, micro, denominators, reference_cache)
                for _ in range(cfg.updates_per_batch)
            ]
        finally:
            self.model.eval()
        self.step_count = step + 1

        r = torch.tensor(rewards, dtype=torch.float64)
        zero_variance = [len({rewards[i] for i in members}) == 1 for members in groups.values()]
        metrics = {
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std(correction=0)),
            "accuracy": sum(bool(t.correct) for t in batch) / len(batch),
            "advantage_std": float(advantages.double().std(correction=0)),
            "zero_variance_groups": sum(zero_variance) / len(zero_variance),
            "tokens": float(denominators[0]),
            "trained_trajectories": float(len(train)),
        }
        for key in updates[0]:
            metrics[key] = sum(u[key] for u in updates) / len(updates)
        undone = undone_arithmetic_rate(batch)  # issue 48; absent where the grades do not say
        if undone is not None:
            metrics["undone_arithmetic_rate"] = undone
        return StepStats(
            metrics=metrics,
            generation_seconds=batch.stats.generation_seconds,
            env_seconds=batch.stats.env_seconds,
            optimizer_seconds=time.perf_counter() - start,
            generated_tokens=batch.stats.generated_tokens,
            log={"step": step},
        )

    def _update(
        self,
        batch: Sequence[Trajectory],
        advantages: torch.Tensor,
        micro: list[list[int]],
        denominators: tuple[int, int],
        reference_cache: dict[int, list[torch.Tensor]],
    ) -> dict[str, float]:
        """One pass over the batch: accumulate gradients micro-batch by micro-batch, one step."""
        cfg = self.config
        total_tokens, num_sequences = denominators
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Any] = defaultdict(float)  # device tensors: one sync per update
        counted = 0
        for m, indices in enumerate(micro):
            seqs = [batch[i].token_ids for i in indices]
            masks = [batch[i].generated_mask for i in indices]
            rows = token_logprobs(self.model, seqs, masks, self.pad_id)
            if cfg.kl_beta > 0 and m not in reference_cache:
                reference_cache[m] = self._reference_logprobs(seqs, masks)
            new = torch.cat(rows)
            device = new.device
            old = torch.tensor(
                [
                    lp
                    for i in indices
                    for lp, k in zip(
                        batch[i].logprobs[1:], batch[i].generated_mask[1:], strict=True
                    )
                    if k
                ],
                dtype=torch.float32,
                device=device,
            )
            lengths = torch.tensor([len(r) for r in rows], device=device)
            adv = advantages[indices].to(device).repeat_interleave(lengths)
            log_ratio = new - old
            ratio = torch.exp(log_ratio)
            clipped = ratio.clamp(1 - cfg.clip_epsilon, 1 + cfg.clip_high)
            per_token = -torch.minimum(ratio * adv, clipped * adv)
            if cfg.kl_beta > 0:
                delta = torch.cat(reference_cache[m]) - new
                kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
                per_token = per_token + cfg.kl_beta * kl
                sums["kl"] += kl.detach().sum()
            if cfg.loss_aggregation == "token_mean":
                loss = per_token.sum() / total_tokens
            else:  # each sequence's mean, averaged over sequences
                loss = (per_token / lengths.repeat_interleave(lengths)).sum() / num_sequences
            loss.backward()
            with torch.no_grad():
                low = (ratio < 1 - cfg.clip_epsilon) & (adv < 0)
                high = (ratio > 1 + cfg.clip_high) & (adv > 0)
                sums["clip"] += (low | high).sum()  # tokens whose gradient the clip removed
                sums["approx_kl"] += ((ratio - 1) - log_ratio).sum()
                sums["ratio"] += ratio.sum()
                sums["loss"] += loss.detach()
            counted += len(new)
        grad_norm = 0.0  # stays 0 when every group had equal rewards: nothing to learn
        if micro:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.policy.weights_changed()
            else:
                logger.warning("GRPO: non-finite gradient norm (%s); update skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        n = max(counted, 1)
        out = {
            "loss": float(sums["loss"]),
            "clip_fraction": float(sums["clip"]) / n,
            "approx_kl": float(sums["approx_kl"]) / n,
            "ratio_mean": float(sums["ratio"]) / n if counted else 1.0,
            "grad_norm": grad_norm,
            "skipped_update": float(not math.isfinite(grad_norm)),
        }
        if cfg.kl_beta > 0:
            out["kl"] = float(sums["kl"]) / n
        return out

    @torch.no_grad()
    def _reference_logprobs(
        self, seqs: list[list[int]], masks: list[list[int]]
    ) -> list[torch.Tensor]:
        if self.reference is not None:
            return token_logprobs(self.reference, seqs, masks, self.pad_id)
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return token_logprobs(self.model, seqs, masks, self.pad_id)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able config and step count, plus `optimizer_tensors` (save with torch.save).

        `optimizer_tensors` holds the AdamW state ("adamw") and, with LoRA, the adapter weights
        ("lora_adapter"): the model checkpoint is the merged model, so an exact LoRA resume
        rebuilds the policy from the *initial* base model and loads this state.
        """
        tensors: dict[str, Any] = {"adamw": self.optimizer.state_dict()}
        if self.config.lora:
            from peft import get_peft_model_state_dict

            adapter = get_peft_model_state_dict(self.model)
            tensors["lora_adapter"] = {k: v.detach().cpu().clone() for k, v in adapter.items()}
        return {
            "algorithm": "grpo",
            "config": asdict(self.config),
            "step_count": self.step_count,
            "optimizer_tensors": tensors,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("algorithm", "grpo") != "grpo":
            raise ValueError(f"not a GRPO state (algorithm={state.get('algorithm')!r})")
        known = {f.name for f in fields(GRPOConfig)}
        saved = GRPOConfig(**{k: v for k, v in state["config"].items() if k in known})
        ours, theirs = asdict(self.config), asdict(saved)
        differ = [k for k in _STRUCTURAL if theirs[k] != ours[k]]
        if differ or (saved.kl_beta > 0) != (self.config.kl_beta > 0):
            raise ValueError(
                f"the saved GRPO state was built with different {differ or ['kl_beta']}; "
                "construct GRPO with the saved config to resume"
            )
        self.config = saved
        self.step_count = int(state["step_count"])
        tensors = state.get("optimizer_tensors")
        if tensors is None:
            raise ValueError("state has no 'optimizer_tensors' (the torch.save'd part): load it")
        if self.config.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, tensors["lora_adapter"])
            self.policy.weights_changed()
        self.optimizer.load_state_dict(tensors["adamw"])

    @property
    def samples_per_task(self) -> int:
        return self.config.samples_per_task

    # ------------------------------------------------------------------ weights in and out
    def export_model(self, policy: Policy) -> Any:
        return self.merged_model()

    def master_state(self, policy: Policy, model: Any) -> dict[str, Any] | None:
        return None  # the exported model is the trained weights, in their own dtype

    def load_weights(self, policy: Policy, checkpoint: Any) -> None:
        """Full GRPO: the checkpoint's weights. LoRA: nothing here, the adapter is in the
        optimizer state (the checkpoint is the merged model, which is not the base)."""
        if not self.config.lora:
            load_checkpoint_weights(policy, checkpoint)

    def replay(self, records: Sequence[dict[str, Any]], policy: Policy) -> None:
        raise NotImplementedError("GRPO steps are not replayable; resume from a checkpoint")

    def fingerprint(self, policy: Policy) -> str | None:
        return None

    def merged_model(self) -> Any:
        """A plain transformers model to `save_pretrained`: the live model itself for full
        GRPO, a merged copy for LoRA (the training model keeps its adapter untouched)."""
        if not self.config.lora:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()


def _check_batch(batch: Sequence[Trajectory], group_size: int) -> dict[str, list[int]]:
    """Indices of each task's trajectories; every trajectory has one entry per token."""
    if len(batch) == 0:
        raise ValueError("the rollout returned no trajectories; GRPO needs G per task")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(batch):
        groups[t.task_id].append(i)
        if not len(t.token_ids) == len(t.generated_mask) == len(t.logprobs):
            raise ValueError(
                f"trajectory of task {t.task_id!r} has {len(t.token_ids)} token ids, "
                f"{len(t.generated_mask)} mask entries and {len(t.logprobs)} log-probs; "
                "they must have one entry per token"
            )
    sizes = sorted({len(m) for m in groups.values()})
    if sizes != [group_size]:
        logger.warning("GRPO expected group_size=%d samples per task, got %s", group_size, sizes)
    return groups


def _enable_activation_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in backward (transformers 5 name, then 4's)."""
    kwargs = {"use_reentrant": False}  # no need for inputs that require grad (LoRA)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _wrap_lora(model: Any, config: GRPOConfig) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError(
            "lora=True needs peft: pip install peft (or set lora=False for full GRPO)"
        ) from exc
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


__all__ = ["GRPO", "GRPOConfig", "group_advantages", "token_logprobs"]
