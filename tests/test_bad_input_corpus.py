"""A corpus of bad inputs at specjax's public boundaries, in one place.

Each case feeds one boundary (HF I/O, `generate`, model configs, tokenizers, RL tasks and
configs, checkpoints, the CLI) what a hostile tester would try, and asserts the error type
and that the message names the problem: the field or file, the value, and what is allowed.
A case that would pass silently, or fail with a bare traceback from a dependency (numpy,
JAX, orbax, json, tokenizers) that names no specjax field, fails here.

Known faults not fixed yet are strict xfails whose reason says what is wrong (today: none);
fixing one turns it into a failure (XPASS) until the mark is removed. Cases another test file already covers are not repeated (each
section says which).
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import edit_config, edit_tensors, write_tiny_checkpoint
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models as tokenizer_models

from specjax.checkpoint import Checkpointer
from specjax.cli import generate_command
from specjax.cli import main as cli_main
from specjax.decoding import (Adaptive, CostTable, DraftModelDrafter, DraftTree, Eagle3Drafter,
                              MTPDrafter, SamplingConfig, calibrate, generate)
from specjax.decoding.inputs import check_key
from specjax.errors import CheckpointError, ConfigError
from specjax.experiments import (DrafterTrainConfig, Drafting, ExperimentConfig, Pipeline,
                                 RolloutSettings, WarmStart)
from specjax.experiments import grpo as experiment
from specjax.experiments import override
from specjax.models import (Llama3RopeScaling, ModelConfig, config_from_hf, init_params, load_hf,
                            save_hf)
from specjax.rl import (ArithmeticTask, CustomTask, Example, GRPOConfig, PromptReader, RewardError,
                        RolloutConfig, TaskError, arithmetic_reward, group_advantages, grpo_loss,
                        read_gsm8k_jsonl)
from specjax.tokenizer import CharTokenizer, HFTokenizer, TokenizerError, check_vocab_fits

REPO = Path(__file__).resolve().parents[1]


def case(case_id: str, *values, xfail: str | None = None):
  """One corpus entry; `xfail` says what is wrong where the fix is outside this corpus."""
  marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
  return pytest.param(*values, id=case_id, marks=marks)


# --- HF checkpoints (load_hf / save_hf / config_from_hf) ---------------------------------------
# Not repeated: malformed JSON, model_type mismatches, non-integral ints, integer tensors,
# shards outside the directory, truncated safetensors (test_hf_bad_inputs.py).

HF_CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                        head_dim=8, mlp_dim=48)
HF_PARAMS = init_params(HF_CONFIG, jax.random.key(0))


@pytest.fixture
def export(tmp_path):
  """A one-file export of `HF_CONFIG` at tmp_path / "ckpt"."""
  path = tmp_path / "ckpt"
  save_hf(HF_PARAMS, HF_CONFIG, path)
  return path


@pytest.fixture
def sharded_export(tmp_path):
  path = tmp_path / "sharded"
  save_hf(HF_PARAMS, HF_CONFIG, path, max_shard_bytes=10_000)
  return path


def _drop_config_fields(path: Path, *names: str) -> None:
  file = path / "config.json"
  config = json.loads(file.read_text())
  file.write_text(json.dumps({k: v for k, v in config.items() if k not in names}))


def _edit_index(path: Path, edit) -> None:
  file = path / "model.safetensors.index.json"
  index = json.loads(file.read_text())
  edit(index)
  file.write_text(json.dumps(index))


def _then_load(edit):
  return lambda path: (edit(path), load_hf(path))


UP = "model.layers.0.mlp.up_proj.weight"

HF_CASES = [
    case("missing_config_json", _then_load(lambda p: (p / "config.json").unlink()),
         CheckpointError, r"ckpt: missing config\.json; expected an HF checkpoint directory"),
    case("config_json_holds_a_list",
         _then_load(lambda p: (p / "config.json").write_text("[1, 2]")),
         CheckpointError, r"config\.json: holds a JSON list, expected an object"),
    case("config_json_not_utf8",
         _then_load(lambda p: (p / "config.json").write_bytes(b"\xff\xfe{}")),
         CheckpointError, r"config\.json: not UTF-8 text \(byte 0\).*re-download"),
    case("unknown_architecture",
         _then_load(lambda p: edit_config(p, architectures=["GPT2LMHeadModel"],
                                           model_type="gpt2")),
         ConfigError, r"architectures=\['GPT2LMHeadModel'\] \(model_type='gpt2'\) is "
                      r"unsupported: allowed model_type one of "
                      r"\['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
    case("missing_required_field",
         _then_load(lambda p: _drop_config_fields(p, "hidden_size")),
         ConfigError, r"missing required fields \['hidden_size'\] for LlamaForCausalLM"),
    case("integer_field_as_string", _then_load(lambda p: edit_config(p, vocab_size="64")),
         ConfigError, r"vocab_size='64' is invalid: allowed an integer"),
    case("unsupported_rope_type",
         _then_load(lambda p: edit_config(p, rope_scaling={"rope_type": "yarn", "factor": 2.0},
                                           rope_parameters=None)),
         ConfigError, r"rope type 'yarn' is unsupported: allowed 'default' .* or 'llama3'"),
    case("missing_tensor", _then_load(lambda p: edit_tensors(p, lambda t: t.pop(UP))),
         CheckpointError, rf"missing tensor '{re.escape(UP)}' \(expected shape \(48, 32\)\)"),
    case("wrong_tensor_shape",
         _then_load(lambda p: edit_tensors(
             p, lambda t: t.update({"model.norm.weight": np.ones(16, np.float32)}))),
         CheckpointError, r"tensor 'model\.norm\.weight' in model\.safetensors has shape "
                          r"\(16,\), expected \(32,\)"),
    case("tensor_of_a_layer_the_config_lacks",
         _then_load(lambda p: edit_tensors(
             p, lambda t: t.update({UP.replace(".0.", ".5."): t[UP]}))),
         CheckpointError, r"unexpected tensors for a 1-layer llama model: "
                          r"\['model\.layers\.5\.mlp\.up_proj\.weight'\]"),
    case("no_weights_file", _then_load(lambda p: (p / "model.safetensors").unlink()),
         CheckpointError, r"no model\.safetensors or model\.safetensors\.index\.json"),
    case("draft_heads_listed_but_absent",
         _then_load(lambda p: edit_config(p, specjax={"num_mtp_modules": 1})),
         CheckpointError, r"config\.json lists draft heads but specjax_heads\.safetensors is "
                          r"missing"),
    case("unsupported_param_dtype", lambda p: load_hf(p, param_dtype="int8"),
         ConfigError, r"param_dtype='int8' is invalid: allowed 'auto' or one of"),
    case("save_over_a_file",
         lambda p: ((p.parent / "file").write_text("x"),
                    save_hf(HF_PARAMS, HF_CONFIG, p.parent / "file")),
         CheckpointError, r"file exists and is not a directory: allowed a directory"),
    case("save_params_of_another_vocab",
         lambda p: save_hf({**HF_PARAMS, "embed": HF_PARAMS["embed"][:8]}, HF_CONFIG,
                           p.parent / "out"),
         ConfigError, r"params embed has shape \(8, 32\), expected \(64, 32\)"),
    case("rope_theta_not_a_number",
         _then_load(lambda p: edit_config(p, rope_theta="fast", rope_parameters=None)),
         ConfigError, r"rope_theta='fast' is invalid"),
    case("rms_norm_eps_not_a_number", _then_load(lambda p: edit_config(p, rms_norm_eps="x")),
         ConfigError, r"rms_norm_eps='x' is invalid"),
    case("rope_scaling_a_list", _then_load(lambda p: edit_config(p, rope_scaling=[8.0])),
         ConfigError, r"rope_scaling"),
    case("specjax_entry_a_list", _then_load(lambda p: edit_config(p, specjax=[1])),
         ConfigError, r"specjax"),
    case("head_dim_zero", _then_load(lambda p: edit_config(p, head_dim=0)),
         ConfigError, r"head_dim=0"),
    case("tensor_holding_nan",
         _then_load(lambda p: edit_tensors(
             p, lambda t: t.update({UP: np.where(np.arange(48)[:, None] < 2, np.nan,
                                                 t[UP]).astype(np.float32)}))),
         CheckpointError, rf"tensor '{re.escape(UP)}' in .*model\.safetensors holds 64 "
                          r"non-finite values \(NaN or inf\) of 1536; .*re-export"),
    case("save_params_holding_inf",
         lambda p: save_hf({**HF_PARAMS, "final_norm": HF_PARAMS["final_norm"].at[3].set(
             jnp.inf)}, HF_CONFIG, p.parent / "never_written"),
         CheckpointError, r"params final_norm holds 1 non-finite values .* refusing to save"),
    case("config_from_hf_of_a_list", lambda p: config_from_hf([1, 2]),
         ConfigError, r"list|object|dict"),
]


@pytest.mark.parametrize("call,error,match", HF_CASES)
def test_bad_hf_checkpoint_is_refused_naming_the_file_field_or_tensor(export, call, error,
                                                                      match):
  with pytest.raises(error, match=match):
    call(export)


def test_a_refused_save_leaves_the_earlier_export_as_it_was(export):
  before = {f.name: f.read_bytes() for f in export.iterdir()}
  nan = {**HF_PARAMS, "embed": HF_PARAMS["embed"].at[0, 0].set(jnp.nan)}
  with pytest.raises(CheckpointError, match="params embed holds 1 non-finite"):
    save_hf(nan, HF_CONFIG, export)
  assert {f.name: f.read_bytes() for f in export.iterdir()} == before
  assert [p.name for p in export.parent.iterdir()] == [export.name]  # no temporary left


@pytest.mark.parametrize("edit,match", [
    pytest.param(lambda p: sorted(p.glob("model-*.safetensors"))[0].unlink(),
                 r"model-00001-of-\d+\.safetensors: file listed in the index for .* is "
                 r"missing", id="shard_file_missing"),
    pytest.param(lambda p: _edit_index(p, lambda i: i.pop("weight_map")),
                 r"index\.json: no \"weight_map\" object; re-download", id="no_weight_map"),
    pytest.param(lambda p: _edit_index(p, lambda i: i["weight_map"].update({UP: 7})),
                 rf"weight_map\['{re.escape(UP)}'\]=7 is invalid: allowed a file name",
                 id="shard_name_not_a_string"),
])
def test_bad_shard_index_is_refused_naming_the_index_entry(sharded_export, edit, match):
  edit(sharded_export)
  with pytest.raises(CheckpointError, match=match):
    load_hf(sharded_export)


# --- generate, DecodeLoop, draft trees and speculation policies -------------------------------
# Not repeated: out-of-range prompt ids outside jit, params of other shapes, tiny and
# non-finite temperatures (test_generate_bad_inputs.py); bad eos_id (test_generate_eos.py);
# bad parents, widths, top-k/top-p, trees too deep or without a drafter, lengths of 0, a
# cache too small (test_decoding.py); bad menus and cost tables (test_adaptive.py).

GEN_CONFIG = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                         head_dim=16, mlp_dim=32, max_position=32, num_mtp_modules=2)
GEN_PARAMS = init_params(GEN_CONFIG, jax.random.key(0))
PROMPTS = np.array([[1, 2, 3, 0], [4, 5, 6, 7]], np.int32)
LENGTHS = np.array([3, 4], np.int32)
CHAIN1 = DraftTree.chain(1)


def _generate(params=GEN_PARAMS, prompts=PROMPTS, lengths=LENGTHS, **kwargs):
  kwargs.setdefault("max_new_tokens", 3)
  return generate(params, GEN_CONFIG, prompts, lengths, jax.random.key(0), **kwargs)


def _generate_with_key(key):
  return generate(GEN_PARAMS, GEN_CONFIG, PROMPTS, LENGTHS, key, max_new_tokens=3)


def _generate_under_jit(prompts, lengths):
  """generate inside the caller's own jit: prompt values are checked when the program runs."""
  run = jax.jit(lambda p, n: _generate(prompts=p, lengths=n).logprobs)
  return jax.block_until_ready(run(prompts, lengths))


