"""The verifiers plugin module of copes (harness and taskset id ``copes_verifiers``).

verifiers loads a harness or taskset by importing the module named by its id and taking the
one `Harness` / `Taskset` subclass its ``__all__`` lists; a dotted id cannot be found there,
so this top-level module re-exports `copes.integrations.verifiers`' two classes.
"""

from copes.integrations.verifiers import CopesHarness, CopesTaskset

__all__ = ["CopesHarness", "CopesTaskset"]
