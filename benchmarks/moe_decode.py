"""A mixture-of-experts decode step against a dense model of the same active size.

    python benchmarks/moe_decode.py            # 64 experts, top 8, batch 1 / 4 / 16
    python benchmarks/moe_decode.py --quick    # smaller and fewer repeats (a smoke run)

A decode step is memory-bound: it pays for the weights it reads. An MoE layer holds Z experts
but routes each token to k of them, so a step that reads only the routed experts costs about
what a dense layer of width k x (one expert's width) costs, Z / k times less than one that
runs every expert. This builds a tiny-but-wide Qwen3-MoE (random weights, the router scaled so
that tokens spread over the experts) and a dense Qwen3 with the same attention and an MLP of
k x expert_dim (the same active parameters, less the router's E x Z), and times one cached
decode step of each (T = 1, the cache donated, interleaved repeats, medians), at each batch:

  moe      the MoE step as `ModelConfig.moe_impl="auto"` runs it on this platform (on a CPU
           the loop; on TPU / GPU the loop while the batch's (token, expert) pairs are at
           most Z, else "ragged": `specjax.models.moe`)
  loop     the MoE step over the routed experts only, whatever the batch
  ragged   the grouped-matmul step (`jax.lax.ragged_dot`; XLA:CPU expands it into a product
           over every expert, so on a CPU this column shows what not reading sparsely costs)
  dense    the dense model of the same active size

and the ratios moe / dense (issue 56 bounds it at 1.5 at batch 1 on a CPU) and ragged / loop.
Also printed: the distinct experts the batch's tokens were routed to in the first layer
(`specjax.models.moe.routed_experts` on the step's router logits), what a step must read.

Then what a speculative round's verify forward costs on each: B rows x (1 + k) tokens for
chains of k = 1, 3, 7 drafts, as a multiple of the same model's decode step (T = 1), with the
distinct experts the verify reads (measured, first layer) beside what `specjax.sim` assumes
for it (`ModelSpec.touched_experts`, uniform routing). A dense verify of a few tokens costs
about a decode step (the weights are read once either way); an MoE verify reads more
experts the more tokens it checks, so its cost grows with k, and the simulator's choice of
tree follows the experts it counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import KVCache, ModelConfig, forward, init_params
from specjax.models.moe import routed_experts, uses_loop
from specjax.sim.model import ModelSpec
from specjax.timing import interleaved


def _configs(quick: bool) -> tuple[ModelConfig, ModelConfig]:
  width, experts, top_k, expert_dim = (256, 32, 4, 128) if quick else (1024, 64, 8, 512)
  moe = ModelConfig(vocab_size=2048, d_model=width, n_layers=2, n_heads=8, n_kv_heads=2,
                    head_dim=width // 8, mlp_dim=4 * width, qk_norm=True, family="qwen3_moe",
                    n_experts=experts, experts_per_token=top_k, expert_dim=expert_dim,
                    max_position=256)
  dense = moe.replace(family="qwen3", n_experts=0, experts_per_token=0, expert_dim=0,
                      mlp_dim=top_k * expert_dim)
  return moe, dense


def _spread_router(params):
  """Random routers at init put near-equal logits on every expert; sharpen them so the batch
  is routed as a trained model's is (distinct experts per token)."""
  for layer in params["layers"]:
    layer["router"] = layer["router"] * 50.0
  return params


def _experts_read(config: ModelConfig, params, tokens, positions, slots: int) -> int:
  """Distinct experts the first layer routes `tokens` to in the timed step's forward (a cache
  of `slots` whose first `positions[0, 0]` hold entries), from its router logits."""
  b = tokens.shape[0]
  cache = KVCache.create(config, b, slots).set_lengths(jnp.full((b,), positions[0, 0]))
  out = forward(params, config, tokens, positions, cache, advance=0)
  return int(routed_experts(out.router_logits[0], config))


