"""MemArt inside a composition: a session's earlier conversations kept as memory
blocks, retrieved for a new conversation and spliced into its prompt as a region.

A composed session that names "memart" (e.g. `["agents", "pruned", "memart"]`) holds,
besides its layout's KV (an agents trajectory, a pruned radix path), a MemArt memory
(`MemArtSessions.sessions[session]`) and its current conversation:

  * A request whose messages extend the last request's continues the conversation: its
    prompt carries the same memory region and its layout adopts it from its cache.
  * Any other request opens a new conversation and closes the last one: first a
    *recall* request (an engine row of the `MemArt` mechanism, batched like any other)
    writes the closed conversation's "role: content" lines (the last reply included;
    `memart.write_turns="inputs"` leaves the model's replies out) into the memory and
    retrieves the top-k blocks for the new question (MemArt's probe and aggregated
    scores), then the composed request runs.
  * The region is the retrieved blocks' tokens, packed in chronological order, placed
    where the first user message's content starts (after the system prompt and the
    user opening: MemArt's own `head + blocks + question` layout for a one-question
    conversation). The blocks' tokens are real prompt tokens, so the layout's cache
    keys stay the prompt's and a later call of the conversation adopts the region.
  * At admission (`fill`) the row's fresh slots of the region get the blocks' K/V,
    copied and re-rotated to their new positions (delta RoPE, exact: what MemArt's key
    shift does on read, written once instead); the engine does not prefill them. From
    the region on the row's KV is not a plain prefill's (the blocks were computed after
    MemArt's head, not after this prompt), so the layout caches it under the session's
    private keys (`Row.private_from`). Where the slots cannot be filled (the prefix
    before the region was not cached, position 0, a block evicted since the recall)
    the region is computed like any prompt text: exact, only not saved.

The memory's blocks are the base model's KV: under role adapters the region is
approximate in the same way segment reuse's splices are (the layout names the KV form).
Pruning (a joined `pruned`) sees the region as history before the query span: IntentKV
may evict it like any other history.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np

from jaxkv.config import COMPILER_OPTIONS
from jaxkv.kv import plan, splice
from jaxkv.kv.state import SENTINEL

_MARK = "\x00REGION\x00"


@dataclasses.dataclass
class Conversation:
  """A composed session's current conversation."""
  messages: list                 # the last request's messages (the next extends them)
  blocks: np.ndarray             # [k] memory rows retrieved for it, chronological
  ids: np.ndarray                # [n] their tokens, packed: the region
  recall: dict                   # what its recall did (written tokens, blocks, probe)
  reply: str = ""                # the last reply generated in it


@dataclasses.dataclass
class Fill:
  """A composed row's memory region (its state in the composition)."""
  session: str
  at: int                        # the region's first prompt position
  blocks: np.ndarray
  n: int                         # region tokens
  recall: dict
  spliced: int = 0               # region tokens whose K/V were copied from memory


def lines(messages: list[dict], reply: str = "", turns: str = "all") -> list[str]:
  """A conversation as memory lines ("role: content"; tool calls as JSON; system
  messages left out: they are not what happened). `turns` "inputs" keeps the user's and
  tools' turns only (`MemArtConfig.write_turns`: the model's replies left out)."""
  out = []
  for m in messages:
    if m.get("role") == "system" or (turns == "inputs" and m.get("role") == "assistant"):
      continue
    content = m.get("content")
    text = content if isinstance(content, str) else ""
    if m.get("tool_calls"):
      text = (text + " " + json.dumps(m["tool_calls"], ensure_ascii=False)).strip()
    out.append(f"{m.get('role')}: {text}")
  if reply and turns == "all":
    out.append(f"assistant: {reply}")
  return out


def extends(messages: list[dict], earlier: list[dict]) -> bool:
  """Whether `messages` continue the conversation whose last request was `earlier`
  (or repeat it: a retry stays in its conversation)."""
  return len(messages) >= len(earlier) and messages[:len(earlier)] == earlier


def region_of(mem, blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, slots, positions written at) of memory rows `blocks`, packed in order."""
  blocks = np.asarray(blocks, np.int32)
  if not blocks.size:
    z = np.zeros(0, np.int32)
    return z, z, z
  ok = np.arange(mem.ids.shape[1])[None] < mem.tokens[blocks][:, None]
  return mem.ids[blocks][ok], mem.slots[blocks][ok], mem.positions[blocks][ok]


def head_length(tok, messages: list[dict], tools, prompt) -> int | None:
  """Prompt tokens before the first user message's content (where the region goes),
  or None when the prompt does not start with that rendering (no user message, or
  a template that tokenises the boundary otherwise)."""
  first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
  if first is None:
    return None
  msgs = list(messages[:first]) + [{"role": "user", "content": _MARK}]
  text = tok.render_chat(msgs, tools=tools, add_generation_prompt=False)
  if _MARK not in text:
    return None
  head = list(tok.encode_with_offsets(text.split(_MARK)[0])[0])
  if not head or list(prompt[:len(head)]) != head:
    return None
  return len(head)


def insert(prompt, ctx: dict, at: int, conv: Conversation, session: str, recall: dict):
  """(prompt with the region at `at`, context with the region named and a pruning
  query span moved past it; `recall`: what this call's recall did, if it ran one)."""
  prompt = list(prompt)
  n = int(conv.ids.size)
  out = list(prompt[:at]) + [int(t) for t in conv.ids] + prompt[at:]
  ctx = dict(ctx)
  if "qs" in ctx:                  # the query span starts after the region
    ctx["qs"] = ctx["qs"] + n if ctx["qs"] >= at else at + n
  ctx["memart"] = {"session": session, "at": at, "blocks": conv.blocks.tolist(), "n": n,
                   "recall": recall}
  return out, ctx


@functools.partial(jax.jit, donate_argnums=(0,), compiler_options=COMPILER_OPTIONS)
def _splice(pool, src, dest, positions, inv_freq):
  return splice.splice_slots(pool, src, dest, positions, inv_freq)


def fill(runner, mem, row, f: Fill) -> int:
  """Copies the region's K/V from memory into the row's fresh slots [row.cached, end)
  (re-rotated to their positions); returns how many (0: the region is computed)."""
  lo, end = row.cached, f.at + f.n
  if not f.n or not (f.at <= lo < end) or lo == 0 or end >= row.n:
    return 0
  if mem is None or not mem.live[f.blocks].all():
    return 0                        # a block evicted since the recall: computed instead
  ids, slots, _ = region_of(mem, f.blocks)
  prompt = np.asarray(row.req.prompt[f.at:end], np.int32)
  if ids.size != f.n or not np.array_equal(ids, prompt):
    return 0
  dest = runner.alloc.slot_map(row.seq)[lo:end]
  if (dest == SENTINEL).any():
    return 0
  src = slots[lo - f.at:]           # the pool keeps where each was written: the rotation
  pad = plan.bucket(src.size, 16, 512) - src.size      # few compiled shapes
  drv = runner.driver
  drv.kv = _splice(drv.kv, np.pad(src, (0, pad)),
                   np.pad(dest, (0, pad), constant_values=SENTINEL),
                   np.pad(np.arange(lo, end, dtype=np.int32), (0, pad)), runner.inv_freq)
  f.spliced = end - lo
  return f.spliced