def _calibrate(**kwargs):
  kwargs = {"speculation": (CHAIN1,), "batch_sizes": (2,), "prompt_len": 4,
            "max_new_tokens": 3, **kwargs}
  return calibrate(GEN_PARAMS, GEN_CONFIG, MTPDrafter(), cache_dir=None, **kwargs)


def _without(key: str):
  return {k: v for k, v in GEN_PARAMS.items() if k != key}


def _with(prompts: np.ndarray, index: tuple[int, int], value: int) -> np.ndarray:
  """A copy of `prompts` (int64) with `prompts[index] = value`."""
  out = prompts.astype(np.int64)
  out[index] = value
  return out


GENERATE_CASES = [
    case("prompt_length_beyond_the_buffer", lambda: _generate(lengths=np.array([3, 5])),
         ValueError, r"prompt_lengths must be in \[1, 4\] .*got min 3 max 5"),
    case("prompt_lengths_of_another_batch", lambda: _generate(lengths=np.array([3, 4, 2])),
         ValueError, r"prompt_lengths must have shape \[batch\]=\(2,\), got \(3,\)"),
    case("max_new_tokens_zero", lambda: _generate(max_new_tokens=0),
         ConfigError, r"max_new_tokens=0 is invalid: must be an int >= 1"),
    case("max_new_tokens_float", lambda: _generate(max_new_tokens=3.0),
         ConfigError, r"max_new_tokens=3\.0 is invalid: must be an int >= 1"),
    case("temperature_a_bool", lambda: SamplingConfig(temperature=True),
         ConfigError, r"temperature=True is invalid: must be a finite number >= 0"),
    case("top_p_a_string", lambda: SamplingConfig(top_p="0.9"),
         ConfigError, r"top_p='0\.9' is invalid: must be a number in \(0, 1\]"),
    case("params_with_an_integer_weight",
         lambda: _generate(params={**GEN_PARAMS, "final_norm": jnp.ones(32, jnp.int32)}),
         ConfigError, r"params\['final_norm'\] has dtype int32: allowed a float dtype"),
    case("params_without_the_output_head", lambda: _generate(params=_without("unembed")),
         ConfigError, r"params\['unembed'\] is missing"),
    case("draft_tree_float_parent", lambda: DraftTree.from_parents([0, 0.7]),
         ConfigError, r"DraftTree\.parents\[1\]=0\.7 is invalid"),
    case("draft_tree_string_parents", lambda: DraftTree("01"),
         ConfigError, r"DraftTree\.parents='01' is invalid: must be a sequence of ints"),
    case("unknown_drafter_object", lambda: _generate(drafter=object(), tree=CHAIN1),
         ConfigError, r"drafter=<object .*> is invalid: must be a specjax\.decoding\.Drafter"),
    case("cost_table_fractional_batch", lambda: CostTable((1.5,), ((1.0,),)),
         ConfigError, r"CostTable\.batches=\(1\.5,\) is invalid"),
    case("cost_table_seconds_a_string", lambda: CostTable((1,), (("fast",),)),
         ConfigError, r"CostTable\.seconds"),
    case("adaptive_menu_a_tree_not_a_sequence", lambda: Adaptive(CHAIN1),
         ConfigError, r"Adaptive\.menu=.* is invalid"),
    case("tree_not_a_draft_tree", lambda: _generate(drafter=MTPDrafter(), tree=(0, 1)),
         ConfigError, r"tree=\(0, 1\) is invalid"),
    case("sampling_not_a_sampling_config", lambda: _generate(sampling=0.5),
         ConfigError, r"sampling=0\.5 is invalid"),
    case("max_new_tokens_a_bool", lambda: _generate(max_new_tokens=True),
         ConfigError, r"max_new_tokens=True is invalid"),
    case("prompt_tokens_one_dimensional", lambda: _generate(prompts=np.array([1, 2, 3])),
         ValueError, r"prompt_tokens has shape \(3,\): must be \[batch, prompt_len\]"),
    case("prompt_tokens_fractional", lambda: _generate(prompts=PROMPTS + 0.5),
         ValueError, r"prompt_tokens"),
    case("prompt_token_past_int32",
         lambda: _generate(prompts=_with(PROMPTS, (0, 2), 2**32 + 3)),
         ValueError, r"prompt_tokens\[0, 2\] = 4294967299"),
    case("empty_batch",
         lambda: _generate(prompts=np.zeros((0, 4), np.int32), lengths=np.zeros(0, np.int32)),
         ValueError, r"batch"),
    case("mtp_drafter_with_params_without_mtp_modules",
         lambda: _generate(params=_without("mtp"), drafter=MTPDrafter(), tree=CHAIN1),
         ConfigError, r"params\['mtp'\]"),
    case("key_an_int_seed", lambda: _generate_with_key(0),
         ConfigError, r"key=0 is invalid: must be one JAX PRNG key, e\.g\. jax\.random\.key\(0\)"),
    case("key_none", lambda: _generate_with_key(None),
         ConfigError, r"key=None is invalid: must be one JAX PRNG key"),
    case("key_raw_data_of_another_shape",
         lambda: _generate_with_key(jnp.zeros(3, jnp.uint32)),
         ConfigError, r"key=<uint32 array of shape \(3,\)> is invalid: must be one JAX PRNG "
                      r"key.*uint32 of shape \(2,\)"),
    case("key_raw_data_of_another_dtype", lambda: _generate_with_key(jnp.zeros(2, jnp.int32)),
         ConfigError, r"key=<int32 array of shape \(2,\)> is invalid"),
    case("key_a_batch_of_keys",
         lambda: _generate_with_key(jax.random.split(jax.random.key(0), 2)),
         ConfigError, r"key=<key<fry> array of shape \(2,\)> is invalid: .*nor a batch of keys"),
    case("prompt_token_outside_the_vocabulary_under_jit",
         lambda: _generate_under_jit(_with(PROMPTS, (1, 2), 16), LENGTHS),
         Exception, r"prompt_tokens\[1, 2\] = 16 is not a token id of this model"),
    case("config_not_a_model_config",
         lambda: generate(GEN_PARAMS, {"vocab_size": 16}, PROMPTS, LENGTHS, jax.random.key(0),
                          max_new_tokens=3),
         ConfigError, r"config=\{'vocab_size': 16\} is invalid: must be a "
                      r"specjax\.models\.ModelConfig"),
    case("drafter_sampled_a_string", lambda: _generate(drafter=MTPDrafter(sampled="yes"),
                                                       tree=CHAIN1),
         ConfigError, r"MTPDrafter\(sampled='yes'\) is invalid: must be True .* or False"),
    case("draft_model_config_a_name",
         lambda: _generate(drafter=DraftModelDrafter("llama"), tree=CHAIN1),
         ConfigError, r"DraftModelDrafter\(config='llama'\) is invalid: must be the draft "
                      r"model's specjax\.models\.ModelConfig"),
    case("eagle3_config_none", lambda: _generate(drafter=Eagle3Drafter(None), tree=CHAIN1),
         ConfigError, r"Eagle3Drafter\(config=None\) is invalid: must be the head's "
                      r"specjax\.models\.Eagle3Config"),
    case("calibrate_max_new_tokens_a_string", lambda: _calibrate(max_new_tokens="3"),
         ConfigError, r"max_new_tokens='3' is invalid: must be an int >= 1"),
    case("verifier_not_callable", lambda: _generate(verifier="lossless"),
         ConfigError, r"verifier='lossless' is invalid: must be a specjax\.decoding\.Verifier"),
    case("compaction_a_bool", lambda: _generate(compaction=True),
         ConfigError, r"compaction=True is invalid: must be an int >= 0"),
    case("calibrate_a_menu_given_as_a_string", lambda: _calibrate(speculation="chain3"),
         ConfigError, r"speculation='chain3' is invalid: must be an Adaptive policy .* or a "
                      r"sequence of DraftTree"),
    case("calibrate_a_fractional_batch_size", lambda: _calibrate(batch_sizes=(2.5,)),
         ConfigError, r"batch_sizes=\(2\.5,\) is invalid: .*ints >= 1"),
    case("calibrate_one_batch_size_not_in_a_sequence", lambda: _calibrate(batch_sizes=4),
         ConfigError, r"batch_sizes=4 is invalid: must be a non-empty sequence"),
    case("calibrate_a_prompt_width_of_0", lambda: _calibrate(prompt_len=0),
         ConfigError, r"prompt_len=0 is invalid: must be an int >= 1"),
    case("prompt_length_beyond_the_buffer_under_jit",
         lambda: _generate_under_jit(PROMPTS, np.array([3, 5], np.int32)),
         Exception, r"prompt_lengths must be in \[1, 4\].*got min 3 max 5"),
]


