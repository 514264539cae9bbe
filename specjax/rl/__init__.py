"""RL post-training: tasks and rewards, prompt datasets (TFDS / ArrayRecord), GRPO losses, the
fused train step, its sharding over a mesh and several processes, disaggregated async
(rollouts and updates on disjoint meshes), and the experiment loop."""

from specjax.rl.data import (ArithmeticPrompts, GSM8KPrompts, PromptBatch, PromptReader,
                             TaskPrompts, prepare_prompts, prompt_builder)
from specjax.rl.disaggregated import DisaggregatedAsync, PolicyWeights
from specjax.rl.distributed import (broadcast_json, distribute, global_batch, join_cluster,
                                    local_copy, process_prompts, process_rows,
                                    prompt_batch_shardings, rollout_shardings,
                                    sharded_prime_fn,
                                    sharded_train_step, train_state_shardings)
from specjax.rl.losses import (AGGREGATIONS, KL_ESTIMATORS, GRPOConfig, GRPOMetrics,
                               aggregate_tokens, group_advantages, grpo_loss, kl_estimate,
                               token_entropy)
from specjax.rl.gsm8k import (GSM8KTask, answers_match, extract_answer, format_number,
                              parse_number, read_gsm8k_jsonl)
from specjax.rl.tasks import (ARITHMETIC_ALPHABET, SPLITS, WORKED_ALPHABET, ArithmeticTask,
                              CustomTask, Example, PythonReward, RewardError, Task, TaskError,
                              arithmetic_reward, decode_completions, encode_prompt)
from specjax.rl.trainer import (Rollout, RolloutConfig, TrainConfig, TrainState,
                                init_train_state, make_prime_fn, make_split_step,
                                make_train_step, rollout, scored_rollout, sequence_logprobs)

__all__ = [
    "AGGREGATIONS", "ARITHMETIC_ALPHABET", "ArithmeticPrompts", "ArithmeticTask", "CustomTask",
    "DisaggregatedAsync", "PolicyWeights", "scored_rollout",
    "Example", "GRPOConfig", "GRPOMetrics", "GSM8KPrompts", "GSM8KTask", "KL_ESTIMATORS",
    "PromptBatch", "PromptReader", "PythonReward", "RewardError", "Rollout", "RolloutConfig",
    "SPLITS", "Task", "TaskError", "TaskPrompts", "TrainConfig", "TrainState",
    "aggregate_tokens", "answers_match", "arithmetic_reward", "broadcast_json",
    "decode_completions", "distribute", "encode_prompt", "extract_answer", "format_number",
    "global_batch", "group_advantages", "grpo_loss", "init_train_state", "join_cluster",
    "kl_estimate", "local_copy", "make_prime_fn", "make_split_step", "make_train_step",
    "parse_number", "prepare_prompts", "process_prompts", "process_rows",
    "prompt_batch_shardings", "prompt_builder", "read_gsm8k_jsonl", "rollout",
    "rollout_shardings", "sequence_logprobs", "sharded_prime_fn", "sharded_train_step",
    "token_entropy", "train_state_shardings", "WORKED_ALPHABET",
]
