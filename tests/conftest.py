"""Shared fixtures: the embedded tiny agent and the tiny models of real families.

The tiny agent is the one that ships with copes (checked against its digest).
`COPES_TEST_REBUILD=1` runs the suite on a fresh build of its recipe instead, made at the
start of the session into pytest's cache folder (`.pytest_cache/d/copes`); on another CPU
that is another agent, so tests that pin numbers of the shipped agent may then fail.

Under pytest-xdist (`-n 2`, the README's command) each worker is one process per core: torch
and the programs tests start use one thread each, and tests that share a module's fixture run
on one worker (`pytest_collection_modifyitems` below), so nothing expensive is built twice.
Tests that check wall-clock times share the group `timing` (one worker, one after another),
so none of them runs beside the CPU hogs of tests/envs/test_grading_under_load.py.
"""

import os
import sys
from pathlib import Path

# OpenMP threads sleep rather than spin while they wait (read when torch loads, so before
# it): on a loaded machine spinning threads starve the others (.ci/run sets it too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:  # a worker per core: one thread each, here and in what tests start
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402 (after the thread settings, read when torch loads)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the helper module tests/families.py


def worker_threads() -> int:
    """torch threads for in-process models: 1 on an xdist worker, else up to 2."""
    return 1 if XDIST_WORKER else max(1, min(2, os.cpu_count() or 1))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use a module- or class-scoped fixture run on one xdist worker (group: their
    module), so the fixture (a trained run, a loaded model, a Ray cluster) is built once.
    A test with its own `xdist_group` mark keeps it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        scopes = {
            d.scope for defs in (info.name2fixturedefs.values() if info else ()) for d in defs
        }
        if scopes & {"module", "class"}:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def tiny_agent_dir(request) -> Path:
    from copes.agents.tiny import ensure_tiny_agent

    if os.environ.get("COPES_TEST_REBUILD") != "1":
        return ensure_tiny_agent()
    if XDIST_WORKER:  # each worker would rebuild it, replacing the folder others read
        pytest.exit("COPES_TEST_REBUILD=1 rebuilds the tiny agent: run it with -n 0", returncode=2)
    cache = Path(request.config.cache.mkdir("copes"))
    return ensure_tiny_agent(cache_dir=cache, rebuild=True, progress=False)


@pytest.fixture(scope="session")
def tiny_policy(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    torch.set_num_threads(worker_threads())
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