@pytest.mark.parametrize("call,error,match", GENERATE_CASES)
def test_bad_generate_input_is_refused_naming_the_argument(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_generate_under_the_callers_jit_checks_values_and_gives_the_same_result():
  np.testing.assert_array_equal(_generate_under_jit(PROMPTS, LENGTHS), _generate().logprobs)


def test_generate_takes_a_typed_key_or_the_raw_key_data_of_prngkey_alike():
  typed = _generate_with_key(jax.random.key(0))
  for raw in (jax.random.PRNGKey(0), np.asarray(jax.random.PRNGKey(0))):
    np.testing.assert_array_equal(_generate_with_key(raw).tokens, typed.tokens)


def test_the_raw_key_data_generate_takes_follows_the_default_prng_implementation():
  """The raw key's shape is traced once per implementation, not per call: switching
  `jax_default_prng_impl` (rbg keys hold 4 words, threefry 2) changes what is accepted."""
  default = jax.config.jax_default_prng_impl
  check_key(jax.random.PRNGKey(0))
  try:
    jax.config.update("jax_default_prng_impl", "rbg")
    check_key(jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match=r"uint32 of shape \(4,\)"):
      check_key(jnp.zeros(2, jnp.uint32))
  finally:
    jax.config.update("jax_default_prng_impl", default)
  with pytest.raises(ConfigError, match=r"uint32 of shape \(2,\)"):
    check_key(jnp.zeros(4, jnp.uint32))


def test_draft_tree_parents_given_as_a_list_or_numpy_ints_make_the_same_hashable_tree():
  reference = DraftTree((0, 0, 1))
  for parents in ([0, 0, 1], np.array([0, 0, 1]), (np.int64(0), 0, 1)):
    tree = DraftTree.from_parents(parents) if isinstance(parents, np.ndarray) else DraftTree(
        parents)
    assert tree == reference and hash(tree) == hash(reference)
    assert all(type(p) is int for p in tree.parents)


# --- model configs ---------------------------------------------------------------------------
# Not repeated: sizes, head grouping, odd head_dim, dtype, family (test_models.py).

BASE = dict(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
            mlp_dim=32)

MODEL_CONFIG_CASES = [
    case("n_layers_a_bool", lambda: ModelConfig(**BASE | {"n_layers": True}),
         r"n_layers=True is invalid: must be a positive int"),
    case("qwen3_without_qk_norm", lambda: ModelConfig(**BASE | {"family": "qwen3"}),
         r"family='qwen3' is invalid: qwen3 checkpoints have qk_norm=True"),
    case("rope_theta_a_string", lambda: ModelConfig(**BASE | {"rope_theta": "1e4"}),
         r"rope_theta='1e4' is invalid: must be a finite number > 0"),
    case("rope_theta_infinite", lambda: ModelConfig(**BASE | {"rope_theta": math.inf}),
         r"rope_theta=inf is invalid: must be a finite number > 0"),
    case("tie_embeddings_a_string", lambda: ModelConfig(**BASE | {"tie_embeddings": "false"}),
         r"tie_embeddings='false' is invalid: must be True or False"),
    case("rope_scaling_factor_infinite", lambda: Llama3RopeScaling(factor=math.inf),
         r"rope_scaling\.factor=inf is invalid: must be a finite number"),
    case("rope_scaling_factor_a_string", lambda: Llama3RopeScaling(factor="8"),
         r"rope_scaling\.factor='8' is invalid: must be a finite number"),
    case("rope_scaling_fractional_original_length",
         lambda: Llama3RopeScaling(original_max_position=8192.5),
         r"rope_scaling\.original_max_position=8192\.5 is invalid: must be a positive int"),
]


@pytest.mark.parametrize("build,match", MODEL_CONFIG_CASES)
def test_bad_model_config_is_refused_naming_the_field_and_what_is_allowed(build, match):
  with pytest.raises(ConfigError, match=match):
    build()


# --- tokenizers ------------------------------------------------------------------------------
# Not repeated: characters outside the alphabet, ids above the vocabulary of CharTokenizer,
# unknown special tokens, a missing tokenizer.json (test_tokenizer.py).

CHARS = CharTokenizer("ab")  # ids 0..4


@pytest.fixture
def tokenizer_dir(tmp_path):
  """A directory with a valid 4-token word-level tokenizer.json: a </s> 2, <s> 3."""
  RawTokenizer(tokenizer_models.WordLevel({"a": 0, "b": 1, "</s>": 2, "<s>": 3},
                                          unk_token=None)).save(str(tmp_path / "tokenizer.json"))
  return tmp_path


def _write(name: str, text: str):
  return lambda path: ((path / name).write_text(text), HFTokenizer.from_dir(path))


TOKENIZER_CASES = [
    case("encode_not_a_string", lambda p: CHARS.encode(None),
         TokenizerError, r"text=None is invalid: encode takes a str, got NoneType"),
    case("decode_negative_id", lambda p: CHARS.decode([3, -1]),
         TokenizerError, r"id -1 is out of range: allowed 0\.\.4 \(ids\[1\]\)"),
    case("decode_fractional_id", lambda p: CHARS.decode([3.7]),
         TokenizerError, r"ids\[0\]=3\.7 is invalid: allowed an int token id in 0\.\.4"),
    case("hf_decode_negative_id", lambda p: HFTokenizer.from_dir(p).decode([0, -1]),
         TokenizerError, r"id -1 is out of range: allowed 0\.\.3 \(ids\[1\]\)"),
    case("hf_encode_not_a_string", lambda p: HFTokenizer.from_dir(p).encode(b"ab"),
         TokenizerError, r"text=b'ab' is invalid: encode takes a str, got bytes"),
    case("corrupt_tokenizer_json", _write("tokenizer.json", "{not json"),
         TokenizerError, r"tokenizer\.json: not a readable tokenizer\.json .*re-download"),
    case("malformed_tokenizer_config", _write("tokenizer_config.json", '{"eos_token": }'),
         TokenizerError, r"tokenizer_config\.json: malformed JSON at line 1 column 15"),
    case("tokenizer_config_a_list", _write("tokenizer_config.json", "[]"),
         TokenizerError, r"tokenizer_config\.json: holds a JSON list, expected an object"),
    case("tokenizer_config_eos_an_int", _write("tokenizer_config.json", '{"eos_token": 2}'),
         TokenizerError, r"tokenizer_config\.json: eos_token=2 is invalid: allowed a token "
                         r"string"),
    case("malformed_generation_config", _write("generation_config.json", "[1,"),
         TokenizerError, r"generation_config\.json: malformed JSON at line 1 column 4"),
    case("generation_config_eos_a_string",
         _write("generation_config.json", '{"eos_token_id": "2"}'),
         TokenizerError, r"generation_config\.json: eos_token_id='2' is invalid: allowed a "
                         r"token id \(an int\) or a list of them"),
    case("generation_config_eos_list_with_a_string",
         _write("generation_config.json", '{"eos_token_id": [2, "x"]}'),
         TokenizerError, r"eos_token_id=\[2, 'x'\] is invalid"),
    case("generation_config_fractional_bos",
         _write("generation_config.json", '{"bos_token_id": 1.5}'),
         TokenizerError, r"generation_config\.json: bos_token_id=1\.5 is invalid: allowed a "
                         r"token id \(an int\)"),
    case("vocab_size_to_fit_a_string", lambda p: check_vocab_fits(CHARS, "64"),
         ConfigError, r"vocab_size='64' is invalid: allowed the model's vocabulary size"),
]


@pytest.mark.parametrize("call,error,match", TOKENIZER_CASES)
def test_bad_tokenizer_input_is_refused_naming_the_file_field_or_id(tokenizer_dir, call,
                                                                     error, match):
  with pytest.raises(error, match=match):
    call(tokenizer_dir)


def test_hf_decode_of_an_id_past_the_tokenizer_vocab_is_empty_as_in_transformers(
    tokenizer_dir):
  # Models pad their vocabulary past the tokenizer's; a sampled padding id decodes to
  # nothing in transformers' fast tokenizers too, so it is no error here either.
  tok = HFTokenizer.from_dir(tokenizer_dir)
  assert tok.decode([0, 7, 1]) == tok.decode([0, 1]) == tok.tokenizer.decode([0, 7, 1])


# --- RL tasks, rewards and configs -------------------------------------------------------------
# Not repeated: ArithmeticTask ranges, malformed GSM8K lines, rewards that raise or are not
# finite (test_rl_tasks.py); GRPOConfig ranges (test_rl_losses.py); ExperimentConfig numbers
# (test_train_guards.py).

ARITH_TOK = CharTokenizer("0123456789+-*=")
TINY_POLICY = ExperimentConfig().model  # 2 MTP modules


def _custom(train=(Example("1+1=", "2"),), reward_fn=lambda c, r: float(c == r), name="t"):
  return CustomTask(name, ARITH_TOK, list(train), [], reward_fn)


def _jsonl(tmp_path: Path, data: bytes) -> Path:
  path = tmp_path / "d.jsonl"
  path.write_bytes(data)
  return path


GOOD_LINE = b'{"question": "1+1?", "answer": "so #### 2"}\n'

RL_CASES = [
    case("arithmetic_zero_digits", lambda p: ArithmeticTask(max_digits=0),
         ConfigError, r"max_digits=0 is invalid: must be an int >= 1"),
    case("arithmetic_test_fraction_a_string", lambda p: ArithmeticTask(test_fraction="0.1"),
         ConfigError, r"test_fraction='0\.1' is invalid"),
    case("arithmetic_num_train_a_bool", lambda p: ArithmeticTask(num_train=True),
         ConfigError, r"num_train=True is invalid"),
    case("grpo_beta_infinite", lambda p: GRPOConfig(beta=math.inf),
         ConfigError, r"beta=inf is invalid: must be a finite number >= 0"),
    case("grpo_beta_a_string", lambda p: GRPOConfig(beta="0.1"),
         ConfigError, r"beta='0\.1' is invalid: must be a number"),
    case("experiment_vocab_smaller_than_the_tokenizers",
         lambda p: ExperimentConfig(model=TINY_POLICY.replace(vocab_size=16)),
         ConfigError, r"model\.vocab_size=16 is invalid: the task's tokenizer has 17 ids.*"
                      r"allowed: vocab_size >= 17"),
    case("experiment_zero_tree_width",
         lambda p: ExperimentConfig(rollout=RolloutSettings(tree_widths=(0,))),
         ConfigError, r"widths=\(0,\) is invalid: every width must be an int >= 1"),
    case("experiment_empty_tree_widths",  # `--rollout.tree-widths` with no value
         lambda p: ExperimentConfig(rollout=RolloutSettings(tree_widths=[])),
         ConfigError, r"rollout\.tree_widths=\(\) is invalid: drafter 'mtp' drafts a tree of "
                      r"at least one depth"),
    case("experiment_tree_deeper_than_the_mtp_modules",
         lambda p: ExperimentConfig(rollout=RolloutSettings(tree_widths=(1, 1, 1))),
         ConfigError, r"tree depth 3 is too deep for MTPDrafter"),
    case("experiment_unknown_drafter", lambda p: Drafting(name="foo"),
         ConfigError, r"drafter='foo' is invalid"),
    case("experiment_acceptance_carry_with_fixed_trees",
         lambda p: ExperimentConfig(rollout=RolloutSettings(acceptance_carry=0.5)),
         ConfigError, r"rollout\.acceptance_carry=0\.5 is invalid: needs "
                      r"rollout\.speculation='adaptive'"),
    case("experiment_zero_eagle3_ttt_steps",
         lambda p: Drafting(name="eagle3", ttt_steps=0),
         ConfigError, r"drafter\.ttt_steps=0 is invalid: must be an int >= 1"),
    case("experiment_rollout_devices_without_async_mode",
         lambda p: Pipeline(rollout_devices=4),
         ConfigError, r"pipeline\.rollout_devices=4 is invalid: needs async_mode=True"),
    case("experiment_negative_rollout_devices",
         lambda p: Pipeline(rollout_devices=-1, async_mode=True),
         ConfigError, r"pipeline\.rollout_devices=-1 is invalid: must be an int >= 0"),
    case("experiment_policy_lag_without_rollout_devices",
         lambda p: Pipeline(policy_lag=2, async_mode=True),
         ConfigError, r"pipeline\.policy_lag=2 is invalid: needs rollout_devices >= 1"),
    case("experiment_policy_lag_zero",
         lambda p: Pipeline(policy_lag=0, rollout_devices=4, async_mode=True),
         ConfigError, r"pipeline\.policy_lag=0 is invalid: must be an int >= 1"),
    case("experiment_rollout_devices_leave_none_to_train",
         lambda p: experiment._meshes(ExperimentConfig(
             pipeline=Pipeline(rollout_devices=8, async_mode=True))),
         ConfigError, r"pipeline\.rollout_devices=8 is invalid: there are 8 devices and the "
                      r"updates "
                      r"need at least one \(allowed: 0 \.\. 7\)"),
    case("experiment_acceptance_carry_above_one",
         lambda p: RolloutSettings(speculation="adaptive", acceptance_carry=2.0),
         ConfigError, r"rollout\.acceptance_carry=2\.0 is invalid: must be a number in "
                      r"\[0, 1\]"),
    case("experiment_negative_compaction", lambda p: RolloutSettings(compaction=-1),
         ConfigError, r"rollout\.compaction=-1 is invalid: must be an int >= 0"),
    case("rollout_config_compaction_a_float",
         lambda p: RolloutConfig(max_new_tokens=4, eos_id=2, compaction=1.5),
         ConfigError, r"compaction=1\.5 is invalid: must be an int >= 0"),
    case("experiment_unknown_override_field",
         lambda p: override(ExperimentConfig(), {"rollout.temprature": 0.5}),
         ConfigError, r"'temprature' is not a field of RolloutSettings: allowed "
                      r"prompts_per_step, max_new_tokens, temperature"),
    case("experiment_group_of_the_wrong_type",
         lambda p: ExperimentConfig(warm_start=dict(steps=3)),
         ConfigError, r"warm_start=\{'steps': 3\} is invalid: must be a WarmStart\(\.\.\.\)"),
    case("drafter_run_warm_start_negative",
         lambda p: DrafterTrainConfig(warm_start=WarmStart(steps=-1)),
         ConfigError, r"warm_start\.steps=-1 is invalid: must be an int >= 0"),
    case("custom_task_example_a_tuple", lambda p: _custom(train=[("1+1=", "2")]),
         ConfigError, r"train\[0\] of task 't' is invalid: must be an Example"),
    case("custom_task_without_a_name", lambda p: _custom(name=""),
         ConfigError, r"name='' is invalid: must be a non-empty str"),
    case("custom_task_reward_not_callable", lambda p: _custom(reward_fn=3),
         ConfigError, r"reward_fn=3 is invalid"),
    case("custom_task_prompt_the_tokenizer_cannot_encode",
         lambda p: _custom(train=[Example("one plus one", "2")]),
         ConfigError, r"train\[0\]"),
    case("custom_reward_returns_a_list",
         lambda p: _custom(reward_fn=lambda c, r: [1.0]).reward(["2"], ["2"]),
         RewardError, r"returned \[1\.0\], which is not a real number"),
    case("custom_reward_of_unequal_lengths", lambda p: _custom().reward(["2"], ["2", "3"]),
         ValueError, r"task 't': 1 completions but 2 references"),
    case("gsm8k_empty_file", lambda p: read_gsm8k_jsonl(_jsonl(p, b"\n  \n")),
         TaskError, r"d\.jsonl: no questions \(the file is empty or blank\)"),
    case("gsm8k_answer_overflowing_a_float",
         lambda p: read_gsm8k_jsonl(_jsonl(p, b'{"question": "q", "answer": "#### '
                                       + b"9" * 400 + b'"}\n')),
         TaskError, r"d\.jsonl:1: the answer after '####' is too large for a float"),
    case("gsm8k_line_not_utf8", lambda p: read_gsm8k_jsonl(_jsonl(p, GOOD_LINE + b"\xff\n")),
         TaskError, r"d\.jsonl:2"),
    case("gsm8k_answer_a_word_after_the_marker",
         lambda p: read_gsm8k_jsonl(_jsonl(p, b'{"question": "q", "answer": "#### three"}\n')),
         TaskError, r"d\.jsonl:1"),
    case("advantages_of_a_nan_reward",
         lambda p: group_advantages(np.array([1.0, math.nan, 0.0, 1.0]), 2),
         ValueError, r"rewards\[1\] = nan is not finite \(1 non-finite rewards\)"),
    case("loss_of_misaligned_old_logprobs",
         lambda p: grpo_loss(GRPOConfig(group_size=2), jnp.zeros((4, 3)), jnp.zeros((4, 5)),
                             jnp.zeros(4), jnp.ones((4, 3))),
         ValueError, r"grpo_loss: old_logprobs has shape \(4, 5\), logprobs \(4, 3\): allowed "
                     r"the same \[B, T\]"),
    case("loss_of_advantages_per_prompt",
         lambda p: grpo_loss(GRPOConfig(group_size=2), jnp.zeros((4, 3)), jnp.zeros((4, 3)),
                             jnp.zeros(2), jnp.ones((4, 3))),
         ValueError, r"advantages has shape \(2,\): allowed \[B\]=\(4,\) per row"),
    case("arithmetic_reward_of_misaligned_lengths",
         lambda p: arithmetic_reward(jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32),
                                     jnp.zeros(2, jnp.int32)),
         ValueError, r"lengths"),
    case("prompt_reader_pad_id_a_string",
         lambda p: PromptReader([{"prompt": [1], "answer": 0}], 1, pad_id="<pad>"),
         ConfigError, r"pad_id='<pad>' is invalid: must be an int \(a token id\)"),
]


