"""The Phase-2 objective, eq. 8 of IntentKV (section 3.5):

    L = L_BCE(s, y) + rho * L_rank + gamma * mean sigma(s) + eta * (||M_t||_2 - 1)^2,

rho = 0.05, gamma = 0.01, eta = 0.001. Every term is a separate pure function
of scores s [B, T] (eq. 4 logits), labels y [B, T] int (1 positive, 0
negative, -100 ignored everywhere) and, for the last term, the per-head norms
of the session memory. Terms are computed per row and averaged over the rows
of a batch that have at least one valid token.

Decisions where the paper is silent:

  * BCE: the positive weight (1 - p~) / p~ uses the row's own positive rate p
    (positives / valid tokens), clipped to [0.02, 0.5]; the weighted losses are
    averaged over the row's valid tokens (a plain mean, not divided by the
    total weight). p~ is a constant (no gradient).
  * Ranking: for each positive i and each of the top-k (k = 64, fewer if the
    row has fewer) highest-scoring negatives j, softplus(s_j - s_i), averaged
    over all such pairs of the row. The choice of hard negatives is not
    differentiated (top-k on stopped scores); the gradient flows through s_j.
  * Keep penalty: mean of sigmoid(s) over the row's valid tokens.
  * Memory norm: ||M_t[l, h]||_2 along the head dimension D for every layer
    and query head of the memory the scorer used (after the unit-norm
    projection, as at inference), (norm - 1)^2 averaged over L x Hq. In this
    trainer M_t comes from the frozen model and the fixed recurrence, so the
    term carries no gradient to the residual head; it is kept (and logged) so
    the objective is eq. 8 exactly and a projection bug would surface.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

IGNORE = -100


def _row_mean(x: jax.Array, w: jax.Array) -> jax.Array:
  """sum(x * w) / sum(w) per row, 0 for a row with no weight. x, w [B, T] -> [B]."""
  den = jnp.sum(w, axis=-1)
  return jnp.sum(x * w, axis=-1) / jnp.where(den > 0, den, 1.0)


def positive_weight(labels: jax.Array, clip=(0.02, 0.5)) -> jax.Array:
  """(1 - p~) / p~ per row, p~ = clip(positives / valid, lo, hi). [B, T] -> [B]."""
  valid = (labels != IGNORE).astype(jnp.float32)
  pos = (labels == 1).astype(jnp.float32)
  p = jnp.sum(pos, -1) / jnp.maximum(jnp.sum(valid, -1), 1.0)
  p = jnp.clip(p, clip[0], clip[1])
  return (1.0 - p) / p


def bce_loss(s: jax.Array, labels: jax.Array, clip=(0.02, 0.5)) -> jax.Array:
  """L_BCE per row [B]: -(w y log sig(s) + (1 - y) log(1 - sig(s))), mean over valid."""
  valid = (labels != IGNORE).astype(jnp.float32)
  y = (labels == 1).astype(jnp.float32)
  w = jax.lax.stop_gradient(positive_weight(labels, clip))[:, None]
  per = -(w * y * jax.nn.log_sigmoid(s) + (1.0 - y) * jax.nn.log_sigmoid(-s))
  return _row_mean(per, valid)


def rank_loss(s: jax.Array, labels: jax.Array, k: int = 64) -> jax.Array:
  """L_rank per row [B]: mean over (positive i, hard negative j) of softplus(s_j - s_i).

  Hard negatives are the k highest-scoring negatives of the row.
  """
  neg = labels == 0
  pos = (labels == 1).astype(jnp.float32)
  k = min(int(k), s.shape[-1])
  _, idx = jax.lax.top_k(jnp.where(neg, jax.lax.stop_gradient(s), -jnp.inf), k)
  s_neg = jnp.take_along_axis(s, idx, axis=-1)                           # [B, k]
  neg_ok = jnp.take_along_axis(neg, idx, axis=-1).astype(jnp.float32)    # fewer than k
  pair = jax.nn.softplus(s_neg[:, None, :] - s[:, :, None])              # [B, T, k]
  w = pos[:, :, None] * neg_ok[:, None, :]
  den = jnp.sum(w, axis=(1, 2))
  return jnp.sum(pair * w, axis=(1, 2)) / jnp.where(den > 0, den, 1.0)


def keep_penalty(s: jax.Array, labels: jax.Array) -> jax.Array:
  """mean sigmoid(s) over valid tokens, per row [B]."""
  return _row_mean(jax.nn.sigmoid(s), (labels != IGNORE).astype(jnp.float32))


def memory_norm_penalty(mnorm: jax.Array) -> jax.Array:
  """(||M_t[l, h]||_2 - 1)^2 averaged over layers and heads: mnorm [B, L, Hq] -> [B]."""
  return jnp.mean((mnorm - 1.0) ** 2, axis=(1, 2))


def total_loss(s: jax.Array, labels: jax.Array, mnorm: jax.Array, *, rho: float = 0.05,
               gamma: float = 0.01, eta: float = 0.001, clip=(0.02, 0.5),
               hard_negatives: int = 64) -> tuple[jax.Array, dict]:
  """Eq. 8 averaged over the rows with a valid token; returns (loss, per-term dict)."""
  terms = dict(bce=bce_loss(s, labels, clip), rank=rank_loss(s, labels, hard_negatives),
               keep=keep_penalty(s, labels), mem=memory_norm_penalty(mnorm))
  row = terms["bce"] + rho * terms["rank"] + gamma * terms["keep"] + eta * terms["mem"]
  ok = jnp.any(labels != IGNORE, axis=-1).astype(jnp.float32)
  den = jnp.maximum(jnp.sum(ok), 1.0)
  return jnp.sum(row * ok) / den, {k: jnp.sum(v * ok) / den for k, v in terms.items()}


# ----------------------------------------------------------------------------- metrics
def recall_at(scores: np.ndarray, labels: np.ndarray, budget: int) -> tuple[int, int]:
  """(kept positives, positives) keeping the top-`budget` of one row's window."""
  pos = np.asarray(labels) == 1
  if scores.size <= budget:
    return int(pos.sum()), int(pos.sum())
  top = np.argpartition(-np.asarray(scores), budget - 1)[:budget]
  return int(pos[top].sum()), int(pos.sum())


