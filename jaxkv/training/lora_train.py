"""LRAgent role adapters: shared-A multi-LoRA trained jointly with Optax.

Three adapters (plan, action, reflect; `jaxkv.data.agents`) over one frozen
base model: A (one per target and layer) is shared and trained by every role,
B_i only by role i. Each example is one agent call of a replayed tool-use
trajectory, teacher-forced: the loss is the mean next-token NLL of the call's
gold output (plan: thought + next tool name; action: the call's JSON
arguments; reflect: Reflect[right] / Reflect[wrong], half of the trajectories
carrying another session's final answer) given the trajectory before it.

Decisions (LRAgent trains on its own QA agent data; these are ours):

  * Context: the last `max_context` tokens before the call (left-truncated),
    targets capped at `max_target` tokens, so a step costs one short forward +
    backward on this 2-core CPU. Adapters are then used on full trajectories.
  * Sampling: each micro-step draws a role uniformly, then one of its examples
    (reflect has ~1 example per session, plan/action ~5), from a generator
    seeded by (seed, step) so a resumed run replays exactly the same stream.
  * One example per micro-step (no padding waste across rows); AdamW with
    linear warm-up then constant lr, MultiSteps(grad_accum).
  * Evaluation: per-role held-out NLL under the base model (adapter -1) and
    under each adapter (a 4 x 3 matrix), on up to `val_examples_per_role`
    held-out calls per role, so "the adapters differ" is a measured statement.

Outputs in out_dir: log.csv (per micro-step), metrics.jsonl (per evaluation),
ckpt/ (Orbax: LoRA params + optimiser state + step; a rerun resumes) and
adapters/<role>/ (PEFT format, `jaxkv.models.lora.load_peft`).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxkv import jsonl
from jaxkv.config import COMPILER_OPTIONS
from jaxkv.data import agents
from jaxkv.engine import driver
from jaxkv.kv import plan
from jaxkv.models import lora as lora_lib
from jaxkv.models.forward import LoraInputs
from jaxkv.training import train as train_lib
from jaxkv.training.config import LoraTrainConfig

LOG_FIELDS = ("step", "update", "role", "session", "tokens", "loss", "lr", "sec")


@dataclasses.dataclass(frozen=True)
class Example:
  role: int
  session: str
  prompt: np.ndarray    # [P] int32
  target: np.ndarray    # [G] int32


def examples(trajectories, max_context: int, max_target: int) -> list[Example]:
  """One example per agent call: (last max_context tokens before it, its first max_target)."""
  out = []
  for t in trajectories:
    for c in t.calls:
      if c.start == 0:
        continue
      out.append(Example(c.role, t.session, t.ids[max(0, c.start - max_context):c.start],
                         t.ids[c.start:min(c.end, c.start + max_target)]))
  return out


def make_batch(ex: Example, role: int | None = None) -> dict:
  """Padded arrays of one example; numpy. Lengths are bucketed (sequence: powers of two
  up to 128, then multiples of 128; targets: powers of two), bounding recompiles."""
  p, g = ex.prompt.size, ex.target.size
  t = plan.bucket(p + g, 64, plan.CHUNK_FINE)
  tt = plan.chunk_len(g)
  tokens = np.zeros((1, t), np.int32)
  tokens[0, :p + g] = np.concatenate([ex.prompt, ex.target])
  pos = np.full((1, t), -1, np.int32)
  pos[0, :p + g] = np.arange(p + g)
  idx = np.zeros((1, tt), np.int32)
  idx[0, :g] = p - 1 + np.arange(g)                 # hidden row that predicts target j
  tgt = np.zeros((1, tt), np.int32)
  tgt[0, :g] = ex.target
  mask = np.zeros((1, tt), bool)
  mask[0, :g] = True
  return dict(tokens=tokens, positions=pos, index=idx, targets=tgt, mask=mask,
              adapter=np.array([ex.role if role is None else role], np.int32))


def _nll(lora_params, lcfg, graphdef, weights, batch, attn_impl):
  """Mean NLL of the batch's target tokens; lora_params: MultiLoRA pure dict.

  The driver's chunk forward without a pool (the pure function: this runs inside
  the training step's own jit): the sequence attends to itself, and logits are
  computed only at the rows that predict a target.
  """
  lora = LoraInputs(lora_lib.from_params(lora_params, lcfg), batch["adapter"])
  out, _ = driver.forward_chunk(graphdef, weights, None, batch["tokens"], batch["positions"],
                                read=batch["index"], targets=batch["targets"], lora=lora,
                                attn_impl=attn_impl)
  n = jnp.maximum(jnp.sum(batch["mask"]), 1)
  return -jnp.sum(jnp.where(batch["mask"], out.logprob, 0.0)) / n


@functools.lru_cache(maxsize=4)
def make_optimizer(lr: float, warmup: int, weight_decay: float, grad_accum: int):
  sched = optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)),
                                optax.constant_schedule(lr)], [max(warmup, 1)])
  return optax.MultiSteps(optax.adamw(sched, weight_decay=weight_decay),
                          every_k_schedule=grad_accum)


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("lcfg", "graphdef", "tx", "attn_impl"),
                   donate_argnums=(0, 1))
def train_step(lora_params, opt_state, weights, batch, *, lcfg, graphdef, tx, attn_impl):
  """One micro-step on the LoRA params (pure dict); the base weights get no gradient."""
  loss, grads = jax.value_and_grad(_nll)(lora_params, lcfg, graphdef, weights, batch, attn_impl)
  updates, opt_state = tx.update(grads, opt_state, lora_params)
  return optax.apply_updates(lora_params, updates), opt_state, loss


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("lcfg", "graphdef", "attn_impl"))
def eval_step(lora_params, weights, batch, *, lcfg, graphdef, attn_impl):
  return _nll(lora_params, lcfg, graphdef, weights, batch, attn_impl)


def evaluate(lora_params, weights, val: dict[int, list[Example]], *, lcfg, graphdef,
             attn_impl) -> dict:
  """{"nll": {adapter name or "base": {role: mean token NLL}}} over held-out examples."""
  out = {}
  for a in (-1, 0, 1, 2):
    name = "base" if a < 0 else agents.ROLES[a]
    out[name] = {}
    for r, exs in val.items():
      tot = cnt = 0.0
      for ex in exs:
        v = eval_step(lora_params, weights, make_batch(ex, role=a), lcfg=lcfg,
                      graphdef=graphdef, attn_impl=attn_impl)
        tot += float(v) * ex.target.size
        cnt += ex.target.size
      out[name][agents.ROLES[r]] = tot / max(cnt, 1)
  return {"nll": out}


def pick(by_role: dict[int, list[Example]], seed: int, step: int) -> Example:
  """The example of micro-step `step`: a uniform role, then a uniform example of it."""
  rng = np.random.default_rng([seed, step])
  roles = sorted(r for r, v in by_role.items() if v)
  r = roles[int(rng.integers(len(roles)))]
  return by_role[r][int(rng.integers(len(by_role[r])))]


def split_by_role(exs: list[Example], cap: int | None = None) -> dict[int, list[Example]]:
  out = {r: [] for r in range(len(agents.ROLES))}
  for e in exs:
    if cap is None or len(out[e.role]) < cap:
      out[e.role].append(e)
  return out


def train(cfg: LoraTrainConfig, llm, train_ex: list[Example], val_ex: list[Example], *,
          log=print) -> dict:
  """Runs (or resumes) training; returns {"adapters": dir, "history": [...], "train_s"}."""
  import tqdm

  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  lcfg = cfg.lora_config()
  module = lora_lib.MultiLoRA(llm.config, lcfg, rngs=nnx.Rngs(cfg.seed))
  params = nnx.to_pure_dict(nnx.state(module))
  graphdef, weights = llm.graphdef, llm.weights
  tx = make_optimizer(cfg.lr, cfg.warmup, cfg.weight_decay, cfg.grad_accum)
  opt_state = tx.init(params)
  mgr = train_lib._manager(out / "ckpt", 3)
  start = 0
  got = train_lib.restore_checkpoint(mgr, params, opt_state)
  if got is not None:
    params, opt_state, meta = got
    start = int(meta["step"])
    log(f"resumed from step {start}")
  by_role = split_by_role(train_ex)
  val = split_by_role(val_ex, cfg.val_examples_per_role)
  kw = dict(lcfg=lcfg, graphdef=graphdef, attn_impl=cfg.attn_impl)
  history = []
  if start == 0:
    m = dict(step=0, **evaluate(params, weights, val, **kw))
    history.append(m)
    jsonl.append(out / "metrics.jsonl", m)
    log(f"step 0 held-out NLL {json.dumps(m['nll'])}")
  t0 = time.perf_counter()
  new_log = not (out / "log.csv").exists() or start == 0
  with open(out / "log.csv", "w" if new_log else "a", newline="") as f:
    w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
    if new_log:
      w.writeheader()
    bar = tqdm.tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="lora",
                    disable=not cfg.progress)
    for step in bar:
      ex = pick(by_role, cfg.seed, step)
      ts = time.perf_counter()
      params, opt_state, loss = train_step(params, opt_state, weights, make_batch(ex), tx=tx,
                                           **kw)
      loss = float(loss)
      w.writerow(dict(step=step, update=(step + 1) // cfg.grad_accum, role=agents.ROLES[ex.role],
                      session=ex.session, tokens=ex.prompt.size + ex.target.size,
                      loss=round(loss, 6), lr=cfg.lr, sec=round(time.perf_counter() - ts, 3)))
      bar.set_postfix(loss=f"{loss:.3f}")
      done = step + 1
      if done % cfg.ckpt_every == 0 or done == cfg.steps:
        f.flush()
        train_lib.save_checkpoint(mgr, done, params, opt_state, {"step": done})
      if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
        m = dict(step=done, **evaluate(params, weights, val, **kw))
        history.append(m)
        jsonl.append(out / "metrics.jsonl", m)
        log(f"step {done} held-out NLL {json.dumps(m['nll'])}")
  adapters = out / "adapters"
  lora_lib.save_peft(lora_lib.from_params(params, lcfg), lcfg, adapters, base_model=cfg.model)
  if not history and (out / "metrics.jsonl").exists():
    history = [json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])]
  return dict(adapters=str(adapters), history=history, train_s=time.perf_counter() - t0)
