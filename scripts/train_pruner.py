"""Trains the IntentKV Phase-2 residual head: `jaxkv.commands.train_pruner` (installed as
`jaxkv-train-pruner`).

    python scripts/train_pruner.py --help
"""

from jaxkv.commands.train_pruner import main

if __name__ == "__main__":
  main()
