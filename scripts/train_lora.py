"""Trains LRAgent's plan / action / reflect role adapters: `jaxkv.commands.train_lora`
(installed as `jaxkv-train-lora`).

    python scripts/train_lora.py --help
"""

from jaxkv.commands.train_lora import main

if __name__ == "__main__":
  main()
