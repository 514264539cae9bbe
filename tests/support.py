"""What several test modules share: tiny models and batches, test checkpoints, the
environment of the processes tests start, and adversarial speculation policies.

Imported after `conftest.py` has set the XLA flags (8 fake CPU devices), as every test
module is.
"""

import contextlib
import dataclasses
import fcntl
import importlib.util
import itertools
import json
import os
import pickle
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, processors

from specjax.decoding import Adaptive, DraftTree, MTPDrafter, SamplingConfig
from specjax.experiments import (Checkpointing, ExperimentConfig, Optimization, RolloutEvaluation,
                                 RolloutSettings, WarmStart, override)
from specjax.models import ModelConfig, init_params, save_hf
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.sharding import MeshConfig
from specjax.supervised import init_supervised_state, make_supervised_step

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(**overrides: str) -> dict[str, str]:
  """The environment of a process a test starts: this one's (the compilation cache, the
  compiler flags, CPU only) without the 8 fake devices, which the child chooses for itself."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  return env | overrides


PROGRESSION_VOCAB = 32
ROOT = Path(__file__).resolve().parents[1]  # the repository
BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str):
  """`benchmarks/<name>.py` as a module: the scripts are run by path, not installed, and
  import their siblings (`accelerator`, `decode_step`) by bare name."""
  spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  # dataclasses resolve the script's string annotations through sys.modules.
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def progression_batch(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  """Arithmetic progressions mod 31 with a random start and step in 1..3 per row."""
  start = rng.integers(0, 31, batch)[:, None]
  step = rng.integers(1, 4, batch)[:, None]
  return (start + step * np.arange(length)[None, :]) % 31


def train_progression_model(config: ModelConfig, steps: int, seed: int):
  """`config`'s parameters after `steps` supervised steps on `progression_batch`es."""
  rng = np.random.default_rng(seed)
  optimizer = optax.adam(3e-3)
  state = init_supervised_state(init_params(config, jax.random.key(seed)), optimizer)
  mask = np.ones((16, 32), np.int32)
  batches = (progression_batch(rng, 16, 32) for _ in range(steps))
  first = next(batches)
  # Compiled with XLA's backend optimisations, which the suite turns off (conftest.py): a few
  # hundred steps run for seconds, not compiles, and optimised code runs them 2x faster.
  step = make_supervised_step(config, optimizer).lower(state, first, mask).compile(
      {"xla_backend_optimization_level": 1})
  for batch in itertools.chain([first], batches):
    state, _ = step(state, batch, mask)
  return state.params


@contextlib.contextmanager
def shared_dir(tmp_path_factory, name: str):
  """A directory of this test session that its pytest-xdist workers share, entered under a
  lock: for what is too expensive to build once per worker (the tests of a module fixture
  may run on both workers, and each would build it). The first worker to enter builds the
  contents; a later one finds them built. (xdist's `--dist loadgroup` would pin such tests
  to one worker, but with pytest 9 it silently does not: it renames items through an
  attribute pytest no longer reads.)"""
  root = tmp_path_factory.getbasetemp()
  # Workers' base dirs are siblings in the session's directory. Read from the environment
  # xdist gives its workers, not its `worker_id` fixture, which `-p no:xdist` takes away.
  if "PYTEST_XDIST_WORKER" in os.environ:
    root = root.parent
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      path = root / name
      path.mkdir(exist_ok=True)
      yield path
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def built_once(tmp_path_factory, name: str, build):
  """`build()`'s pytree of arrays, built by the first pytest-xdist worker that asks and read
  back (same values and dtypes) by the others: a session fixture that trains a model is
  otherwise trained once per worker (seconds to a minute each)."""
  with shared_dir(tmp_path_factory, name) as path:
    file = path / "tree.pickle"
    if file.exists():
      return jax.tree.map(jnp.asarray, pickle.loads(file.read_bytes()))
    tree = build()
    file.write_bytes(pickle.dumps(jax.tree.map(np.asarray, tree)))
    return tree


# A word-level tokenizer's ids: 0 <pad>, 1 <s>, 2 </s>, 3 <|eot_id|>, then the words: 10 in all.
SPECIALS = ["<pad>", "<s>", "</s>", "<|eot_id|>"]
WORDS = ["a", "b", "c", "d", "e", "f"]


def write_tiny_checkpoint(path, vocab_size: int = 16, n_layers: int = 1, seed: int = 0,
                          family: str = "llama"):
  """A random `n_layers` Llama (or Qwen3, with its q/k norms) and a word-level tokenizer whose
  post-processor adds <s> (as Llama 3's does) when asked for special tokens."""
  config = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=n_layers, n_heads=2,
                       n_kv_heads=1, head_dim=16, mlp_dim=64, max_position=64, family=family,
                       qk_norm=family == "qwen3")
  params = init_params(config, jax.random.key(seed))
  save_hf(params, config, path)
  vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
  tok = RawTokenizer(models.WordLevel(vocab, unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(SPECIALS)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
  return params, config


# A Qwen3-style chat template: ChatML turns, and the empty thinking block that
# `enable_thinking=False` asks for.
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking "
    "is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def write_hf_checkpoint(path: Path, texts: list[str], family: str = "qwen3", seed: int = 0,
                        n_layers: int = 2, tokenizer_from: Path | None = None) -> Path:
  """A random `n_layers` Qwen3, Qwen3-MoE (8 experts, top 2) or Llama written by transformers,
  as the Hub serves a model: a byte-level BPE tokenizer trained on `texts` (or
  `tokenizer_from`'s files) with a chat template and <|im_end|> as EOS."""
  import torch
  from tokenizers import decoders, trainers
  from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                            Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
  path.mkdir(parents=True, exist_ok=True)
  if tokenizer_from is not None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_from)
  else:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
  tokenizer.save_pretrained(path)
  torch.manual_seed(seed)
  kinds = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
           "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
  config_class, model_class = kinds[family]
  experts = (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  norm_topk_prob=True) if family == "qwen3_moe" else {})
  config = config_class(**experts,vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=n_layers, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                        tie_word_embeddings=family.startswith("qwen3"),
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
  model_class(config).save_pretrained(path)
  return path


def edit_config(path: Path, **changes) -> None:
  """Change fields of the `config.json` in checkpoint directory `path`."""
  file = path / "config.json"
  file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def edit_tensors(path: Path, edit) -> None:
  """Apply `edit(tensors)` in place to the `model.safetensors` of checkpoint directory `path`."""
  file = path / "model.safetensors"
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file, metadata={"format": "pt"})