@pytest.mark.parametrize("call,error,match", RL_CASES)
def test_bad_rl_task_reward_or_config_is_refused_naming_the_problem(tmp_path, call, error,
                                                                    match):
  with pytest.raises(error, match=match):
    call(tmp_path)


def test_an_experiment_may_embed_more_ids_than_its_tokenizer_has():
  # Checkpoints pad their vocabularies (Qwen3: 151,936 rows for 151,669 tokenizer ids).
  config = ExperimentConfig(model=TINY_POLICY.replace(vocab_size=32))
  assert config.model.vocab_size == 32 > config.task.tokenizer.vocab_size == 17
  assert config.task.tokenizer.decode([3, 20, 31, 4]) == config.task.tokenizer.decode([3, 4])


def test_a_nan_reward_under_jit_gives_its_group_nan_advantages_not_zero():
  rewards = jnp.array([1.0, jnp.nan, 0.0, 1.0])
  adv = np.asarray(jax.jit(lambda r: group_advantages(r, 2))(rewards))
  assert np.isnan(adv[:2]).all()  # before: 0.0, a silent "no signal" for a broken reward
  # The clean group is unaffected: (r - mean) / (std_ddof1 + eps), std = sqrt(0.5).
  np.testing.assert_allclose(adv[2:], [-0.5, 0.5] / (np.sqrt(0.5) + 1e-6), rtol=1e-6)


