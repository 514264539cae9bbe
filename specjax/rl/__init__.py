"""RL post-training: tasks and rewards, prompt datasets (TFDS / ArrayRecord), GRPO losses, the
fused train step, its sharding over a mesh and several processes, disaggregated async
(rollouts and updates on disjoint meshes). Whole runs built on these live in
`specjax.experiments`."""

from specjax.errors import RewardError, TaskError
from specjax.rl.data import (ArithmeticPrompts, GSM8KPrompts, PromptBatch, PromptReader,
                             TaskPrompts, prepare_prompts, prompt_builder)
from specjax.rl.datasets import DatasetTask, read_rows
from specjax.rl.disaggregated import DisaggregatedAsync, PolicyWeights
from specjax.rl.distributed import (broadcast_json, distribute, global_batch, join_cluster,
                                    local_copy, process_prompts, process_rows,
                                    prompt_batch_shardings, rollout_shardings, sharded_prime_fn,
                                    sharded_train_step, train_state_shardings)
from specjax.rl.gsm8k import (GSM8KTask, answers_match, extract_answer, format_number, parse_number,
                              read_gsm8k_jsonl)
from specjax.rl.losses import (AGGREGATIONS, KL_ESTIMATORS, GRPOConfig, GRPOMetrics,
                               aggregate_tokens, group_advantages, grpo_loss, kl_estimate,
                               objective_loss, objectives, register_objective, token_entropy)
from specjax.rl.reward_workers import RewardPool, RewardWorkers
from specjax.rl.rewards import JaxReward, RewardFunction
from specjax.rl.rollouts import rollout, scored_rollout
from specjax.rl.state import (DrafterTraining, Rollout, RolloutConfig, TrainConfig, TrainState,
                              init_train_state)
from specjax.rl.tasks import (ARITHMETIC_ALPHABET, SPLITS, WORKED_ALPHABET, ArithmeticTask,
                              CustomTask, Example, PythonReward, Task, arithmetic_reward,
                              decode_completions, encode_prompt)
from specjax.rl.trainer import SplitStep, make_prime_fn, make_split_step, make_train_step
from specjax.rl.updates import sequence_logprobs

__all__ = [
    "aggregate_tokens", "AGGREGATIONS", "answers_match", "ARITHMETIC_ALPHABET",
    "arithmetic_reward", "ArithmeticPrompts", "ArithmeticTask", "broadcast_json", "CustomTask",
    "DatasetTask", "decode_completions", "DisaggregatedAsync", "DrafterTraining", "distribute", "encode_prompt",
    "Example",
    "extract_answer", "format_number", "global_batch", "group_advantages", "grpo_loss",
    "GRPOConfig", "GRPOMetrics", "GSM8KPrompts", "GSM8KTask", "init_train_state", "join_cluster",
    "JaxReward", "kl_estimate", "KL_ESTIMATORS", "local_copy", "make_prime_fn", "make_split_step",
    "make_train_step", "objective_loss", "objectives", "parse_number", "PolicyWeights",
    "prepare_prompts", "process_prompts", "process_rows", "prompt_batch_shardings",
    "prompt_builder", "PromptBatch", "PromptReader", "PythonReward", "read_gsm8k_jsonl",
    "read_rows", "register_objective", "RewardError", "RewardFunction", "RewardPool",
    "RewardWorkers", "rollout", "Rollout", "rollout_shardings",
    "RolloutConfig", "scored_rollout", "sequence_logprobs", "sharded_prime_fn",
    "sharded_train_step", "SplitStep", "SPLITS", "Task", "TaskError", "TaskPrompts", "token_entropy",
    "train_state_shardings", "TrainConfig", "TrainState", "WORKED_ALPHABET",
]
