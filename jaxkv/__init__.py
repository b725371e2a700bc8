"""jaxkv."""
