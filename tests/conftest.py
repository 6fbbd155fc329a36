"""Shared fixtures: the embedded tiny agent and the tiny models of real families.

The tiny agent is the one that ships with copes (checked against its digest).
`COPES_TEST_REBUILD=1` runs the suite on a fresh build of its recipe instead, made at the
start of the session into pytest's cache folder (`.pytest_cache/d/copes`); on another CPU
that is another agent, so tests that pin numbers of the shipped agent may then fail.
"""

import os
import sys
from pathlib import Path

# OpenMP threads sleep rather than spin while they wait (read when torch loads, so before
# it): on a loaded machine spinning threads starve the others (.ci/run sets it too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the helper module tests/families.py


@pytest.fixture(scope="session")
def tiny_agent_dir(request) -> Path:
    from copes.agents.tiny import ensure_tiny_agent

    if os.environ.get("COPES_TEST_REBUILD") != "1":
        return ensure_tiny_agent()
    cache = Path(request.config.cache.mkdir("copes"))
    return ensure_tiny_agent(cache_dir=cache, rebuild=True, progress=False)


@pytest.fixture(scope="session")
def tiny_policy(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return HFPolicy.from_pretrained(tiny_agent_dir, device="cpu")


@pytest.fixture(scope="session")
def family_dir(request):
    """`family_dir(name)`: the folder of a tiny trained model of a real family
    (tests/families.py), built once into pytest's cache folder."""
    import families

    cache = Path(request.config.cache.mkdir("copes-families"))
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = families.build_family(name, cache)
        return built[name]

    return build


@pytest.fixture
def family_data_dir(tmp_path) -> Path:
    """A `--data-dir` whose gsm8k.jsonl holds the one question the family models answer."""
    import json

    import families

    folder = tmp_path / "family-data"
    folder.mkdir()
    record = {"question": families.QUESTION, "answer": f"12*34={families.ANSWER}\n#### 408"}
    (folder / "gsm8k.jsonl").write_text(json.dumps(record) + "\n")
    return folder
