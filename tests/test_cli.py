"""`copes-train --help`: every flag states its real default once."""

import re


def test_help_states_each_default_once():
    from copes.cli import train_parser

    parser, _, _ = train_parser()
    text = " ".join(parser.format_help().split())
    assert "(default: None) (default:" not in text
    assert "--sigma SIGMA sigma: full-space noise scale (Qiu et al.: 1e-3) (default: 0.001)" in text
    for action in parser._actions:
        if action.help and action.option_strings and action.dest not in ("help",):
            assert len(re.findall(r"\(default", action.help)) <= 1, action.dest
