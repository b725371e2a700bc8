"""The OpenAI-compatible HTTP server: `jaxkv.commands.server` (installed as `jaxkv-server`).

    python scripts/server.py --help
"""

from jaxkv.commands.server import main

if __name__ == "__main__":
  main()