# --- checkpoints -----------------------------------------------------------------------------
# Not repeated: flipped, resized, added or deleted array files and broken manifests
# (test_checkpoint_integrity.py).

CKPT_STATE = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
  """A fresh Checkpointer (as a resumed run opens one) on a directory holding step 0 of
  `CKPT_STATE`; cases only read it."""
  directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
  writer = Checkpointer(directory)
  writer.save(0, CKPT_STATE, {"step": 0})
  writer.close()
  ckpt = Checkpointer(directory)
  yield ckpt
  ckpt.close()


RESTORE_CASES = [
    case("step_not_saved", lambda c: c.restore(CKPT_STATE, step=5),
         CheckpointError, r"checkpoint step 5 is not in .*checkpoints \(available: 0\)"),
    case("step_a_string", lambda c: c.restore(CKPT_STATE, step="0"),
         ConfigError, r"step='0' is invalid: allowed an int >= 0, or None for the latest"),
    case("state_without_a_saved_array", lambda c: c.restore({"w": CKPT_STATE["w"]}),
         CheckpointError, r"step 0 at .* does not match the state to restore into: b is in "
                          r"the checkpoint but not in the state\..*restore it with that "
                          r"configuration"),
    case("state_with_an_array_not_saved", lambda c: c.restore({**CKPT_STATE, "c": jnp.ones(2)}),
         CheckpointError, r"does not match the state to restore into: c is in the state but "
                          r"not in the checkpoint"),
    case("state_of_another_shape", lambda c: c.restore({**CKPT_STATE, "w": jnp.ones((4, 4))}),
         CheckpointError, r"w has shape \(4, 3\) in the checkpoint and \(4, 4\) in the state"),
    case("state_of_another_dtype",
         lambda c: c.restore({**CKPT_STATE, "w": jnp.ones((4, 3), jnp.int32)}),
         CheckpointError, r"w has dtype float32 in the checkpoint and int32 in the state \(it "
                          r"would be cast\)"),
]


