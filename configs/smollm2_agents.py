"""SmolLM2-135M behind the OpenAI-compatible server with every KV mechanism on.

    python scripts/server.py --config=configs/smollm2_agents.py

One server, one model, one config:
- the batch engine with its prefix cache, and the shipped LRAgent role adapters
  as "smollm2-135m:plan" / ":action" / ":reflect" (shared A, one batch mixes roles);
- agent sessions of six kinds (`POST /v1/sessions {"kind": ...}`; a session
  first seen in a request gets "pruned"):
  - "pruned": IntentKV (memory mode) prunes each turn's history to C = 1,024
    tokens, keeping the session's QueryMemory across turns and its dead-slot
    holes in the radix cache;
  - "memart": the history is written into MemArt memory blocks and only the new
    question is prefilled over the 32 blocks it retrieves;
  - "reuse": segments earlier prompts contained (tool outputs, documents) are
    spliced at their new positions (tiered admission, int8 store);
  - "semshare": a prompt similar enough to an earlier one reuses that prompt's KV
    through LSH token matching and selective recompute (SemShareKV);
  - "agents": LRAgent's multi-LoRA sharing: requests naming a role
    ("smollm2-135m:plan", ...) extend one trajectory, and under base_lr_shared
    each role reads the base + low-rank KV the others computed (a session first
    seen in a role request gets this kind);
  - "prefix": the batch engine, the session's latest turn locked in its cache.
Each request's `usage["jaxkv"]` says what its mechanism did; `/metrics` sums it.
Every kind runs on one KV pool (`cache`: 2,048 pages of 16 slots, ~1.5 GB for SmolLM2
in float32, with the role adapters' low-rank value cache): the batch engine runs
every kind's requests as mechanisms, batched with every other request, and an agents
session's trajectory (at most `server.agent_max_tokens`, 2,048 tokens) stays in the
pool while the session is idle until the pool needs the room.
"""

from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  MemArtConfig,
  PruningConfig,
  ReuseConfig,
  SamplingConfig,
  SemShareConfig,
  ServeConfig,
  ServerConfig,
  to_config_dict,
)


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      cache=CacheConfig(num_pages=2048, page_size=16, max_seq_len=8192, dtype="float32"),
      engine=EngineConfig(max_batch=8, prefill_chunk=256, decode_steps=16, prefix_cache=True),
      sampling=SamplingConfig(temperature=0.0, max_tokens=128),
      pruning=PruningConfig(method="intentkv", layout="dead_slot", budget=1024,
                            intent_mode="memory"),
      memart=MemArtConfig(block_size=16, top_k=32, rerank=4),   # blocks = the engine's pages
      reuse=ReuseConfig(method="tiered", storage="int8"),
      semshare=SemShareConfig(method="semshare"),
      server=ServerConfig(role_adapters="shipped", agent_max_tokens=2048,
                          sessions="pruned,memart,reuse,semshare,agents,prefix"),
  ))
