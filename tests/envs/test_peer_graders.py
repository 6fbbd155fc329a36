"""The math grader against other projects' reference suites (issue 25).

Every case of `tests/fixtures/peer_graders/` (copied from the team's shared/peer-graders/,
sources and licences in its SOURCES.md: Math-Verify's parametrized tests, MATH's `is_equiv` unit
tests, Qwen2.5-Math's hand-labelled examples) is graded through ToolMath-v0's own grader, the
one that turns a final answer into a reward. No suite may see a false positive; every other
disagreement is listed, with its reason, in `grader_differences.json`, and a listed case that
agrees again fails, so the list cannot go stale. `peer_verdicts.json` (other scorers' verdicts
on the same strings) is informative: its agreement counts are printed, not asserted.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from copes.envs.presets import tool_math_env
from copes.envs.tasks.base import Task

PEER_DIR = Path(__file__).parents[1] / "fixtures" / "peer_graders"
SUITES = ("mathverify_cases.json", "hendrycks_cases.json", "qwen_examples.json")
DIFFERENCES_FILE = Path(__file__).with_name("grader_differences.json")
DIFFERENCES: dict[str, str] = json.loads(DIFFERENCES_FILE.read_text())


def _cases() -> list[dict]:
    cases = []
    for suite in SUITES:
        for case in json.loads((PEER_DIR / suite).read_text()):
            cases.append({**case, "suite": suite})
    return cases


CASES = _cases()
BY_ID = {case["id"]: case for case in CASES}


@functools.cache
def _env():
    return tool_math_env(tasks=[Task(id="peer", question="q", answers=("0",), kind="math")])


@functools.cache
def graded_correct(case_id: str) -> bool:
    """The verdict ToolMath-v0 gives `copes_pred` as the final answer to a `copes_gold` task."""
    case = BY_ID[case_id]
    task = Task(id=case_id, question="q", answers=(case["copes_gold"],), kind="math")
    return _env().grader(case["copes_pred"], task).correct


def test_the_suites_are_complete() -> None:
    assert len(BY_ID) == len(CASES) == 298  # 270 Math-Verify + 16 is_equiv + 12 Qwen
    assert {c["expected"] for c in CASES} == {True, False}


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_reference_case(case_id: str) -> None:
    case = BY_ID[case_id]
    verdict = graded_correct(case_id)
    where = f"{case['suite']} {case.get('test', '')}: pred {case['copes_pred']!r:.120}"
    where += f" vs gold {case['copes_gold']!r:.120}"
    if not case["expected"]:
        assert verdict is False, f"false positive on {where}"
    elif case_id in DIFFERENCES:
        assert verdict is False, f"listed in {DIFFERENCES_FILE.name} but agrees now: {where}"
    else:
        assert verdict is True, f"unlisted disagreement on {where}"


def test_the_differences_list_only_known_wrong_verdicts() -> None:
    unknown = sorted(set(DIFFERENCES) - set(BY_ID))
    assert unknown == [], f"{DIFFERENCES_FILE.name} lists unknown cases"
    negatives = sorted(i for i in DIFFERENCES if not BY_ID[i]["expected"])
    assert negatives == [], "a false positive can never be listed as a difference"
    assert all(reason.strip() for reason in DIFFERENCES.values())


def test_agreement_counts(capsys: pytest.CaptureFixture[str]) -> None:
    lines = []
    for suite in SUITES:
        cases = [c for c in CASES if c["suite"] == suite]
        agree = sum(graded_correct(c["id"]) == c["expected"] for c in cases)
        false_positives = sum(graded_correct(c["id"]) and not c["expected"] for c in cases)
        listed = sum(c["id"] in DIFFERENCES for c in cases)
        assert false_positives == 0 and agree + listed == len(cases)
        lines.append(f"{suite}: copes agrees on {agree}/{len(cases)}, {listed} listed differences")
    peers = json.loads((PEER_DIR / "peer_verdicts.json").read_text())
    assert set(peers) <= set(BY_ID)
    for peer in sorted({name for verdicts in peers.values() for name in verdicts}):
        rated = [i for i, verdicts in peers.items() if verdicts.get(peer) is not None]
        same = sum(peers[i][peer] == graded_correct(i) for i in rated)
        truth = sum(peers[i][peer] == BY_ID[i]["expected"] for i in rated)
        lines.append(
            f"peer {peer}: same verdict as copes on {same}/{len(rated)}, "
            f"agrees with the suites' expected verdicts on {truth}/{len(rated)}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
