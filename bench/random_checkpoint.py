"""A model's architecture with random weights, as an HF checkpoint directory, for timing.

    python bench/random_checkpoint.py --model=qwen2.5-coder-0.5b --out=DIR           # here
    python bench/random_checkpoint.py --out=DIR --fill                                # there

Speed does not depend on the weights' values, and a machine that cannot receive
the weights (a GPU reached through a small transfer) can still time the real
architecture: step one (where the weight packages are installed) writes the
preset's `config.json` and tokenizer files, read from its GGUF by transformers,
a few MB; step two (`--fill`, on the timing machine) draws the weights with
transformers' own initialiser (seed `--seed`) and saves them as safetensors
beside them. Both jaxkv (`jaxkv.load(DIR)`) and HF (`from_pretrained(DIR)`)
then load the same checkpoint (vLLM's `--load-format dummy` does the same for
its benchmarks). Results measured on such a checkpoint say so.
"""

from __future__ import annotations

import pathlib

from absl import app, flags

FLAGS = flags.FLAGS


def export_skeleton(model: str, out: pathlib.Path) -> None:
  """config.json + tokenizer files of a preset (or .gguf path) into `out`, no weights."""
  import transformers

  from jaxkv.models import presets
  path = presets.resolve(model)
  if path.is_dir():
    raise ValueError(f"{model} is already an HF directory")
  kw = dict(gguf_file=path.name)
  cfg = transformers.AutoConfig.from_pretrained(str(path.parent), **kw)
  tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
  out.mkdir(parents=True, exist_ok=True)
  cfg.save_pretrained(out)
  tok.save_pretrained(out)
  print(f"{model}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size} -> {out} (no weights)")


def fill_random(out: pathlib.Path, seed: int) -> None:
  """Random weights for `out/config.json`, saved as fp32 safetensors in `out`."""
  import torch
  import transformers
  cfg = transformers.AutoConfig.from_pretrained(out)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
  model.save_pretrained(out, safe_serialization=True)
  n = sum(p.numel() for p in model.parameters())
  print(f"{out}: {n / 1e6:.0f}M random parameters (seed {seed})")


def define_flags():
  flags.DEFINE_string("model", "smollm2-135m", "preset name or .gguf file (skeleton step)")
  flags.DEFINE_string("out", None, "checkpoint directory", required=True)
  flags.DEFINE_boolean("fill", False, "draw and save random weights for OUT/config.json")
  flags.DEFINE_integer("seed", 0, "torch seed of the random weights")


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  if FLAGS.fill:
    fill_random(out, FLAGS.seed)
  else:
    export_skeleton(FLAGS.model, out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