def _step(config: ModelConfig):
  def step(params, tokens, positions, cache):
    out = forward(params, config, tokens, positions, cache, advance=0)
    return jnp.argmax(out.logits[:, -1], -1), out.cache
  return jax.jit(step, donate_argnums=3)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batches", default=None, help="comma-separated (default 1,4,16)")
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  moe, dense = _configs(args.quick)
  batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,4,16")).split(",")]
  repeats = args.repeats or (5 if args.quick else 15)
  committed, slots = 64, 128
  params = {"moe": _spread_router(init_params(moe, jax.random.key(0))),
            "dense": init_params(dense, jax.random.key(0))}
  arms = {"moe": (moe, params["moe"]), "loop": (moe.replace(moe_impl="loop"), params["moe"]),
          "ragged": (moe.replace(moe_impl="ragged"), params["moe"]),
          "dense": (dense, params["dense"])}
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  active = count(params["moe"]) - moe.n_layers * 3 * moe.d_model * moe.expert_dim * (
      moe.n_experts - moe.experts_per_token)
  print(f"MoE: {moe.n_experts} experts, top {moe.experts_per_token}, E={moe.d_model}, expert "
        f"width {moe.expert_dim}, {moe.n_layers} layers: {count(params['moe']) / 1e6:.1f}M "
        f"parameters, {active / 1e6:.1f}M active; dense: MLP width {dense.mlp_dim}, "
        f"{count(params['dense']) / 1e6:.1f}M. jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; {committed} of {slots} cache slots; median of {repeats}")
  print(f"{'B':>4} {'auto':>7} {'experts':>8} " + " ".join(f"{n + ' ms':>10}" for n in arms)
        + f" {'moe/dense':>10} {'ragged/loop':>12}")
  for b in batches:
    tokens = jax.random.randint(jax.random.key(b), (b, 1), 0, moe.vocab_size)
    positions = jnp.full((b, 1), committed)
    caches = {name: KVCache.create(config, b, slots).set_lengths(jnp.full((b,), committed))
              for name, (config, _) in arms.items()}
    steps = {name: _step(config) for name, (config, _) in arms.items()}

    def run(name):
      def call(_):
        nxt, caches[name] = steps[name](arms[name][1], tokens, positions, caches[name])
        nxt.block_until_ready()
      return call

    for name in arms:  # compile and warm up
      run(name)(0)
    times, _ = interleaved([run(name) for name in arms], repeats)
    ms = {name: 1e3 * statistics.median(t) for name, t in zip(arms, times)}
    ratio = lambda a, c: float(np.median(times[list(arms).index(a)]
                                         / times[list(arms).index(c)]))
    hit = _experts_read(moe, params["moe"], tokens, positions, slots)
    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    auto = "loop" if uses_loop(moe, b, platform) else "ragged"
    print(f"{b:>4} {auto:>7} {hit:>8} "
          + " ".join(f"{ms[name]:>10.3f}" for name in arms)
          + f" {ratio('moe', 'dense'):>9.2f}x {ratio('ragged', 'loop'):>11.2f}x")
  _verify_table(moe, dense, params, batches, repeats, committed, slots)
  return 0


def _verify_table(moe, dense, params, batches, repeats, committed, slots) -> None:
  """Verify forwards of 1 + k tokens per row against a decode step, MoE and dense."""
  spec = ModelSpec.from_model_config(moe)
  chains = (1, 3, 7)
  print(f"\nverify of 1 + k tokens per row, x the decode step of the same model (median of "
        f"{repeats}); experts read in the first layer, measured / simulator")
  print(f"{'B':>4} " + " ".join(f"{f'k={k} moe':>10} {f'k={k} dense':>11} {'experts':>9}"
                                for k in chains))
  for b in batches:
    cells = []
    fns, names = [], []
    for name, config in (("moe", moe), ("dense", dense)):
      for t in (1,) + tuple(k + 1 for k in chains):
        tokens = jax.random.randint(jax.random.key(7 + t), (b, t), 0, moe.vocab_size)
        positions = committed + jnp.broadcast_to(jnp.arange(t), (b, t))
        cache = {"c": KVCache.create(config, b, slots).set_lengths(jnp.full((b,), committed))}
        step = _step(config)

        def call(_, step=step, cache=cache, tokens=tokens, positions=positions,
                 p=params[name]):
          nxt, cache["c"] = step(p, tokens, positions, cache["c"])
          nxt.block_until_ready()
        call(0)
        fns.append(call)
        names.append((name, t))
    times, _ = interleaved(fns, repeats)
    median = {key: statistics.median(t) for key, t in zip(names, times)}
    for k in chains:
      tokens = jax.random.randint(jax.random.key(7 + k + 1), (b, k + 1), 0, moe.vocab_size)
      positions = committed + jnp.broadcast_to(jnp.arange(k + 1), (b, k + 1))
      hit = _experts_read(moe, params["moe"], tokens, positions, slots)
      cells.append(f"{median[('moe', k + 1)] / median[('moe', 1)]:>9.2f}x "
                   f"{median[('dense', k + 1)] / median[('dense', 1)]:>10.2f}x "
                   f"{hit:>4}/{float(spec.touched_experts(b * (k + 1))):>4.1f}")
    print(f"{b:>4} " + " ".join(cells))


if __name__ == "__main__":
  sys.exit(main())
