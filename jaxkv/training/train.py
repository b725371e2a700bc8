"""IntentKV Phase-2 optimisation: only the residual head trains (sections 3.3, 3.5, 4.1).

Features come precomputed from the frozen model (`features.py`), so a step is
the head alone: phi_j (eq. 5) from the stored k_bar, m_bar and rule, the
cross-attention over K_bar^q (eq. 6), s = rule + alpha * MLP (eq. 4, alpha
unclipped while training) and the loss of eq. 8 (`loss.py`).

Loop: AdamW (lr 1e-3, wd 0.01) wrapped in `optax.MultiSteps` (grad-accum 8),
one row per micro-step (rows differ in length; each is padded to a power-of-two
bucket, so a handful of shapes compile), `epochs` epochs of
`examples_per_epoch` rows reservoir-sampled (seed + epoch) from the training
rows; sessions are shuffled between epochs and a session's sampled rows are
replayed in increasing turn order. Per micro-step the loss terms and alpha go
to out_dir/log.csv; each epoch ends with validation (loss, recall@C* of the
Phase-1 rule vs the Phase-2 scores, alpha) in out_dir/metrics.jsonl, and an
Orbax checkpoint (params, optimizer state, position) in out_dir/ckpt; a rerun
resumes from the latest. The final head is written to out_dir/head (loadable
with `load_head`).

Recall@C* is `loss.RecallAtBudget` over the candidate window [sys_len, qs).

Decisions where the paper is silent:

  * One row per micro-step (B = 1, no cross-row padding waste); MultiSteps
    averages 8 micro-gradients per AdamW update, so an update sees 8 rows.
    Leftover micro-steps at an epoch end carry into the next epoch's first
    update (MultiSteps keeps counting).
  * The head is initialised with nnx.Rngs(seed); alpha is unclipped while
    training and clipped to [-5, 5] for the validation scores.
  * Validation also runs before the first step (epoch 0), where Phase-2 equals
    Phase-1 exactly (fc2 = 0, alpha = 1): a built-in sanity check.
  * Checkpoints hold params + optimiser state + (epoch, micro); because the
    epoch sample depends only on (seed, epoch), a resumed run replays exactly
    what an uninterrupted one would.
"""

from __future__ import annotations

import csv
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from jaxkv import jsonl
from jaxkv.config import COMPILER_OPTIONS
from jaxkv.kv import plan
from jaxkv.policies.pruning import residual
from jaxkv.policies.pruning.residual import ResidualHead, load_head, save_head  # noqa: F401 (load_head: re-exported)
from jaxkv.training import loss as loss_lib
from jaxkv.training.features import IGNORE, PrunerTrainConfig, Row

LOG_FIELDS = ("epoch", "micro", "update", "session", "turn", "tokens", "loss", "bce", "rank",
              "keep", "mem", "alpha")


# ----------------------------------------------------------------------------- batches

def make_batch(rows: list[Row], t: int | None = None, n_q: int | None = None) -> dict:
  """Pads rows to [B, T] / [B, n_q] (power-of-two buckets unless given); numpy dict."""
  d = rows[0].kbar.shape[1]
  # powers of two (fine = 4096): few compiles across the head's many ragged rows
  t = t or plan.bucket(max(r.rule.size for r in rows), 64, 4096)
  n_q = n_q or plan.bucket(max(max(r.kq.shape[0], 1) for r in rows), 16, 4096)
  b = len(rows)
  out = dict(rule=np.zeros((b, t), np.float32), labels=np.full((b, t), IGNORE, np.int32),
             kbar=np.zeros((b, t, d), np.float32), cand=np.zeros((b, t), bool),
             kq=np.zeros((b, n_q, d), np.float32), kq_valid=np.zeros((b, n_q), bool),
             mbar=np.stack([r.mbar for r in rows]).astype(np.float32),
             mnorm=np.stack([r.mnorm for r in rows]).astype(np.float32))
  for i, r in enumerate(rows):
    m, q = r.rule.size, min(r.kq.shape[0], n_q)
    out["rule"][i, :m] = r.rule
    out["labels"][i, :m] = r.labels
    out["kbar"][i, :m] = r.kbar
    out["cand"][i, :m] = True
    out["kq"][i, :q] = r.kq[r.kq.shape[0] - q:]
    out["kq_valid"][i, :q] = True
  return out


def features_from_batch(batch) -> jax.Array:
  """Eq. 5 from stored features (`residual.phi`, serving's copy): phi [B, T, 3D+1],
  zero outside the candidates."""
  return residual.phi(batch["kbar"], batch["mbar"], batch["rule"], batch["cand"])


