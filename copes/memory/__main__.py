"""`python -m copes.memory --model qwen3-4b`: the comparison table of docs/memory.md."""

from copes.memory.plan import main

main()
