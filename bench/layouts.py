"""How the projection weights are stored, A/B in one process: [in, out], [out, in], fused.

    python bench/layouts.py [--model=smollm2-135m] [--rows=1,8,384] [--reps=3]
        [--out=results.json]

Two parts, each alternating between the variants within every round (the median
of `--reps` rounds is reported, as a ratio to the [in, out] storage):
- **GEMMs alone**: one decode step's projections for every layer of the model's
  shapes (q, k, v, o, gate, up, down; random weights, no attention) on `--rows`
  rows, stored [in, out] (`x @ w`), [out, in] (torch's `nn.Linear` layout, the
  unrolled layout's default: `jaxkv.models.llama.proj`) and fused [in, out]
  (q|k|v and gate|up concatenated into one wider GEMM each, as vLLM's merged
  linear layers do), and fused [out, in];
- **the engine's steps** on the real weights in the unrolled layout, [in, out] vs
  [out, in]: a decode call (`driver.decode_scan`, batch 8, `--context` cached
  tokens, 16 steps) and prefill chunks (`driver.chunk_step`: 1 x 48, 8 x 48,
  1 x 256 tokens).
bench/throughput.py's `--layouts=unrolled,unrolled_in_out` times the same two
storages end to end beside HF transformers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

import common
from jaxkv.engine import driver
from jaxkv.engine.llm import load
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import proj

FLAGS = flags.FLAGS
STORAGES = ("in_out", "out_in", "fused", "fused_out_in")


def define_flags():
  """Command-line flags (defined only when run as a script)."""
  flags.DEFINE_string("model", "smollm2-135m", "preset name, .gguf file or HF directory")
  flags.DEFINE_list("rows", ["1", "8", "384"], "GEMM rows (M) of the GEMMs-alone part")
  flags.DEFINE_integer("context", 128, "cached tokens per row of the decode call")
  flags.DEFINE_integer("reps", 3, "alternating rounds; medians reported")
  flags.DEFINE_string("out", None, "write JSON rows here")


def layer_weights(cfg, storage: str, seed: int = 0) -> list[dict[str, jax.Array]]:
  """Random projections of every layer in `storage` (the same values in each)."""
  rng = np.random.default_rng(seed)
  d, f = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
  out = []
  for _ in range(cfg.num_layers):
    w = {k: 0.02 * rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    if storage == "out_in":
      w = {k + "_t": v.T.copy() for k, v in w.items()}
    elif storage.startswith("fused"):
      w = {"wqkv": np.concatenate([w["wq"], w["wk"], w["wv"]], 1), "wo": w["wo"],
           "wgu": np.concatenate([w["w_gate"], w["w_up"]], 1), "w_down": w["w_down"]}
      if storage == "fused_out_in":
        w = {k + "_t": v.T.copy() for k, v in w.items()}
    out.append({k: jnp.asarray(v) for k, v in w.items()})
  return out


def gemms(cfg):
  """A jitted function: x [M, D] through every layer's projections (residual adds,
  the K / V outputs folded in by repetition to the query width, SwiGLU)."""
  q_w = cfg.num_heads * cfg.head_dim
  kv_w = cfg.num_kv_heads * cfg.head_dim
  f = cfg.intermediate_size
  rep = q_w // kv_w

  def run(layers, x):
    for p in layers:
      if "wqkv" in p or "wqkv_t" in p:
        qkv = proj(x, p, "wqkv")
        q, k, v = qkv[:, :q_w], qkv[:, q_w:q_w + kv_w], qkv[:, q_w + kv_w:]
      else:
        q, k, v = proj(x, p, "wq"), proj(x, p, "wk"), proj(x, p, "wv")
      x = x + proj(q + jnp.tile(k, (1, rep)) + jnp.tile(v, (1, rep)), p, "wo")
      if "wgu" in p or "wgu_t" in p:
        gu = proj(x, p, "wgu")
        gate, up = gu[:, :f], gu[:, f:]
      else:
        gate, up = proj(x, p, "w_gate"), proj(x, p, "w_up")
      x = x + proj(jax.nn.silu(gate) * up, p, "w_down")
    return x
  return jax.jit(run)


def _alternate(fns: dict, reps: int, inner: int = 5) -> dict[str, float]:
  """Median seconds per call of each fn, alternating between them each round."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      times[k].append(common.timeit(fn, reps=inner))
  return {k: float(np.median(v)) for k, v in times.items()}