def head_scores(graphdef, params, batch, clip_alpha: bool = False) -> jax.Array:
  """Phase-2 scores s [B, T] (eq. 4) of the head `params` (a pure dict)."""
  head = nnx.merge(graphdef, nnx.State(params))
  s = head(features_from_batch(batch), batch["kq"], batch["kq_valid"], batch["rule"],
           clip_alpha=clip_alpha)
  return jnp.where(batch["cand"], s, 0.)


def loss_settings(cfg: PrunerTrainConfig) -> tuple:
  """The loss hyper-parameters (a hashable jit-static tuple, so runs share compiles)."""
  return (cfg.rho, cfg.gamma, cfg.eta, tuple(cfg.pos_clip), cfg.hard_negatives)


def _loss_fn(params, graphdef, batch, lc: tuple):
  rho, gamma, eta, clip, hard = lc
  s = head_scores(graphdef, params, batch)
  return loss_lib.total_loss(s, batch["labels"], batch["mnorm"], rho=rho, gamma=gamma,
                             eta=eta, clip=clip, hard_negatives=hard)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float, weight_decay: float, grad_accum: int):
  return optax.MultiSteps(optax.adamw(lr, weight_decay=weight_decay),
                          every_k_schedule=grad_accum)


def make_optimizer(cfg: PrunerTrainConfig) -> optax.GradientTransformation:
  """AdamW(lr, wd) under MultiSteps(grad_accum); cached, so jit sees the same object."""
  return _optimizer(cfg.lr, cfg.weight_decay, cfg.grad_accum)


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("graphdef", "tx", "lc"),
                   donate_argnums=(1, 2))
def train_step(graphdef, params, opt_state, batch, *, tx, lc):
  """One micro-step: grads of eq. 8 (settings `lc`, see `loss_settings`) on `batch`;
  MultiSteps applies the averaged update every grad_accum micro-steps."""
  (value, terms), grads = jax.value_and_grad(_loss_fn, has_aux=True)(params, graphdef, batch, lc)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, value, terms


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("graphdef", "lc"))
def eval_step(graphdef, params, batch, *, lc):
  """(loss, terms, scores with alpha clipped as at inference) on `batch`."""
  value, terms = _loss_fn(params, graphdef, batch, lc)
  return value, terms, head_scores(graphdef, params, batch, clip_alpha=True)


def evaluate(graphdef, params, rows: list[Row], cfg: PrunerTrainConfig) -> dict:
  """Validation loss (eq. 8 terms), recall@C* (Phase-1 rule vs Phase-2) and alpha.

  Recall is reported at C* = cfg.recall_budget (keys recall_phase1 / _phase2)
  and at C* / 2 (keys prefixed "half_").
  """
  tot, terms_sum = 0.0, {}
  main = loss_lib.RecallAtBudget(cfg.recall_budget)
  half = loss_lib.RecallAtBudget(max(1, cfg.recall_budget // 2))
  for r in rows:
    v, terms, s = eval_step(graphdef, params, make_batch([r]), lc=loss_settings(cfg))
    tot += float(v)
    for k, x in terms.items():
      terms_sum[k] = terms_sum.get(k, 0.0) + float(x)
    s = np.asarray(s[0, :r.rule.size])
    main.add(r.rule, s, r.labels)
    half.add(r.rule, s, r.labels)
  n = max(len(rows), 1)
  out = dict(val_rows=len(rows), val_loss=tot / n, recall_budget=main.budget,
             **main.summary(), half_budget=half.budget, **half.summary("half_"),
             alpha=float(np.asarray(params["alpha"])))
  out.update({f"val_{k}": v / n for k, v in terms_sum.items()})
  return out


# ----------------------------------------------------------------------------- sampling
def epoch_rows(rows_by_session: dict[str, list[Row]], n: int, seed: int, epoch: int) -> list[Row]:
  """Reservoir sample (algorithm R) of n rows, sessions shuffled per epoch, turns in order."""
  rng = np.random.default_rng([seed, epoch])
  order = list(rows_by_session)
  rng.shuffle(order)
  stream = [(si, ri) for si, sid in enumerate(order) for ri in range(len(rows_by_session[sid]))]
  res = []
  for i, item in enumerate(stream):
    if i < n:
      res.append(item)
    else:
      j = int(rng.integers(0, i + 1))
      if j < n:
        res[j] = item
  res.sort()                 # replay order: shuffled sessions, increasing turn
  return [rows_by_session[order[si]][ri] for si, ri in res]


# ----------------------------------------------------------------------------- checkpoints
def _manager(path: pathlib.Path, max_to_keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(path.resolve(),
                               options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save_checkpoint(mgr, step: int, params, opt_state, meta: dict) -> None:
  mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                         opt_state=ocp.args.StandardSave(opt_state),
                                         meta=ocp.args.JsonSave(meta)))
  mgr.wait_until_finished()


def restore_checkpoint(mgr, params, opt_state):
  """(params, opt_state, meta) of the latest checkpoint, or None."""
  step = mgr.latest_step()
  if step is None:
    return None
  ab = jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, opt_state))
  r = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(ab[0]),
                                                opt_state=ocp.args.StandardRestore(ab[1]),
                                                meta=ocp.args.JsonRestore()))
  return r.params, r.opt_state, r.meta


