"""The project's commands; `pip install .` puts each on PATH, `scripts/*.py` run them from a clone.

    jaxkv-serve         jaxkv.commands.serve         batch inference over JSONL (scripts/serve.py)
    jaxkv-server        jaxkv.commands.server        the OpenAI-compatible HTTP server
                                                     (scripts/server.py)
    jaxkv-train-pruner  jaxkv.commands.train_pruner  IntentKV's Phase-2 head
                                                     (scripts/train_pruner.py)
    jaxkv-train-lora    jaxkv.commands.train_lora    LRAgent's role adapters (scripts/train_lora.py)

Each module defines its absl flags when imported and a `main()` entry point
(`[project.scripts]` in pyproject.toml), so import one command per process.
"""
