"""Sharding on JAX's own SPMD runtime: one logical-axis -> mesh-axis rules table.

The mesh has two axes, ("data", "model"). Every array jaxkv places on it names
its dimensions with logical axes; `RULES` maps each logical axis to a mesh axis
(or None: replicated), and `spec` turns (logical axes, sizes) into a
`PartitionSpec`:

    logical axis   mesh axis   what it is
    batch          data        rows of a batch (tokens, positions, slot maps)
    slots          data        KV pool slots (pages are split across data shards)
    q_heads        model       query heads (wq / bq columns, wo rows): tensor parallel
    kv_heads       model       KV heads (wk / wv / bk / bv columns, the pool's head axis)
    mlp            model       MLP hidden units (w_gate / w_up columns, w_down rows)
    vocab          model       embedding rows and LM-head columns
    embed, head_dim, layers, rank    None (replicated)

A dimension is sharded only when its unit count divides by the mesh axis size
(heads count as heads, not head_dim-wide columns); otherwise it is replicated.
That is what keeps KV heads whole when the model axis exceeds or does not
divide them (SmolLM2 has 3, Qwen2.5-0.5B has 2): each model shard then holds all
KV heads, as vLLM's tpu-inference does. Collisions (two dimensions of one array
on the same mesh axis) are refused when a spec is built and checked for the
whole parameter table at import.

Only placement lives here: jit propagates these shardings through the model
(computation follows data), so outputs equal the single-device run up to
float reassociation in the sharded reductions. Pool slots sharded on `data`
keep jaxkv's global slot numbering (slot 0 stays the SENTINEL of slot maps);
the engine's allocator is shard-aware (`PagedAllocator(shards=)`: one page range
per data shard, its first page reserved as the shard's sentinel page, each batch
row allocating on its own shard), so a row's own KV lives with its row; adopted
prefix-cache slots may come from another shard (correct, with cross-shard gathers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import distributed
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import PROJECTIONS, stored_name

MESH_AXES = ("data", "model")

RULES: dict[str, str | None] = {
    "batch": "data",
    "slots": "data",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "embed": None,
    "head_dim": None,
    "layers": None,
    "rank": None,
}

# Trailing logical axes of each parameter by its leaf name; leading dimensions
# (the stacked layer axis) are "layers". Names not listed (LoRA factors) are replicated.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "wq": ("embed", "q_heads"),
    "bq": ("q_heads",),
    "wk": ("embed", "kv_heads"),
    "bk": ("kv_heads",),
    "wv": ("embed", "kv_heads"),
    "bv": ("kv_heads",),
    "wo": ("q_heads", "embed"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
# Projections stored [out, in] (`jaxkv.models.llama`'s `out_in`, name + "_t").
PARAM_AXES.update({stored_name(name, out_in=True): PARAM_AXES[name][::-1]
                   for name in PROJECTIONS})

POOL_AXES: dict[str, tuple[str, ...]] = {
    "k": ("layers", "slots", "kv_heads", "head_dim"),
    "v": ("layers", "slots", "kv_heads", "head_dim"),
    "positions": ("slots",),
    "vlr": ("layers", "slots", "rank"),
}


def check_rules(rules: dict[str, str | None], tables: dict[str, tuple[str, ...]]) -> None:
  """Raises ValueError if an entry of `tables` would put two of its dimensions on
  one mesh axis, or names a logical axis `rules` lacks."""
  for name, axes in tables.items():
    unknown = [a for a in axes if a not in rules]
    if unknown:
      raise ValueError(f"{name}: logical axes {unknown} have no rule in {sorted(rules)}")
    mesh_axes = [rules[a] for a in axes if rules[a] is not None]
    if len(mesh_axes) != len(set(mesh_axes)):
      raise ValueError(f"{name}: logical axes {axes} collide on mesh axes {mesh_axes}")


check_rules(RULES, {**PARAM_AXES, **POOL_AXES})


@dataclasses.dataclass(frozen=True)
class Units:
  """How many whole units each logical axis has (divisibility is judged in these)."""
  sizes: dict[str, int]

  @classmethod
  def of(cls, model_cfg, num_slots: int | None = None) -> Units:
    s = dict(q_heads=model_cfg.num_heads, kv_heads=model_cfg.num_kv_heads,
             mlp=model_cfg.intermediate_size, vocab=model_cfg.vocab_size)
    if num_slots is not None:
      s["slots"] = num_slots
    return cls(s)


def spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, units: Units | None = None,
         rules: dict[str, str | None] = RULES, name: str = "array") -> P:
  """PartitionSpec of an array with logical `axes` (its last len(axes) dims; any
  leading dims are replicated). A dim is sharded on its rule's mesh axis when its
  unit count (`units`, else the dim size) divides by that axis's size."""
  lead = len(shape) - len(axes)
  if lead < 0:
    raise ValueError(f"{name}: {len(axes)} logical axes {axes} for shape {shape}")
  out: list[str | None] = [None] * lead
  used = set()
  for axis, size in zip(axes, shape[lead:]):
    mesh_axis = rules[axis]
    n = (units.sizes.get(axis, size) if units else size)
    if mesh_axis is None or mesh.shape[mesh_axis] == 1 or n % mesh.shape[mesh_axis]:
      out.append(None)
      continue
    if mesh_axis in used:
      raise ValueError(f"{name}: logical axes {axes} collide on mesh axis {mesh_axis!r}")
    used.add(mesh_axis)
    out.append(mesh_axis)
  return P(*out)


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
  """A ("data", "model") mesh over `devices` (default: all of this process's view,
  i.e. every device of every process after `jax.distributed.initialize`)."""
  devices = jax.devices() if devices is None else list(devices)
  if data < 1 or model < 1:
    raise ValueError(f"mesh sizes must be >= 1, got data={data} model={model}")
  if data * model != len(devices):
    raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but "
                     f"{len(devices)} are visible ({devices[0].platform}); on CPU set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={data * model}")
  return Mesh(np.asarray(devices).reshape(data, model), MESH_AXES)


