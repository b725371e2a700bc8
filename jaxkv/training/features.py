"""Frozen-model features for IntentKV Phase-2 training (section 3.5, appendix H).

For every (session, assistant turn i) row the prompt is messages[:i]. Sessions
are replayed in increasing turn order over one KV pool (a contiguous slot map,
slot 0 the sentinel): each turn's prompt extends the previous one, so only the
tokens after the longest common prefix are prefilled, in chunks of at most
`chunk_tokens` (<= 4,096) with KV caching, and the chunk boundaries are chosen
so that the actionable query span [qs, N) is always ONE chunk (`plan_chunks`).
That chunk captures the post-RoPE Q rows of the span; Enc(q_t) is their mean,
the session's QueryMemory is advanced by eq. 2 on every turn (lambda = 0.5,
normalised Enc, unit norm: `intentkv.advance`, as serving does on every request)
and the head's inputs -- the rule score of eq. 3 over the candidates H =
[sys_len, qs) (live history outside the forced set: system prefix + query span;
nothing is pruned while extracting), k_bar and m_bar -- come from
`residual.phase2_inputs`, the function the pruning event calls.

Stored per session (one .npz under the cache directory):

  kbar    [N_max, D] float32  per-position key mean over layers and KV heads
                              (residual.mean_keys; positions never shift, so
                              one array serves every row of the session)
  per row (concatenated over rows, `offsets` delimit them):
  rule    [qs - sys_len]      eq. 3 over the candidate window
  labels  [qs - sys_len] int8 1 evidence, 0 other history, -100 template tokens
  mbar    [D]                 mean of M_t over layers and query heads
  mnorm   [L, Hq]             ||M_t[l, h]||_2 of the memory the scorer used
  mcos                        cos(M_t, Enc(q_t)), mean over layers and heads
  n, qs, sys_len, turn

K_bar^q is kbar[qs:n] (its last n_q rows) and positions in [0, sys_len) and
[qs, n) carry label -100 implicitly (they are outside the stored window).
Rows whose window holds no positive are dropped (section 3.5).

Decisions where the paper is silent:

  * Labels follow `SessionRunner.prepare` (future-evidence of the next five tool
    calls, `jaxkv.data.labels`); "special-template tokens" are the tokenizer's
    special tokens plus ChatML role headers (`<|im_start|>role\n`).
  * A row whose prompt exceeds `max_prompt_tokens` (SmolLM2: its 8,192 context)
    ends the session's replay (later turns are longer). A query span longer
    than `max_chunk` keeps its last `max_chunk` rows for Enc(q_t).
  * Chunks run on the one driver (`jaxkv.engine.driver`) with explicit cuts;
    chunk lengths and slot-map widths are bucketed by `jaxkv.kv.plan`.
  * The prefix KV is also reused across sessions (their system prompts agree);
    keys at a position depend only on the tokens before it, so this changes
    nothing but float rounding.

`PrunerTrainConfig` (the whole training run's frozen config, read by
`configs/pruner_smollm2.py` and `scripts/train_pruner.py`) lives in
`jaxkv.training.config` (imported here as before); its feature fields hash into
the cache key (`feature_key`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import COMPILER_OPTIONS, PAGE_SIZE, CacheConfig
from jaxkv.data import labels as labels_lib
from jaxkv.data import traces
from jaxkv.engine.driver import Driver
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state
from jaxkv.models.forward import Capture
from jaxkv.policies.pruning import intentkv, residual, scores
from jaxkv.training.config import PrunerTrainConfig

IGNORE = -100


# Fields that change the extracted features (and so the cache key).
FEATURE_FIELDS = ("model", "dtype", "chunk_tokens", "max_chunk", "max_prompt_tokens", "decay",
                  "normalize_query", "lookahead", "attn_impl")
FEATURE_VERSION = 2      # 2: normalised Enc(q_t), features through residual.phase2_inputs


def feature_key(cfg: PrunerTrainConfig, trace_path: str, trace_digest: str) -> str:
  """Cache key: hash of the model, the trace file (path + content digest) and settings.

  Files are per session, so runs capped at different session counts share them.
  """
  blob = {f: getattr(cfg, f) for f in FEATURE_FIELDS}
  blob.update(trace=str(trace_path), digest=trace_digest, version=FEATURE_VERSION)
  return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- prompts
def template_mask(tok, text: str, offsets) -> np.ndarray:
  """[N] bool: special tokens and chat-template role headers (`<|im_start|>role\\n`)."""
  special = [t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special]
  covered = np.zeros(len(text) + 1, bool)
  for s in special:
    pat = re.escape(s) + (r"[^\n]{0,32}\n" if "start" in s else "")
    for m in re.finditer(pat, text):
      covered[m.start():m.end()] = True
  out = np.zeros(len(offsets), bool)
  for j, (a, b) in enumerate(offsets):
    out[j] = b > a and bool(covered[a:b].all())
  return out


def prepare_row(tok, messages: Sequence[dict], tools, i: int, lookahead: int = 5) -> dict:
  """Prompt ids of messages[:i], query-span start qs, system length and labels.

  The spans and evidence are `labels.prepare_turn`'s (the same as the session
  runner's); labels [N] int8: 1 evidence, 0 other, -100 on the system prefix,
  the query span and template tokens.
  """
  p = labels_lib.prepare_turn(tok, messages, tools, i, lookahead=lookahead, reply=False)
  qs, sys_len = p["qs"], p["sys_len"]
  lab = p["evidence"].astype(np.int8)
  lab[template_mask(tok, p["text"], p["offsets"])] = IGNORE
  lab[:sys_len] = IGNORE
  lab[qs:] = IGNORE
  return dict(ids=np.asarray(p["ids"], np.int32), qs=qs, sys_len=sys_len, labels=lab)


def plan_chunks(start: int, qs: int, n: int, chunk: int, max_chunk: int = 4096):
  """Chunk boundaries covering [min(start, qs'), n) with the query span in ONE chunk.

  History [start, qs') is cut into chunks of at most `chunk` tokens; the span
  [qs', n) is the last chunk, where qs' = max(qs, n - max_chunk) (a span longer
  than max_chunk keeps its last max_chunk rows). If start > qs' (span already
  cached) the span is recomputed. Returns (list of (c0, c1), index of the span chunk).
  """
  qs = max(qs, n - max_chunk)
  start = min(start, qs)
  out = [(c0, min(qs, c0 + chunk)) for c0 in range(start, qs, chunk)]
  out.append((qs, n))
  return out, len(out) - 1



# ----------------------------------------------------------------------------- device steps
@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("decay", "normalize_query"))
def _row_features(pool_k, slot_map, enc, prev, candidates, span, *, decay, normalize_query):
  """M_t (eq. 2) and the head's inputs, through the functions serving uses
  (`intentkv.advance`, `residual.phase2_inputs`); plus ||M_t|| per head and
  cos(M_t, Enc(q_t))."""
  m, mem = intentkv.advance(prev, enc, mode="memory", decay=decay,
                            normalize_query=normalize_query)
  k = scores.gather_keys(pool_k, slot_map)                 # [L, 1, W, Hkv, D]
  inputs = residual.phase2_inputs(k, m, candidates, span, n_q=1)   # K_bar^q: from kbar
  return (mem, inputs.rule[0], inputs.kbar[0], inputs.mbar[0],
          jnp.linalg.norm(mem[:, 0], axis=-1), intentkv.memory_cosine(mem, enc)[0])


class Extractor:
  """Replays sessions through a frozen model and returns per-session feature dicts."""

  def __init__(self, llm, cfg: PrunerTrainConfig):
    self.tok, self.mcfg, self.cfg = llm.tokenizer, llm.config, cfg
    slots = plan.width(cfg.max_prompt_tokens) + PAGE_SIZE
    self.cache = CacheConfig(num_pages=slots // PAGE_SIZE + 1, page_size=PAGE_SIZE,
                             max_seq_len=cfg.max_prompt_tokens, dtype=cfg.dtype)
    self.driver = Driver(llm.graphdef, llm.weights, kv_state.init_pool(self.mcfg, self.cache),
                         attn_impl=cfg.attn_impl)
    # token ids whose KV the pool holds at slots PAGE_SIZE + p: the prefix shared with
    # the next prompt (the same session's earlier turn, or the previous session's
    # system prompt) is not recomputed, as a radix prefix cache would serve it
    self.prev_ids = np.zeros(0, np.int32)
    self.reused_tokens = 0
    self.computed_tokens = 0

  @staticmethod
  def _slot_map(width: int) -> np.ndarray:
    """Position p lives at slot PAGE_SIZE + p (one contiguous sequence)."""
    return plan.slot_rows([plan.contiguous_slots(PAGE_SIZE, np.arange(width))], width)

  def _prefill(self, ids, boundaries, span_idx):
    """Prefill the chunks [c0, c1) of `boundaries`; Enc(q_t) from the span chunk's q."""
    start = boundaries[0][0]
    cuts = [c0 - start for c0, _ in boundaries] + [boundaries[-1][1] - start]
    enc = None
    for ch, out in self.driver.prefill(
        [plan.Row(ids[start:boundaries[-1][1]], start)], chunk=self.cfg.max_chunk,
        slot_map=self._slot_map, read=None, cuts=cuts,
        options=lambda ch: {"capture": Capture(q=ch.index == span_idx)}):
      if ch.index == span_idx:
        enc = intentkv.encode_query(out.q, jnp.asarray(ch.positions >= 0))
    return enc

  def session(self, sess: traces.Session) -> dict:
    """Features of every usable row of one session (see the module docstring)."""
    cfg = self.cfg
    messages, tools = traces.session_chat(sess, self.tok)
    memory = None
    kbar = np.zeros((0, self.mcfg.head_dim), np.float32)
    rows, chunks_log = [], []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant" or i == 0:
        continue
      p = prepare_row(self.tok, messages, tools, i, cfg.lookahead)
      ids, qs, sys_len, n = p["ids"], p["qs"], p["sys_len"], p["ids"].size
      if n > cfg.max_prompt_tokens:
        break                                  # later turns are longer still
      lim = min(self.prev_ids.size, n)
      diff = np.nonzero(self.prev_ids[:lim] != ids[:lim])[0]
      lcp = int(diff[0]) if diff.size else lim
      chunks, span_idx = plan_chunks(lcp, qs, n, cfg.chunk_tokens, cfg.max_chunk)
      chunks_log.append(chunks)
      self.reused_tokens += chunks[0][0]
      self.computed_tokens += n - chunks[0][0]
      enc = self._prefill(ids, chunks, span_idx)
      self.prev_ids = ids
      smap = self._slot_map(plan.width(n))
      cand = np.zeros(smap.shape, bool)
      cand[0, sys_len:qs] = True
      span = np.zeros(smap.shape, bool)
      span[0, qs:n] = True
      prev = jnp.zeros_like(enc) if memory is None else memory
      memory, rule, kb, mbar, mnorm, mcos = _row_features(
          self.driver.kv.k, jnp.asarray(smap), enc, prev, jnp.asarray(cand), jnp.asarray(span),
          decay=cfg.decay, normalize_query=cfg.normalize_query)
      kbar = np.asarray(kb[:n], np.float32)     # positions never shift: one array per session
      lab = p["labels"][sys_len:qs]
      rows.append(dict(turn=i, n=n, qs=qs, sys_len=sys_len,
                       rule=np.asarray(rule)[sys_len:qs].astype(np.float32),
                       labels=lab.astype(np.int8), mbar=np.asarray(mbar, np.float32),
                       mnorm=np.asarray(mnorm, np.float32), mcos=float(mcos),
                       positives=int((lab == 1).sum())))
    return dict(kbar=kbar, rows=rows, chunks=chunks_log)


# ----------------------------------------------------------------------------- storage
def pack_session(feat: dict) -> dict:
  """Session features -> flat arrays for np.savez (rows concatenated)."""
  rows = feat["rows"]
  lens = [r["rule"].size for r in rows]
  out = dict(kbar=feat["kbar"], offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
  for k in ("turn", "n", "qs", "sys_len", "positives"):
    out[k] = np.asarray([r[k] for r in rows], np.int64)
  out["mcos"] = np.asarray([r["mcos"] for r in rows], np.float32)
  out["rule"] = np.concatenate([r["rule"] for r in rows]) if rows else np.zeros(0, np.float32)
  out["labels"] = np.concatenate([r["labels"] for r in rows]) if rows else np.zeros(0, np.int8)
  d = feat["kbar"].shape[1]
  out["mbar"] = np.stack([r["mbar"] for r in rows]) if rows else np.zeros((0, d), np.float32)
  out["mnorm"] = np.stack([r["mnorm"] for r in rows]) if rows else np.zeros((0, 1, 1), np.float32)
  return out


@dataclasses.dataclass
class Row:
  """One training example (host numpy), as the trainer consumes it."""
  session: str
  turn: int
  rule: np.ndarray      # [T] candidate window [sys_len, qs)
  labels: np.ndarray    # [T] int8
  kbar: np.ndarray      # [T, D] k_bar over the window
  kq: np.ndarray        # [n_q', D] k_bar at the last <= n_q span positions
  mbar: np.ndarray      # [D]
  mnorm: np.ndarray     # [L, Hq]


def unpack_rows(sid: str, arrs, n_q: int) -> list[Row]:
  """Rows of one stored session that have at least one positive."""
  out = []
  kbar = arrs["kbar"]
  for r in range(arrs["n"].size):
    if arrs["positives"][r] == 0:
      continue
    a, b = arrs["offsets"][r], arrs["offsets"][r + 1]
    n, qs, sl = int(arrs["n"][r]), int(arrs["qs"][r]), int(arrs["sys_len"][r])
    out.append(Row(session=sid, turn=int(arrs["turn"][r]), rule=arrs["rule"][a:b],
                   labels=arrs["labels"][a:b], kbar=kbar[sl:qs], kq=kbar[max(qs, n - n_q):n],
                   mbar=arrs["mbar"][r], mnorm=arrs["mnorm"][r]))
  return out


def _digest(path) -> str:
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16]


def _safe(name: str) -> str:
  digest = hashlib.md5(name.encode()).hexdigest()[:8]
  return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] + "-" + digest


def _plan(cfg: PrunerTrainConfig, trace_path: str, max_sessions: int):
  """(sessions, cache directory, sessions not yet cached)."""
  sessions = traces.load_toolbench(trace_path, strict=False)
  if max_sessions:
    sessions = sessions[:max_sessions]
  key = feature_key(cfg, trace_path, _digest(trace_path))
  root = pathlib.Path(cfg.cache_dir) / key
  return sessions, root, [s for s in sessions if not (root / f"{_safe(s.id)}.npz").exists()]


def all_cached(cfg: PrunerTrainConfig) -> bool:
  """Whether the train and val features are all on disk (no model load needed)."""
  return not (_plan(cfg, cfg.train_traces, cfg.max_train_sessions)[2]
              or _plan(cfg, cfg.val_traces, cfg.max_val_sessions)[2])


def load_or_extract(cfg: PrunerTrainConfig, trace_path: str, max_sessions: int = 0, *,
                    llm=None, progress: bool = True, log=print) -> dict[str, list[Row]]:
  """Features of every session of a trace file, from the cache or the frozen model.

  The cache lives in cache_dir/<key>/ where key hashes the model, the trace file
  (path + content) and the feature settings; a session already stored is never
  re-extracted, so an interrupted extraction resumes. `llm` is loaded lazily
  (only when something is missing). Returns {session id: rows with a positive},
  in file order.
  """
  import tqdm

  sessions, root, todo = _plan(cfg, trace_path, max_sessions)
  root.mkdir(parents=True, exist_ok=True)
  log(f"features {trace_path}: {len(sessions)} sessions, {len(sessions) - len(todo)} cached "
      f"in {root}")
  if todo:
    if llm is None:
      # not `import jaxkv`: the package imports this module's users (a BUILD cycle)
      from jaxkv.engine.llm import load
      llm = load(cfg.model, dtype=cfg.dtype, scan_layers=True)   # many shapes: lax.scan
    ex = Extractor(llm, cfg)
    for s in tqdm.tqdm(todo, desc="extract", unit="session", disable=not progress):
      arrs = pack_session(ex.session(s))
      tmp = root / f"{_safe(s.id)}.tmp.npz"
      np.savez(tmp, **arrs)
      tmp.rename(root / f"{_safe(s.id)}.npz")
  out = {}
  for s in sessions:
    with np.load(root / f"{_safe(s.id)}.npz") as z:
      out[s.id] = unpack_rows(s.id, {k: z[k] for k in z.files}, cfg.n_q)
  return out
