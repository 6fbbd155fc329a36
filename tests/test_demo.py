"""`copes-demo` (README): one scripted episode of each environment, with the real tools."""

from copes.demo import main


def test_the_demo_plays_both_environments_to_a_correct_answer(capsys):
    main(["--seed", "3"])
    out = capsys.readouterr().out
    assert out.index("=== ToolMath-v0 ===") < out.index("=== ToolQA-v0 ===")
    assert out.count("correct=True") == 2, out
    assert "[python]" in out and "[search]" in out  # the sandbox and the search tool answered