def _leaf_name(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  keys = [k for k in keys if isinstance(k, str) and k not in ("value", "raw_value")]
  return keys[-1] if keys else ""


def param_shardings(weights: Any, mesh: Mesh, model_cfg) -> Any:
  """NamedShardings for every array of `nnx.split(model)[1]` (same pytree)."""
  units = Units.of(model_cfg)

  def one(path, x):
    name = _leaf_name(path)
    axes = PARAM_AXES.get(name)
    if axes is None:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, spec(axes, x.shape, mesh, units, name=name))
  return jax.tree_util.tree_map_with_path(one, weights)


def pool_shardings(kv: Any, mesh: Mesh, model_cfg) -> Any:
  """NamedShardings for a KVPool's fields (None fields stay None); `kv` may be
  abstract (`jax.eval_shape`)."""
  fields = {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)
            if hasattr(getattr(kv, f.name), "shape")}
  units = Units.of(model_cfg, num_slots=fields["k"].shape[1])
  out = {name: NamedSharding(mesh, spec(POOL_AXES[name], x.shape, mesh, units, name=name))
         for name, x in fields.items()}
  return dataclasses.replace(kv, **out)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], batch_axis: int = 0) -> NamedSharding:
  """Rows on `data` (when the batch divides), everything else replicated."""
  parts: list[str | None] = [None] * len(shape)
  if shape and shape[batch_axis] % mesh.shape["data"] == 0:
    parts[batch_axis] = RULES["batch"]
  return NamedSharding(mesh, P(*parts))


def shard_weights(weights: Any, mesh: Mesh, model_cfg) -> Any:
  """`nnx.split(model)[1]` placed on the mesh. Host copies first: a mesh may span
  other processes' devices, and every process holds the same values."""
  host = jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, weights)
  distributed.barrier("shard_weights")   # processes load weights at their own pace
  return jax.device_put(host, param_shardings(weights, mesh, model_cfg))


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Every array of `tree` whole on every device of the mesh (LoRA adapter stacks:
  small, and each row picks its own adapter's B). Host copies first, as
  `shard_weights`."""
  host = jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)
  distributed.barrier("replicate")
  return jax.device_put(host, NamedSharding(mesh, P()))


def init_pool(model_cfg, cache_cfg, mesh: Mesh, lr_rank: int = 0):
  """`jaxkv.kv.state.init_pool` built in place on the mesh (no single-device copy)."""
  make = functools.partial(kv_state.init_pool, model_cfg, cache_cfg, lr_rank=lr_rank)
  return jax.jit(make, out_shardings=pool_shardings(jax.eval_shape(make), mesh, model_cfg))()
