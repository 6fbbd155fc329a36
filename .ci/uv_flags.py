"""Print, one per line, the uv flags that give `uv pip install` the indexes, find-links and
constraints pip is configured with here (pip.conf, PIP_* variables).

Why: CI installs with uv (the two environments: 35 + 19 s against pip's 194 + 163 s on 2
cores, the same packages at the same versions), but uv does not read pip's configuration,
and a machine whose wheels come from local indexes (or carry a constraints file) must get
the same ones. `pip config list` is pip's own reading of every source, so nothing is parsed
twice by hand: each `<section>.<name>='<value>'` line is one setting.
"""

import ast
import subprocess
import sys

FLAGS = {  # pip's setting -> uv's flag (each takes one value; pip lists are space-separated)
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def main() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    flags: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = FLAGS.get(key.rpartition(".")[2])
        if flag is None or not value:
            continue
        for item in ast.literal_eval(value).split():
            if [flag, item] not in [flags[i : i + 2] for i in range(0, len(flags), 2)]:
                flags += [flag, item]
    print("\n".join(flags))


if __name__ == "__main__":
    main()
