"""Print, one per line, the uv flags that give `uv pip install` the indexes, find-links and
constraints pip is configured with here (pip.conf, PIP_* variables); nothing where pip has
no such settings.

Why: CI installs with uv (the two environments: 35 + 19 s against pip's 194 + 163 s on 2
cores, the same packages at the same versions), but uv does not read pip's configuration,
and a machine whose wheels come from local indexes (or carry a constraints file) must get
the same ones. `pip config list` is pip's own reading of every source: each
`<section>.<name>='<value>'` line is one setting. pip's `install` command reads the
`:env:` (PIP_*), `install` and `global` sections, the first that sets a name winning (a
stronger source replaces a list, it does not add to it); list values (find-links,
extra-index-url, constraint) are space-separated, one flag each.
"""

import ast
import subprocess
import sys

SECTIONS = (":env:", "install", "global")  # what `pip install` reads, strongest first
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}  # fmt: skip


def main() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in SECTIONS and value:
            settings[(section, name)] = ast.literal_eval(value)

    def single(name: str) -> str | None:
        return next((settings[(s, name)] for s in SECTIONS if (s, name) in settings), None)

    flags: list[str] = []
    if (index := single("index-url")) is not None:
        flags += ["--index-url", index]
    if (no_index := single("no-index")) is not None and no_index.lower() in ("1", "true", "yes"):
        flags.append("--no-index")
    for name, flag in LISTS.items():
        for item in (single(name) or "").split():
            flags += [flag, item]
    sys.stdout.write("".join(f"{flag}\n" for flag in flags))


if __name__ == "__main__":
    main()
