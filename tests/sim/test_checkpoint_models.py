"""The simulator on a checkpoint's own model: `specjax simulate --model DIR` reads its
config.json (`ModelSpec.from_hf_config`); transformers' models are the referee of the counts."""

import dataclasses
import json

import pytest
import torch
import transformers

from specjax import sim
from specjax.errors import ConfigError
from specjax.sim.cli import simulate_main

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "mistral": lambda: transformers.MistralConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24),
    "qwen3 tied": lambda: transformers.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=6,
                                                     num_experts_per_tok=2,
                                                     moe_intermediate_size=40),
}
# The hub's config.json of three presets, the fields the simulator reads.
PUBLIC = {
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "num_hidden_layers": 36, "vocab_size": 151936, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16"},
    "qwen3-1.7b": {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "num_hidden_layers": 28, "vocab_size": 151936, "tie_word_embeddings": True,
                   "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_hidden_layers": 48, "vocab_size": 151936,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


def _matmul_params(model: torch.nn.Module) -> int:
  """What the simulator counts: every parameter but norm weights and biases."""
  return sum(p.numel() for name, p in model.named_parameters()
             if "norm" not in name and not name.endswith("bias"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_directory_has_the_parameters_transformers_builds(tmp_path, family):
  config = FAMILIES[family]()
  model = transformers.AutoModelForCausalLM.from_config(config)
  config.save_pretrained(tmp_path / "my-model")
  spec = sim.model_spec(str(tmp_path / "my-model"))
  assert spec.name == "my-model"
  assert spec.total_params == _matmul_params(model)
  assert spec.is_moe == (family == "qwen3_moe")
  assert sim.model_spec(str(tmp_path / "my-model" / "config.json")) == spec


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_a_config_json_without_head_dim_has_transformers_default(tmp_path, family):
  """Qwen3's is 128 whatever the width; the others split the width over the heads."""
  FAMILIES[family]().save_pretrained(tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  hf.pop("head_dim", None)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  assert sim.model_spec(str(tmp_path)).total_params == _matmul_params(
      transformers.AutoModelForCausalLM.from_config(
          transformers.AutoConfig.from_pretrained(tmp_path)))
  if family != "qwen3_moe":  # the loader reads dense families
    from specjax.models import config_from_hf
    assert config_from_hf(hf).head_dim == (128 if family == "qwen3" else 16)


@pytest.mark.parametrize("preset", PUBLIC)
def test_a_public_config_json_gives_its_preset(tmp_path, preset):
  (tmp_path / "config.json").write_text(json.dumps(PUBLIC[preset]))
  spec = sim.model_spec(str(tmp_path))
  assert dataclasses.replace(spec, name=preset) == sim.model_spec(preset)


def test_simulate_runs_on_a_checkpoint_directory(tmp_path, capsys):
  (tmp_path / "Qwen3-8B").mkdir()
  (tmp_path / "Qwen3-8B" / "config.json").write_text(json.dumps(PUBLIC["qwen3-8b"]))
  args = ["--devices", "8xH200", "--rollout-batch", "16", "--group-size", "4",
          "--response-len", "256", "--max-response-len", "512", "--acceptance", "2.5"]
  assert simulate_main(["--model", str(tmp_path / "Qwen3-8B")] + args) == 0
  mine = capsys.readouterr().out
  assert simulate_main(["--model", "qwen3-8b"] + args) == 0
  preset = capsys.readouterr().out
  assert "model     Qwen3-8B (8.19B params, dense)" in mine
  assert mine.splitlines()[1:] == preset.splitlines()[1:]  # the same model, the same answer
  # A draft model from a checkpoint too; a Qwen3 checkpoint's default one is Qwen3-0.6B's.
  small = tmp_path / "small"
  small.mkdir()
  (small / "config.json").write_text(json.dumps(dict(PUBLIC["qwen3-8b"], num_hidden_layers=4)))
  draft = ["--model", str(tmp_path / "Qwen3-8B"), "--drafter", "draft-model"]
  outs = []
  for extra in (["--draft-model", str(small)], ["--draft-model", "qwen3-0.6b"]):
    assert simulate_main(draft + extra + args) == 0
    outs.append(capsys.readouterr().out)
  assert outs[0] != outs[1]
  with pytest.raises(SystemExit):  # a checkpoint's family is not told by its directory's name
    simulate_main(draft + args)
  assert "no default draft model for 'Qwen3-8B'" in capsys.readouterr().err


def test_a_linked_checkpoint_is_named_after_the_link(tmp_path):
  (tmp_path / "snapshots" / "0123abcd").mkdir(parents=True)
  (tmp_path / "snapshots" / "0123abcd" / "config.json").write_text(
      json.dumps(PUBLIC["qwen3-8b"]))
  (tmp_path / "My-Qwen").symlink_to(tmp_path / "snapshots" / "0123abcd")
  assert sim.model_spec(str(tmp_path / "My-Qwen")).name == "My-Qwen"


def _broken(tmp_path, text):
  (tmp_path / "config.json").write_text(text)
  return str(tmp_path)


@pytest.mark.parametrize("make, message", [
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], model_type="gpt2"))),
     "model_type='gpt2' is unsupported by the simulator: allowed llama, mistral, qwen2, qwen3"),
    (lambda p: _broken(p, json.dumps({k: v for k, v in PUBLIC["qwen3-8b"].items()
                                      if k != "intermediate_size"})),
     "lacks 'intermediate_size', which a qwen3 model needs"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-30b-a3b"], mlp_only_layers=[0, 1]))),
     "dense layers among the sparse ones"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], torch_dtype="int8"))),
     "torch_dtype='int8' is unsupported: allowed float32, bfloat16, float16"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], torch_dtype=["bfloat16"]))),
     r"torch_dtype=\['bfloat16'\] is unsupported"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], num_hidden_layers="36"))),
     "config.json of .*n_layers='36' is invalid: must be an int > 0"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], num_key_value_heads=5))),
     "n_kv_heads=5 is invalid: must divide n_heads=32"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], num_key_value_heads=0))),
     "config.json of .*n_kv_heads=0 is invalid: must be an int > 0"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"], tie_word_embeddings="false"))),
     "tie_word_embeddings='false' is invalid: must be true or false"),
    (lambda p: _broken(p, json.dumps(dict(PUBLIC["qwen3-8b"],
                                          quantization_config={"quant_method": "fp8"}))),
     "a quantized checkpoint .* is unsupported"),
    (lambda p: _broken(p, "[1, 2]"), "config.json: holds a JSON list, expected an object"),
    (lambda p: _broken(p, "{not json"), "config.json: malformed JSON at line 1"),
    (lambda p: str(p), "config.json does not exist"),  # a directory without one
    (lambda p: str(p / "absent"), "unknown: allowed tiny, .*or a checkpoint directory"),
])
def test_a_checkpoint_the_simulator_cannot_model_is_refused(tmp_path, make, message):
  with pytest.raises(ConfigError, match=message):
    sim.model_spec(make(tmp_path))