def _decode(model, batch: int, context: int, steps: int = 16):
  """A decode call's closure (state threaded through: the pool is donated)."""
  import profile_decode  # bench/: its inputs are the engine's shapes
  from jaxkv.engine.llm import LLM
  graphdef, weights = nnx.split(model)
  a = profile_decode.decode_inputs(LLM(model, None), batch, context, steps)
  rest = [a[k] for k in ("tokens", "positions", "slot_map", "remaining")]
  dyn = dict(stop_ids=a["stop_ids"], sampling=a["sampling"])
  state = {"kv": a["kv"]}

  def call():
    out, state["kv"] = driver.decode_scan(graphdef, weights, state["kv"], *rest, **dyn,
                                          num_steps=steps, greedy_only=True)
    return out
  return call


def _prefill(model, b: int, c: int):
  graphdef, weights = nnx.split(model)
  state = {"kv": kv_state.init_slots(model.cfg, 1 + b * c, jnp.float32)}
  smap = jnp.asarray(1 + np.arange(b * c, dtype=np.int32).reshape(b, c))
  tokens = jnp.ones((b, c), jnp.int32)
  pos = jnp.asarray(np.broadcast_to(np.arange(c, dtype=np.int32), (b, c)))
  read = jnp.full((b, 1), c - 1, jnp.int32)

  def call():
    step, state["kv"] = driver.chunk_step(graphdef, weights, state["kv"], tokens, pos, smap,
                                          read=read)
    return step.token
  return call


def table(rows: list[dict], title: str = "layouts") -> common.Table:
  """ms per call (per step for decode) of each storage and its ratio to [in, out]."""
  return common.Table(title, ("part", "shape", "storage", "ms", "vs in_out"), [
      (r["part"], r["shape"], r["storage"], f"{r['ms']:.2f}", f"{r['vs_in_out']:.2f}x")
      for r in rows])


def main(argv):
  del argv
  base = load(FLAGS.model)
  cfg = base.config
  rows = []
  fn = gemms(cfg)
  weights = {s: layer_weights(cfg, s) for s in STORAGES}
  for m in [int(r) for r in FLAGS.rows]:
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, cfg.hidden_size),
                                                             dtype=np.float32))
    ref = np.asarray(fn(weights["in_out"], x))
    for s in STORAGES[1:]:            # the same function in every storage
      np.testing.assert_allclose(np.asarray(fn(weights[s], x)), ref, rtol=1e-4, atol=1e-4)
    t = _alternate({s: (lambda s=s: fn(weights[s], x)) for s in STORAGES}, FLAGS.reps)
    rows += [{"part": "gemms", "shape": f"M = {m}", "storage": s, "ms": round(t[s] * 1e3, 2),
              "vs_in_out": round(t["in_out"] / t[s], 3)} for s in STORAGES]
  models = {"in_out": base.model.relayout(False, out_in=False),
            "out_in": base.model.relayout(False, out_in=True)}
  cases = {f"decode b8, {FLAGS.context} cached (per step)":
           {s: _decode(m, 8, FLAGS.context) for s, m in models.items()}}
  for b, c in ((1, 48), (8, 48), (1, 256)):
    cases[f"prefill {b} x {c}"] = {s: _prefill(m, b, c) for s, m in models.items()}
  for name, fns in cases.items():
    t = _alternate(fns, FLAGS.reps, inner=3)
    per = 16 if name.startswith("decode") else 1
    rows += [{"part": "step", "shape": name, "storage": s, "ms": round(t[s] / per * 1e3, 2),
              "vs_in_out": round(t["in_out"] / t[s], 3)} for s in fns]
  print(f"\n{FLAGS.model}: projections' storage, median of {FLAGS.reps} alternating rounds, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}; vs in_out > 1: faster")
  print(table(rows).markdown())
  common.write_rows(FLAGS.out, rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
