"""Data loaders: tool-use agent traces (ToolBench format) and trace-derived labels.

`jaxkv.data.traces` reads and writes ToolBench's conversation JSON and turns a
session into chat messages for `jaxkv.tokens.Tokenizer.render_chat`;
`scripts/make_traces.py` builds such files from tau2-bench and agentdojo by
replaying their ground-truth tool calls offline.
"""