@dataclasses.dataclass(frozen=True)
class CyclingPolicy(Adaptive):
  """Runs the menu's entries in turn, starting with the second (a speculative one): the
  adversary of any state a drafter keeps for one tree only."""

  def choose(self, counts, batch, live=None, remaining=None):
    return ((counts.rounds + 1) % len(self.menu)).astype(jnp.int32)

  def keeps(self, entry, counts, batch, live=None, remaining=None):
    return self.choose(counts, batch) == entry


# The tiny GRPO run that the multi-process, disaggregated and worker tests share, so that the
# multi-process and the disaggregated steps are checked against the same single-process one.
TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer


class NoBosTokenizer:
  """`TOK` as a tokenizer that adds no BOS (GPT-2 style) sees text: empty text has no ids."""

  bos_id = None

  def __getattr__(self, name):
    return getattr(TOK, name)
# One MTP module drafting one token: the smallest speculative step (it compiles fastest).
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                    head_dim=16, mlp_dim=64, num_mtp_modules=1, max_position=32)
PROMPTS = 4  # per step, global: 2 per process
STEPS = 2
# fsdp spans the two processes (each holds half of every "embed" dimension and half of the
# prompts), tensor the two devices of one process.
MESH = MeshConfig(data=1, fsdp=2, tensor=2)


def config(async_mode: bool) -> TrainConfig:
  """The shared run's train step: one-draft MTP rollouts, GRPO with a KL penalty, two
  minibatches and truncated importance sampling."""
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=SamplingConfig(1.0), drafter=MTPDrafter(),
                          tree=DraftTree.chain(1))
  return TrainConfig(model=MODEL, grpo=GRPOConfig(group_size=4, beta=0.05, num_minibatches=2,
                                                  tis_cap=2.0),
                     rollout=rollout, async_mode=async_mode)


def optimizer():
  # Adam's first step is lr * g / (|g| + eps): with the default eps=1e-8 it is lr * sign(g),
  # so a gradient element that is float noise on both sides (~1e-9, e.g. the KL's gradient
  # while the policy still equals the reference) would move by +-lr with a random sign. A
  # larger eps keeps such noise at noise level; real gradients (~1e-3) still take full steps.
  return optax.adam(1e-3, eps=1e-4)


def reward(tokens, lengths, answers):
  """Parity of the first response token: random responses differ within a group, so the
  advantages, and the policy gradient, are not zero (the task's reward is 0 for an untrained
  policy)."""
  del lengths, answers
  return (tokens[:, 0] % 2).astype(jnp.float32)


def initial_state(cfg: TrainConfig):
  return init_train_state(cfg, init_params(MODEL, jax.random.key(0)), optimizer(), seed=1)


def reader() -> PromptReader:
  records = [{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
              "answer": e.answer} for e in TASK.examples("train")]
  return PromptReader(records, batch_size=PROMPTS, pad_id=TOK.pad_id)


def flat(tree) -> dict:
  """Leaves by their path, e.g. ".params['embed']"."""
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tiny_experiment(run_dir, changes: dict | None = None, **fields) -> ExperimentConfig:
  """A `specjax train` run of seconds on the shared run's task and policy: no warm start,
  one-draft MTP rollouts, a checkpoint every step; `changes` (dotted names, as `override`
  takes them) and `fields` (top-level) override it."""
  base = ExperimentConfig(
      run_dir=str(run_dir), task=TASK, model=MODEL, grpo=GRPOConfig(group_size=4), steps=2,
      rollout=RolloutSettings(prompts_per_step=4, max_new_tokens=TASK.max_answer_tokens,
                              tree_widths=(1,)),
      optim=Optimization(warmup_steps=0), warm_start=WarmStart(steps=0),
      checkpoint=Checkpointing(every=1),
      eval=RolloutEvaluation(prompts=8, speedup_repeats=1, speedup_seconds=0))
  return override(base, (changes or {}) | fields)


class Killed(Exception):
  """What `kill_after_first_checkpoint` raises: a run stopped as by a kill."""


def kill_after_first_checkpoint(line: str) -> None:
  """A run's `log` that stops it once step 0 is saved and metrics.jsonl exists."""
  if line.startswith("held-out accuracy before RL"):
    raise Killed


# The model and batch of the multi-process supervised test and its worker.
SUPERVISED_MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                               head_dim=16, mlp_dim=64, num_mtp_modules=1)


def supervised_global_batch():
  """`[4, 12]` tokens and loss mask, the same in every process."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, SUPERVISED_MODEL.vocab_size, (4, 12)).astype(np.int32)
  return tokens, np.ones_like(tokens)