def test_a_runs_summary_gives_the_simulator_its_response_lengths(tmp_path, capsys):
  lengths = [12, 30, 30, 95, 14, 22, 200, 41]
  (tmp_path / "summary.json").write_text(json.dumps({"speedup": 1.0,
                                                     "response_lengths": lengths}))
  (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)))
  args = ["--model", "qwen3-0.6b", "--devices", "1xH200", "--rollout-batch", "2",
          "--group-size", "4", "--acceptance", "2.5", "--response-lengths"]
  outs = []
  for name in ("summary.json", "lengths.txt"):
    assert simulate_main(args + [str(tmp_path / name)]) == 0
    outs.append(capsys.readouterr().out)
  assert outs[0] == outs[1] and "longest response 200 tokens" in outs[0]
  (tmp_path / "other.json").write_text(json.dumps({"speedup": 1.0}))
  (tmp_path / "words.txt").write_text("12 many 30")
  (tmp_path / "odd.json").write_text("[12, true, 1.5]")
  (tmp_path / "zero.txt").write_text("12 0 30")
  (tmp_path / "huge.json").write_text("[1e400]")
  for name, message in (("other.json", "without 'response_lengths'"),
                        ("words.txt", "must hold response lengths, whole numbers >= 1"),
                        ("odd.json", "must hold response lengths"),
                        ("zero.txt", "must hold response lengths"),
                        ("huge.json", "must hold response lengths"),
                        ("absent.json", "cannot read it")):
    with pytest.raises(SystemExit):
      simulate_main(args + [str(tmp_path / name)])
    assert message in capsys.readouterr().err


def test_simulate_takes_a_runs_measured_acceptance_and_lengths(tmp_path, capsys):
  """`--acceptance-from summary.json:ARM` reads the run's acceptance arm, `--response-lengths`
  its lengths: the simulation of the run's own measurements, per drafter."""
  import json
  summary = tmp_path / "summary.json"
  summary.write_text(json.dumps({"response_lengths": [26, 24, 25, 26],
                                 "arm_acceptance_history_mean": 4.88,
                                 "arm_acceptance_group_mean": 1.17,
                                 "simulated_acceptance": 4.88}))
  args = ["--model", "qwen3-0.6b", "--devices", "1xH200", "--rollout-batch", "2",
          "--group-size", "2", "--prompt-len", "9", "--drafter", "ngram", "--draft-length",
          "8", "--response-lengths", str(summary)]
  assert simulate_main(args + ["--acceptance-from", f"{summary}:history"]) == 0
  out = capsys.readouterr().out
  assert f"acceptance 4.880 tokens per round, from {summary}:history" in out
  assert "spec adaptive" in out
  with pytest.raises(SystemExit):
    simulate_main(args + ["--acceptance-from", f"{summary}:mtp"])
  err = capsys.readouterr().err
  assert "has no arm_acceptance_mtp_mean; allowed arms: group, history" in err
  with pytest.raises(SystemExit):
    simulate_main(args + ["--acceptance-from", str(summary), "--acceptance", "2"])