# ----------------------------------------------------------------------------- loop
def train(cfg: PrunerTrainConfig, train_rows: dict[str, list[Row]], val_rows: list[Row], *,
          log=print) -> dict:
  """Runs (or resumes) training; returns a summary with the final head path."""
  import tqdm

  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  if not any(train_rows.values()):
    raise ValueError("no training rows (every row lacks a positive label?)")
  d = next(r for rs in train_rows.values() for r in rs).kbar.shape[1]
  graphdef, state = nnx.split(ResidualHead(d, rngs=nnx.Rngs(cfg.seed)))
  params = nnx.to_pure_dict(state)
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  mgr = _manager(out / "ckpt", cfg.max_to_keep)
  start_epoch, start_micro = 0, 0
  restored = restore_checkpoint(mgr, params, opt_state)
  if restored is not None:
    params, opt_state, meta = restored
    start_epoch, start_micro = int(meta["epoch"]), int(meta["micro"])
    log(f"resumed from {mgr.directory} step {mgr.latest_step()}: epoch {start_epoch} "
        f"micro {start_micro}")
  n_rows = sum(len(v) for v in train_rows.values())
  per_epoch = min(cfg.examples_per_epoch, n_rows)
  log(f"{n_rows} training rows in {len(train_rows)} sessions, {per_epoch} per epoch, "
      f"{len(val_rows)} val rows")
  new_log = not (out / "log.csv").exists()
  logf = open(out / "log.csv", "a", newline="")   # noqa: SIM115 (closed after the epochs)
  writer = csv.DictWriter(logf, fieldnames=LOG_FIELDS)
  if new_log:
    writer.writeheader()
  history = []
  if start_epoch == 0 and start_micro == 0:
    m0 = dict(epoch=0, **evaluate(graphdef, params, val_rows, cfg))
    history.append(m0)
    jsonl.append(out / "metrics.jsonl", m0)
    log("val (init) " + _fmt(m0))
  t0 = time.perf_counter()
  for epoch in range(start_epoch, cfg.epochs):
    rows = epoch_rows(train_rows, per_epoch, cfg.seed, epoch)
    first = start_micro if epoch == start_epoch else 0
    bar = tqdm.tqdm(total=len(rows), initial=first, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                    unit="row", disable=not cfg.progress)
    for micro in range(first, len(rows)):
      r = rows[micro]
      params, opt_state, value, terms = train_step(graphdef, params, opt_state,
                                                   make_batch([r]), tx=tx,
                                                   lc=loss_settings(cfg))
      rec = dict(epoch=epoch + 1, micro=micro + 1, update=int(opt_state.gradient_step),
                 session=r.session, turn=r.turn,
                 tokens=r.rule.size, loss=float(value), alpha=float(params["alpha"]),
                 **{k: float(v) for k, v in terms.items()})
      writer.writerow(rec)
      bar.update(1)
      bar.set_postfix(loss=f"{rec['loss']:.3f}", alpha=f"{rec['alpha']:.3f}")
      if cfg.ckpt_every and (micro + 1) % (cfg.ckpt_every * cfg.grad_accum) == 0:
        logf.flush()
        save_checkpoint(mgr, epoch * len(rows) + micro + 1, params, opt_state,
                        dict(epoch=epoch, micro=micro + 1))
    bar.close()
    logf.flush()
    m = dict(epoch=epoch + 1, train_s=time.perf_counter() - t0,
             **evaluate(graphdef, params, val_rows, cfg))
    history.append(m)
    jsonl.append(out / "metrics.jsonl", m)
    log(f"val (epoch {epoch + 1}) " + _fmt(m))
    save_checkpoint(mgr, (epoch + 1) * len(rows), params, opt_state,
                    dict(epoch=epoch + 1, micro=0))
  logf.close()
  if not history and (out / "metrics.jsonl").exists():     # resumed a finished run
    history = [json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])]
  head_path = save_head(out / "head", d, params)
  mgr.close()
  return dict(head=str(head_path), history=history, train_s=time.perf_counter() - t0)


def _fmt(m: dict) -> str:
  keys = ("val_loss", "recall_phase1", "recall_phase2", "recall_phase1_over",
          "recall_phase2_over", "rows_over_budget", "half_recall_phase1", "half_recall_phase2",
          "alpha")
  return " ".join(f"{k}={m[k]:.4f}" if isinstance(m[k], float) else f"{k}={m[k]}"
                  for k in keys if k in m)