@pytest.mark.parametrize("call,error,match", RESTORE_CASES)
def test_bad_restore_is_refused_naming_the_step_or_array(saved_checkpoint, call, error, match):
  with pytest.raises(error, match=match):
    call(saved_checkpoint)


def _flip_first_byte(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[0] ^= 0x01
  path.write_bytes(bytes(data))


SAVE_CASES = [
    case("save_step_a_string", lambda d: Checkpointer(d).save("a", CKPT_STATE, {}),
         ConfigError, r"step='a' is invalid: allowed an int >= 0$"),
    case("save_meta_not_json", lambda d: Checkpointer(d).save(0, CKPT_STATE, {"when": object()}),
         ConfigError, r"meta\['when'\]=<object .*> is invalid: it cannot be written as JSON"),
    case("directory_is_a_file", lambda d: (d.write_text("x"), Checkpointer(d)),
         CheckpointError, r"checkpoint path .*checkpoints exists and is not a directory"),
    case("keep_no_checkpoint", lambda d: Checkpointer(d, max_to_keep=0),
         ConfigError, r"max_to_keep=0 is invalid: must be an int >= 1"),
    case("directory_replaced_by_a_file_between_two_saves",
         lambda d: (lambda c: (c.save(0, CKPT_STATE, {"step": 0}), shutil.rmtree(d),
                               d.write_text("x"), c.save(1, CKPT_STATE, {"step": 1})))(
                                   Checkpointer(d)),
         CheckpointError, r"checkpoint step 1 cannot be written to .*checkpoints "
                          r"\(NotADirectoryError: .*\)\. .*check free space"),
    case("flipped_byte_in_the_saved_meta",
         lambda d: (lambda c: (c.save(0, CKPT_STATE, {"step": 0}),
                               _flip_first_byte(c.step_dir(0) / "meta" / "metadata"),
                               c.restore(CKPT_STATE)))(Checkpointer(d)),
         CheckpointError, r"checkpoint step 0 at .* is corrupted: meta/metadata has sha256 .* "
                          r"\(same size: its bytes changed\)"),
]


@pytest.mark.parametrize("call,error,match", SAVE_CASES)
def test_bad_save_or_directory_is_refused_naming_the_problem(tmp_path, call, error, match):
  with pytest.raises(error, match=match):
    call(tmp_path / "checkpoints")


@pytest.mark.parametrize("where", ["new", "empty"])
def test_restore_from_a_directory_without_checkpoints_returns_none(tmp_path, where):
  directory = tmp_path / "checkpoints"
  if where == "empty":
    directory.mkdir()
  assert Checkpointer(directory).restore(CKPT_STATE) is None


def test_saving_a_step_not_above_the_latest_warns_and_keeps_the_saved_one(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  ckpt.save(3, CKPT_STATE, {"step": 3})
  with pytest.warns(UserWarning, match=r"checkpoint step 2 was not saved: .* already holds "
                                       r"step 3"):
    ckpt.save(2, {"w": jnp.zeros((4, 3)), "b": jnp.ones(3)}, {"step": 2})
  state, meta, step = ckpt.restore(CKPT_STATE)
  np.testing.assert_array_equal(state["w"], CKPT_STATE["w"])
  assert (meta, step) == ({"step": 3}, 3)
  ckpt.close()


# --- the CLI -----------------------------------------------------------------------------------


def _config_file(tmp_path: Path, body: str) -> Path:
  path = tmp_path / "config.py"
  path.write_text(body)
  return path


@pytest.mark.parametrize("body,match", [
    pytest.param(None, r"--config .*missing\.py: no such file; pass a config file",
                 id="missing_config_file"),
    pytest.param("def get_config():\n  return 5\n",
                 r"config\.py: get_config\(\) returns a int; train needs an ExperimentConfig",
                 id="get_config_of_another_type"),
])
def test_specjax_train_with_a_bad_config_file_exits_with_a_message(tmp_path, body, match):
  # A real process: the exit status and stderr are what a user sees. cwd is tmp_path, so a
  # regression that trains the default config writes nothing into the repository.
  config = tmp_path / "missing.py" if body is None else _config_file(tmp_path, body)
  proc = subprocess.run([sys.executable, "-m", "specjax.cli", "train", "--config", str(config)],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=os.environ | {"JAX_PLATFORMS": "cpu",
                                          "PYTHONPATH": str(REPO)})
  assert proc.returncode == 1, proc.stderr
  assert re.search(match, proc.stderr), proc.stderr
  assert not (tmp_path / "runs").exists()


@pytest.fixture
def no_model(monkeypatch):
  """Loading a checkpoint or training the demo model fails the test: flags are checked first."""
  from specjax.experiments import demo
  from specjax.models import hf

  def refuse(*args, **kwargs):
    raise AssertionError("a model was loaded or trained before the flags were checked")

  monkeypatch.setattr(demo, "train_demo_model", refuse)
  monkeypatch.setattr(hf, "load_hf", refuse)
  monkeypatch.setattr(HFTokenizer, "from_dir", refuse)


CLI_CASES = [
    case("train_config_without_get_config",
         lambda p: cli_main(["train", "--config", str(_config_file(p, "x = 1\n"))]),
         SystemExit, r"config\.py defines no get_config\(\); see configs/arithmetic_tiny\.py"),
    case("train_drafter_missing_config_file",
         lambda p: cli_main(["train-drafter", "--config", str(p / "nope.py")]),
         SystemExit, r"--config .*nope\.py: no such file"),
    case("generate_demo_negative_temperature",
         lambda p: generate_command(demo=True, temperature=-1.0),
         ConfigError, r"temperature=-1\.0 is invalid: must be a finite number >= 0"),
    case("generate_demo_zero_width", lambda p: generate_command(demo=True, widths=(2, 0)),
         ConfigError, r"widths=\(2, 0\) is invalid: every width must be an int >= 1"),
    case("generate_zero_new_tokens",
         lambda p: generate_command(checkpoint=str(p), prompt=("a",), max_new_tokens=0),
         ConfigError, r"max_new_tokens=0 is invalid: must be an int >= 1"),
    case("generate_checkpoint_without_prompt", lambda p: generate_command(checkpoint=str(p)),
         SystemExit, r"pass at least one --prompt"),
    case("generate_draft_model_without_its_checkpoint",
         lambda p: generate_command(checkpoint=str(p), prompt=("a",), drafter="draft-model"),
         ConfigError, r"--drafter='draft-model' needs its weights: pass --draft-checkpoint=DIR"),
]


@pytest.mark.parametrize("call,error,match", CLI_CASES)
def test_bad_cli_flags_fail_before_any_model_is_loaded_naming_the_flag(tmp_path, no_model, call,
                                                                      error, match):
  with pytest.raises(error, match=match):
    call(tmp_path)


def test_specjax_train_with_a_bad_flag_value_exits_2_naming_the_flag(capsys):
  with pytest.raises(SystemExit) as info:
    cli_main(["train", "--config", str(REPO / "configs" / "arithmetic_tiny.py"),
              "--steps", "many"])
  assert info.value.code == 2
  assert re.search(r"--steps.*invalid literal for int\(\).*'many'", capsys.readouterr().err,
                   re.S)


# --- offline drafter data: an HF tokenizer paired with its target -----------------------------


def test_drafter_target_whose_tokenizer_exceeds_the_model_vocab_is_refused(tmp_path):
  from specjax.experiments.drafter import DrafterTrainConfig
  from specjax.experiments.drafter_data import target_spec
  write_tiny_checkpoint(tmp_path, vocab_size=8)  # a tokenizer of 10 ids
  with pytest.raises(ConfigError, match=r"tokenizer vocab 10 > model vocab_size 8"):
    target_spec(DrafterTrainConfig(run_dir=str(tmp_path / "run"), target_dir=str(tmp_path)))


def test_drafter_data_generation_stops_at_every_end_id_of_the_tokenizer(tmp_path, monkeypatch):
  from specjax.experiments import drafter_data
  write_tiny_checkpoint(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
  tokenizer = HFTokenizer.from_dir(tmp_path)
  assert tokenizer.eos_ids == (2, 3)  # </s> and <|eot_id|>
  calls = []

  def spy(params, config, tokens, lengths, key, **kwargs):
    calls.append(kwargs)
    return tokens, np.ones_like(tokens)

  monkeypatch.setattr(drafter_data, "self_distillation_data", spy)
  config = SimpleNamespace(seed=0, head=SimpleNamespace(draft_vocab_size=None),
                           data=SimpleNamespace(responses_per_prompt=1, generation_batch=2,
                                                max_new_tokens=2, temperature=0.0))
  target = drafter_data.Target(None, ModelConfig(**BASE), tokenizer)
  drafter_data.make_data(config, target, np.array([[4, 5]], np.int32), np.array([2], np.int32))
  assert calls[0]["eos_id"] == (2, 3)
