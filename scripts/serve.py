"""Batch inference over JSONL requests: `jaxkv.commands.serve` (installed as `jaxkv-serve`).

    python scripts/serve.py --help
"""

from jaxkv.commands.serve import main

if __name__ == "__main__":
  main()
