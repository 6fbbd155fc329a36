"""EM / F1 against hand-computed values, following the SQuAD, HotpotQA and MuSiQue rules."""

from __future__ import annotations

import pytest

from copes.envs.rewards.qa import exact_match, f1_score, normalize_answer


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The Beatles", "beatles"),
        ("  A   tale of Two  Cities. ", "tale of two cities"),
        ("U.S.A.", "usa"),
        ("rock-'n'-roll!", "rocknroll"),
        ("Theatre and anthem", "theatre and anthem"),  # articles only as whole words
        ("an apple, the pear", "apple pear"),
        ("Beyoncé", "beyoncé"),  # lowercased; accents kept, as in the official script
        ("ÉCOLE", "école"),
        ("“Quoted”", "“quoted”"),  # non-ASCII punctuation is kept, as in the official script
        ("", ""),
        ("the a an", ""),
        ("line\nbreak\ttab", "line break tab"),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize(
    ("pred", "golds", "em", "f1"),
    [
        # exact, up to case / punctuation / articles
        ("Paris", "paris", 1.0, 1.0),
        ("the Eiffel Tower.", ["Eiffel Tower"], 1.0, 1.0),
        # aliases: the best alias counts
        ("NYC", ["New York City", "NYC", "New York"], 1.0, 1.0),
        ("New York", ["New York City", "Big Apple"], 0.0, 0.8),  # P=1, R=2/3
        # partial overlap: P = 1/3, R = 1/2 -> F1 = 0.4
        ("born in Chicago", "Chicago Illinois", 0.0, 0.4),
        # repeated tokens are counted with multiplicity (Counter intersection)
        ("the the Chicago Chicago", "Chicago", 0.0, 2 / 3),
        ("no overlap here", "Paris", 0.0, 0.0),
        # unicode: lowercasing works on non-ASCII, accents are not folded
        ("BEYONCÉ", "Beyoncé", 1.0, 1.0),
        ("Beyonce", "Beyoncé", 0.0, 0.0),
        ("Zürich Switzerland", "Zürich", 0.0, 2 / 3),
        # yes / no / noanswer (the default rule is SQuAD v1.1: partial credit allowed)
        ("yes", "yes", 1.0, 1.0),
        ("Yes.", ["yes"], 1.0, 1.0),
        ("no", "yes", 0.0, 0.0),
        ("yes", "yes it is", 0.0, 0.5),
        ("yes it is", "yes", 0.0, 0.5),
        ("noanswer", "no answer", 0.0, 0.0),
        ("no", ["yes", "no"], 1.0, 1.0),
        # empty: no common token, so F1 = 0 even when both are empty (SQuAD v1.1)
        ("", "", 1.0, 0.0),
        ("", "Paris", 0.0, 0.0),
        ("Paris", "", 0.0, 0.0),
        ("The", "a", 1.0, 0.0),  # both normalize to nothing
        ("", ["Paris", "London"], 0.0, 0.0),
    ],
)
def test_exact_match_and_f1(pred: str, golds: str | list[str], em: float, f1: float) -> None:
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1)


@pytest.mark.parametrize(
    ("pred", "golds", "rule", "f1"),
    [
        # HotpotQA / 2Wiki: no partial credit when a yes/no/noanswer side differs
        ("yes", "yes it is", "hotpotqa", 0.0),
        ("yes it is", "yes", "2wiki", 0.0),
        ("yes it is", "yes", "musique", 0.5),
        ("no", ["yes", "no"], "hotpotqa", 1.0),
        # MuSiQue (SQuAD v2.0): both empty match, one empty scores 0
        ("", "", "musique", 1.0),
        ("The", "a", "musique", 1.0),
        ("The", "a", "hotpotqa", 0.0),
        ("", "Paris", "musique", 0.0),
    ],
)
def test_f1_by_rule(pred: str, golds: str | list[str], rule: str, f1: float) -> None:
    assert f1_score(pred, golds, rule=rule) == pytest.approx(f1)


def test_scores_are_floats_in_unit_interval() -> None:
    for pred in ["Paris", "", "yes", "the city of Paris"]:
        for golds in ["Paris", ["Paris", "City of Light"], "no"]:
            em, f1 = exact_match(pred, golds), f1_score(pred, golds)
            assert isinstance(em, float) and isinstance(f1, float)
            assert 0.0 <= em <= f1 <= 1.0  # a non-empty exact match has F1 = 1


def test_a_string_gold_is_one_alias_not_characters() -> None:
    assert exact_match("p", "Paris") == 0.0
    assert f1_score("Paris", ("Paris",)) == 1.0


def test_no_gold_answers_is_an_error() -> None:
    with pytest.raises(ValueError, match="non-empty sequence"):
        exact_match("Paris", [])
    with pytest.raises(ValueError, match="non-empty sequence"):
        f1_score("Paris", ())


def test_non_string_gold_is_an_error() -> None:
    with pytest.raises(TypeError, match="strings"):
        f1_score("1990", [1990])  # type: ignore[list-item]
