"""The transformers backend (CPU or GPU): `HFPolicy` and what only it needs.

- `policy`: `HFPolicy`, generation with `model.generate`, weights as a `WeightSpace`;
- `engine`: the episode loop (continuous batching of multi-turn episodes on one KV cache);
- `kv_batch`: the KV cache of that loop (slots re-arranged as rows join and leave);
- `population`: N members in one batch (stacked copies, or low-rank adapters).
"""

from copes.agents.hf.policy import HFPolicy

__all__ = ["HFPolicy"]
