"""Qwen3-1.7B, GRPO with EAGLE-3 rollouts on 8 accelerators: a preset to plan, not to run here.

  specjax plan --config configs/qwen3_1p7b_grpo.py --devices 8 [--hbm-gib 80]

The model is Qwen3-1.7B's architecture from its public config.json (hidden 2048, 28 layers,
16 query and 8 key/value heads of 128, MLP 6144, vocabulary 151936, tied embeddings, qk-norm,
RoPE base 1e6), computed in bfloat16 over float32 weights and Adam moments. The rollout has
the shape of a GSM8K run: 64 prompts of up to ~126 tokens, 8 samples each (512 rows), up to
512 new tokens, EAGLE-3 drafting a chain of 3 over a 32000-token draft vocabulary; the update
takes 8 minibatches of 64 rows. The mesh is what 8 accelerators of 80 GB would use for a
1.7B model: fsdp=8 (parameters, gradients and optimizer moments split eight ways, every
device a share of the rows).

The task stands in for GSM8K with the same shapes: worked arithmetic (25 four-digit operands,
a left-to-right worked solution of up to 512 tokens), whose reward is a JAX function that the
fused step compiles. A GSM8K task needs Qwen's tokenizer (not available offline) and scores
on the host (a split step, not the fused one). The arithmetic tokenizer's 19 ids are the first
of Qwen's 151936 (a model may embed more ids than its tokenizer has): the model, its logits and
every compiled shape are Qwen3-1.7B's, the text is arithmetic.
"""

from specjax.experiments import Drafting, ExperimentConfig, Optimization, RolloutSettings
from specjax.models import ModelConfig
from specjax.rl import ArithmeticTask, GRPOConfig
from specjax.sharding import MeshConfig

QWEN3_VOCAB = 151936

QWEN3_1P7B = ModelConfig(
    vocab_size=QWEN3_VOCAB, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
    mlp_dim=6144, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
    max_position=40960, dtype="bfloat16", param_dtype="float32", family="qwen3")


def get_config() -> ExperimentConfig:
  task = ArithmeticTask(max_digits=4, num_operands=25, operators="+-", worked=True)
  return ExperimentConfig(
      run_dir="runs/qwen3_1p7b_grpo",
      task=task,
      model=QWEN3_1P7B,
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28, num_minibatches=8),
      rollout=RolloutSettings(prompts_per_step=64,
                              max_new_tokens=task.max_answer_tokens,  # 512
                              temperature=1.0, tree_widths=(1, 1, 1)),
      drafter=Drafting(name="eagle3", draft_vocab_size=32000),
      optim=Optimization(learning_rate=1e-6),
      mesh=MeshConfig(data=1, fsdp=8, tensor=1),
  )