def random_kept_at(labels: np.ndarray, budget: int) -> float:
  """Expected kept positives when a uniformly random `budget` of one row's window is
  kept: the chance line beside `recall_at`."""
  labels = np.asarray(labels)
  pos = int((labels == 1).sum())
  return float(pos) if labels.size <= budget else pos * budget / labels.size


@dataclasses.dataclass
class RecallAtBudget:
  """Micro-averaged future-evidence recall@C* of the Phase-1 rule vs Phase-2 scores,
  beside a random top-C* pick's expected recall (the chance line)."""
  budget: int
  kept1: int = 0
  kept2: int = 0
  kept_random: float = 0.0
  kept_random_over: float = 0.0
  positives: int = 0
  rows: int = 0
  kept1_over: int = 0
  kept2_over: int = 0
  positives_over: int = 0
  rows_over: int = 0

  def add(self, rule: np.ndarray, phase2: np.ndarray, labels: np.ndarray) -> None:
    """One row: rule / phase2 scores and labels over its candidate window."""
    a1, p = recall_at(rule, labels, self.budget)
    a2, _ = recall_at(phase2, labels, self.budget)
    self.kept1, self.kept2, self.positives, self.rows = (self.kept1 + a1, self.kept2 + a2,
                                                        self.positives + p, self.rows + 1)
    chance = random_kept_at(labels, self.budget)
    self.kept_random += chance
    if np.asarray(rule).size > self.budget:
      self.kept1_over += a1
      self.kept2_over += a2
      self.kept_random_over += chance
      self.positives_over += p
      self.rows_over += 1

  def summary(self, prefix: str = "") -> dict:
    div = lambda a, b: a / b if b else float("nan")
    return {f"{prefix}recall_phase1": div(self.kept1, self.positives),
            f"{prefix}recall_phase2": div(self.kept2, self.positives),
            f"{prefix}recall_phase1_over": div(self.kept1_over, self.positives_over),
            f"{prefix}recall_phase2_over": div(self.kept2_over, self.positives_over),
            f"{prefix}recall_random": div(self.kept_random, self.positives),
            f"{prefix}recall_random_over": div(self.kept_random_over, self.positives_over),
            f"{prefix}rows_over_budget": self.rows_over, f"{prefix}positives": self.positives}
