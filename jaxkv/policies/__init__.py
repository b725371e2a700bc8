"""KV policies over the shared substrate: pruning/ (IntentKV and baselines); sharing,
reuse and memory follow (DESIGN.md). Pure functions over pytrees + frozen configs."""
