"""specjax.sim: hand-computed costs, properties of the schedule, the CLI and the sweep PNG."""

import dataclasses
import math

import numpy as np
import pytest

from specjax import sim
from specjax.errors import ConfigError
from specjax.experiments.device_profile import calibrate_profile
from specjax.sim.cli import simulate_main

SMALL = sim.ModelSpec("small", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab=100, mlp_dim=128)


def unit_profile(**changes) -> sim.DeviceProfile:
  """Round numbers, constant efficiencies: every cost can be worked out by hand."""
  base = dict(name="unit", peak_flops=1e12, hbm_bw=1e11, hbm_bytes=1e12, link_bw=1e10,
              scaleout_bw=1e9, domain=8, matmul_eff=sim.Curve.constant(0.5), mem_eff=0.8,
              kv_eff=sim.Curve.constant(0.5), attn_flops_eff=0.25, layer_overhead_s=1e-5,
              round_overhead_s=1e-4, spec_round_overhead_s=0.0, train_mfu=0.4,
              collective_eff=1.0, collective_latency_s=0.0)
  base.update(changes)
  return sim.DeviceProfile(**base)


def overhead_only_profile() -> sim.DeviceProfile:
  """Infinitely fast compute and memory: every forward costs its fixed overhead, whatever
  its tokens, so a verify forward costs exactly a decode step."""
  return unit_profile(peak_flops=1e30, hbm_bw=1e30, round_overhead_s=0.0)


def qwen_workload(rows_per_prompt=4, prompts=4, median=200, max_tokens=512):
  return sim.Workload(prompts, rows_per_prompt, 64, sim.Lognormal(median, 0.8, max_tokens))


# Hand-computed costs -----------------------------------------------------------------------


def test_forward_roofline_equals_hand_computed_seconds():
  # Per layer: q, o 64x64 each, k, v 64x32 each -> 12288; MLP 3 x 64 x 128 = 24576.
  # 4 rows x 2 tokens = 8 tokens at context 10, bf16 weights and KV.
  matmul_flops = 2 * 8 * 2 * (12288 + 24576) + 2 * 8 * 100 * 64       # 1,282,048
  weight_bytes = 2 * (2 * (12288 + 24576) + 100 * 64)                  # 160,256
  matmul = max(matmul_flops / (1e12 * 0.5), weight_bytes / (1e11 * 0.8))
  attention_flops = 4 * 2 * 4 * 16 * 8 * (10 + (2 + 1) / 2)            # 47,104
  kv_bytes = 2 * 2 * 2 * 16 * 2 * 4 * (10 + 2)                          # 12,288
  attention = max(attention_flops / (1e12 * 0.25), kv_bytes / (1e11 * 0.5))
  expected = matmul + attention + 2 * 1e-5
  t = sim.forward_time(SMALL, unit_profile(), rows=4, tokens_per_row=2, context=10)
  assert float(t.total) == pytest.approx(expected, rel=1e-12)
  assert float(t.matmul) == pytest.approx(2.564096e-6, rel=1e-12)
  # Tensor parallel over 2: half the products and KV, plus 2 all-reduces per layer of the
  # 8 x 64 bf16 activations, each 2 * (1/2) * 1024 B / 10 GB/s.
  t2 = sim.forward_time(SMALL, unit_profile(), rows=4, tokens_per_row=2, context=10, replica=2)
  expected2 = (max(matmul_flops / 2 / 5e11, weight_bytes / 2 / 8e10)
               + max(attention_flops / 2 / 2.5e11, kv_bytes / 2 / 5e10)
               + 2 * 2 * 1024 / 1e10 + 2e-5)
  assert float(t2.total) == pytest.approx(expected2, rel=1e-12)


def test_parameter_counts_match_the_published_model_sizes():
  assert sim.model_spec("llama3-8b").total_params / 1e9 == pytest.approx(8.03, abs=0.01)
  moe = sim.model_spec("qwen3-235b-a22b")
  assert moe.total_params / 1e9 == pytest.approx(235.1, abs=0.2)
  assert moe.active_params / 1e9 == pytest.approx(22.2, abs=0.1)
  # One token reads its k experts; a prefill-sized forward reads all of them.
  assert moe.touched_experts(1) == pytest.approx(8.0)
  assert moe.touched_experts(10_000) == pytest.approx(128.0)
  small = moe.forward_work(1, 1, 0).weight_bytes
  assert small < 0.15 * moe.param_bytes < moe.forward_work(64, 64, 0).weight_bytes


def test_training_time_is_six_n_d_over_peak_times_mfu():
  profile, tokens = unit_profile(), 1_000_000.0
  cluster = sim.Cluster(profile, 1)
  for model in (SMALL, sim.model_spec("qwen3-30b-a3b")):
    n = model.active_params
    assert sim.training_seconds(model, cluster, tokens) == pytest.approx(
        6 * n * tokens / (1e12 * 0.4), rel=1e-12)
    assert sim.logprob_seconds(model, cluster, tokens) == pytest.approx(
        2 * n * tokens / (1e12 * 0.4), rel=1e-12)


def test_plain_rollout_of_fixed_length_is_prefill_plus_one_round_per_token():
  profile, length = unit_profile(), 50
  workload = sim.Workload(2, 2, 16, sim.Fixed(length))
  r = sim.simulate_rollout(SMALL, sim.Cluster(profile, 1), workload)
  assert r.rounds == length and (r.live == 4).all()
  rounds = sum(float(sim.round_time(SMALL, profile, sim.PLAIN, 4, 16 + g).total)
               for g in range(length))
  prefill = float(sim.forward_time(SMALL, profile, 4, 16, 0, head_tokens=4).total)
  assert r.seconds == pytest.approx(prefill + rounds, rel=1e-12)


def test_chain_expected_tokens_by_hand():
  assert sim.chain_expected_tokens((0.8, 0.5), 2) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
  alpha = sim.per_depth_from_mean(3, 3.3)[0]
  assert 1 + alpha + alpha**2 + alpha**3 == pytest.approx(3.3, rel=1e-9)


def test_sampler_costs_every_verified_logit_of_every_live_row():
  # 4 rows x (chain of 2: root + 2 nodes) x vocab 100, at 1 ns (log-softmax) + 3 ns (draw).
  profile = unit_profile(logit_s=1e-9, sample_logit_s=3e-9)
  chain = sim.MenuEntry("chain2", (1, 1), 2.0)
  free = sim.round_time(SMALL, unit_profile(), chain, 4, 10)
  drawn = sim.round_time(SMALL, profile, chain, 4, 10)
  greedy = sim.round_time(SMALL, profile, chain, 4, 10, greedy=True)
  assert float(drawn.sampling) == pytest.approx(4 * 3 * 100 * 4e-9, rel=1e-12)
  assert float(greedy.sampling) == pytest.approx(4 * 3 * 100 * 1e-9, rel=1e-12)
  assert float(drawn.total - drawn.sampling) == pytest.approx(float(free.total), rel=1e-12)
  # A drafter that is a model samples its own vocabulary at each of its nodes.
  drafted = sim.round_time(SMALL, profile, chain, 4, 10, drafter=SMALL)
  assert float(drafted.sampling) == pytest.approx(4 * (3 + 2) * 100 * 4e-9, rel=1e-12)
  # A rollout pays it in every round and for the first token; greedy workloads skip the draw.
  workload = sim.Workload(1, 4, 16, sim.Fixed(8))
  cluster = sim.Cluster(profile, 1)
  r = sim.simulate_rollout(SMALL, cluster, workload)
  assert r.sampling == pytest.approx(8 * 4 * 100 * 4e-9, rel=1e-9)
  plain = sim.simulate_rollout(SMALL, sim.Cluster(unit_profile(), 1), workload)
  assert r.seconds - plain.seconds == pytest.approx(9 * 4 * 100 * 4e-9, rel=1e-9)
  greedy_run = sim.simulate_rollout(SMALL, cluster, dataclasses.replace(workload, greedy=True))
  assert greedy_run.sampling == pytest.approx(8 * 4 * 100 * 1e-9, rel=1e-9)


def test_acceptance_one_with_free_drafting_costs_the_verify_ratio():
  profile, length = unit_profile(), 40
  workload = sim.Workload(1, 4, 16, sim.Fixed(length))
  cluster = sim.Cluster(profile, 1)
  never = sim.Speculation.chain("ngram", 3, per_depth=(0.0, 0.0, 0.0))
  plain = sim.simulate_rollout(SMALL, cluster, workload)
  spec = sim.simulate_rollout(SMALL, cluster, workload, never, "fixed")
  assert spec.rounds == plain.rounds == length and spec.draft == 0.0
  verify = sum(float(sim.round_time(SMALL, profile, never.fixed, 4, 16 + g).total)
               for g in range(length))
  step = sum(float(sim.round_time(SMALL, profile, sim.PLAIN, 4, 16 + g).total)
             for g in range(length))
  ratio = (spec.seconds - spec.prefill) / (plain.seconds - plain.prefill)
  assert ratio == pytest.approx(verify / step, rel=1e-12)
  assert ratio > 1.0  # four tokens per row cost more than one here


def test_speedup_equals_acceptance_when_verify_costs_one_step_and_drafting_is_free():
  # One long row: no batch waits for a straggler, so this is the fluid limit.
  cluster, length = sim.Cluster(overhead_only_profile(), 1), 3000
  workload = sim.Workload(1, 1, 16, sim.Fixed(length))
  plain = sim.simulate_rollout(SMALL, cluster, workload)
  for acceptance in (1.5, 2.8, 3.3):
    spec = sim.simulate_rollout(SMALL, cluster, workload,
                                sim.Speculation.chain("ngram", 3, acceptance), "fixed")
    assert abs(spec.rounds - math.ceil(length / acceptance - 1e-9)) <= 1
    assert (plain.seconds - plain.prefill) / (spec.seconds - spec.prefill) == pytest.approx(
        acceptance, rel=2e-3)


def test_stragglers_match_a_monte_carlo_of_rows_accepting_at_random():
  # 8 rows of 120 tokens, a chain of 4 accepted at each depth with probability 0.6: the
  # batch runs until its unluckiest row is done. Reference: 20,000 sampled batches.
  per_depth, rows, length = (0.6,) * 4, 8, 120
  reach = 0.6 ** np.arange(5)  # P(a round emits more than j tokens), j = 0..4
  emitted = np.random.default_rng(0).choice(
      np.arange(1, 6), size=(20000, rows, length), p=reach - np.append(reach[1:], 0.0))
  done_after = (emitted.cumsum(-1) >= length).argmax(-1) + 1  # [trials, rows]
  batch_rounds = done_after.max(-1).mean()
  row_rounds = done_after.sum(-1).mean()
  spec = sim.simulate_rollout(
      SMALL, sim.Cluster(overhead_only_profile(), 1), sim.Workload(1, rows, 16, sim.Fixed(length)),
      sim.Speculation.chain("ngram", 4, per_depth=per_depth), "fixed")
  assert float(spec.running.sum()) == pytest.approx(batch_rounds, rel=0.03)
  assert float((spec.live * spec.running).sum()) == pytest.approx(row_rounds, rel=0.03)
  # Negative control: the fluid model (every row emits E each round) misses the tail.
  fluid = math.ceil(length / sim.chain_expected_tokens(per_depth, 4))
  assert batch_rounds > 1.08 * fluid


# Properties ---------------------------------------------------------------------------------


def test_more_acceptance_is_never_slower():
  model, workload = sim.model_spec("qwen3-8b"), qwen_workload()
  cluster = sim.Cluster(sim.device_profile("H100"), 8)
  for policy in ("fixed", "adaptive"):
    times = [sim.simulate_step(model, cluster, workload,
                               sim.Speculation.chain("eagle3", 3, a), policy).generation
             for a in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times
    assert times[-1] < 0.5 * times[0]


def test_a_larger_model_is_slower():
  workload, cluster = qwen_workload(), sim.Cluster(sim.device_profile("H200"), 8)
  spec = sim.Speculation.chain("eagle3", 3, 3.0)
  steps = [sim.simulate_step(sim.model_spec(name), cluster, workload, spec, "fixed")
           for name in ("qwen3-0.6b", "llama3-8b", "qwen3-32b")]
  for stage in ("generation", "training", "logprob", "overall"):
    seconds = [getattr(s, stage) for s in steps]
    assert seconds == sorted(seconds) and len(set(seconds)) == 3, (stage, seconds)


@pytest.mark.parametrize("case", ["memory-bound", "compute-bound", "costly drafter"])
def test_adaptive_is_never_worse_than_plain_or_any_fixed_entry(case):
  model, drafter = sim.model_spec("qwen3-8b"), "eagle3"
  profile, workload = sim.device_profile("H100"), qwen_workload()
  per_depth = (0.8, 0.7, 0.6, 0.5)
  if case == "compute-bound":  # a slow chip at a large batch: deep verification costs a lot
    profile = profile.replace(peak_flops=2e13)
    workload, per_depth = qwen_workload(rows_per_prompt=16, prompts=16), (0.5, 0.4, 0.3, 0.2)
  if case == "costly drafter":
    drafter = "mtp"
  cluster = sim.Cluster(profile, 8)
  speculation = sim.Speculation.chain(drafter, len(per_depth), per_depth=per_depth)
  adaptive = sim.simulate_rollout(model, cluster, workload, speculation, "adaptive").seconds
  others = {"plain": sim.simulate_rollout(model, cluster, workload).seconds}
  for k in range(1, len(per_depth) + 1):
    fixed = sim.Speculation.chain(drafter, k, per_depth=per_depth[:k])
    others[f"chain{k}"] = sim.simulate_rollout(model, cluster, workload, fixed, "fixed").seconds
  assert adaptive <= min(others.values()) * (1 + 1e-3), (adaptive, others)
  if case == "compute-bound":  # negative control: here a fixed deep chain loses to plain
    assert others["chain4"] > others["plain"]


def test_adaptive_keeps_drafting_for_the_stragglers_of_short_responses():
  """The README demo's shapes (a 0.66M-parameter policy, 128 rows of 24-26 tokens, chains up
  to 8) on an H200: the adaptive schedule once picked plain decoding as the *mean* row neared
  its end and kept it for the whole straggler tail, predicting 1.00x at 4.88 tokens a round
  but 1.46x at 4.73, under a fixed chain of 8 (1.53x). It must be monotone in acceptance and
  never worse than the fixed chain."""
  model = sim.ModelSpec(name="demo", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2,
                        head_dim=32, vocab=40, mlp_dim=512, weight_bytes=4.0, kv_bytes=4.0)
  cluster = sim.Cluster(sim.device_profile("H200"), 1)
  workload = sim.Workload(16, 8, 9, sim.Empirical((26,) * 64 + (24,) * 48 + (25,) * 16))
  plain = sim.simulate_rollout(model, cluster, workload).seconds
  speedups = []
  for acceptance in (4.0, 4.5, 4.73, 4.88, 5.2, 6.0):
    spec = sim.Speculation.chain("ngram", 8, acceptance=acceptance)
    adaptive = sim.simulate_rollout(model, cluster, workload, spec, "adaptive").seconds
    fixed = sim.simulate_rollout(model, cluster, workload, spec, "fixed").seconds
    assert adaptive <= fixed * (1 + 1e-3), (acceptance, adaptive, fixed)
    speedups.append(plain / adaptive)
  assert speedups == sorted(speedups) and speedups[-1] > 1.5, speedups


def test_the_live_batch_shrinks_over_a_long_tailed_rollout():
  workload = sim.Workload(16, 8, 64, sim.Lognormal(300, 1.0, 2048))
  r = sim.simulate_rollout(sim.model_spec("qwen3-8b"), sim.Cluster(sim.device_profile("H200"), 1),
                           workload)
  assert r.live[0] == workload.rows and r.live[-1] >= 1
  assert (np.diff(r.live) <= 0).all()
  tail = r.live[3 * r.rounds // 4:]
  assert tail.mean() < 0.1 * workload.rows
  # Decode is weight-bound: a round of a few rows costs about what a round of all rows
  # costs, so the tail's seconds per token grow about as the live batch shrinks.
  per_token = r.round_seconds / r.live
  assert per_token[-1] / per_token[0] > 0.5 * r.live[0] / r.live[-1] > 10


def test_async_on_split_devices_overlaps_rollout_and_training():
  model, workload = sim.model_spec("qwen3-8b"), qwen_workload()
  split = sim.Cluster(sim.device_profile("H100"), 16, rollout_devices=8, train_devices=8)
  sync = sim.simulate_step(model, split, workload)
  parts = sync.stages()
  rollout_side = parts["data"] + parts["prepare"] + parts["generation"] + parts["reward"]
  train_side = parts["logprob"] + parts["training"]
  assert sync.overall == pytest.approx(rollout_side + train_side + parts["sync"])
  one = sim.simulate_step(model, split, workload, schedule=sim.Schedule(asynchronous=True))
  assert one.overall == pytest.approx(max(rollout_side, train_side) + parts["sync"])
  two = sim.simulate_step(model, split, workload,
                          schedule=sim.Schedule(asynchronous=True, policy_lag=2))
  assert two.overall == pytest.approx(max(rollout_side, train_side, parts["sync"]))
  assert two.overall <= one.overall < sync.overall
  # Colocated, the same devices do both phases: async buys no overlap.
  together = sim.Cluster(sim.device_profile("H100"), 16)
  assert (sim.simulate_step(model, together, workload, schedule=sim.Schedule(asynchronous=True))
          .overall == pytest.approx(sim.simulate_step(model, together, workload).overall))


def test_fit_efficiency_recovers_the_factors_that_made_the_measurements():
  truth = unit_profile(mem_eff=0.55, layer_overhead_s=3e-5)
  shapes = [(1, 1, 100), (8, 1, 100), (8, 4, 100), (32, 1, 400), (1, 8, 50)]
  measured = [sim.Measurement("forward", SMALL,
                              float(sim.forward_time(SMALL, truth, b, t, c).total),
                              rows=b, tokens=t, context=c) for b, t, c in shapes]
  fitted = sim.fit_efficiency(measured, unit_profile(), ("mem_eff", "layer_overhead_s"))
  assert fitted.mem_eff == pytest.approx(0.55, rel=1e-2)
  assert fitted.layer_overhead_s == pytest.approx(3e-5, rel=1e-2)
  assert np.abs(sim.prediction_errors(measured, fitted)).max() < 1e-3
  assert np.abs(sim.prediction_errors(measured, unit_profile())).max() > 0.05  # control


def test_device_profiles_parse_and_round_trip_through_json():
  profile, count = sim.parse_devices("32xGB200")
  assert count == 32 and profile.peak_flops == 2.5e15 and profile.domain == 72
  assert sim.parse_devices("tpu-v5e")[0].hbm_bw == 819e9
  for name in sim.DEVICE_NAMES:
    assert sim.device_profile(name).ridge > 50
  assert sim.DeviceProfile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize("text, message", [
    ("not json", r"not JSON \(Expecting value"),
    ("[1, 2]", r"a JSON list; allowed a DeviceProfile as JSON"),
    ('{"name": "x"}', r"missing fields \['peak_flops', .*'collective_latency_s'\]"),
    (None, r"DeviceProfile\.kv_eff=3 is invalid: allowed \{\"knots\""),
    (None, r"unknown fields \['speed'\]"),
])
def test_a_profile_json_that_is_not_a_profile_is_refused_naming_what_is_wrong(
    tmp_path, capsys, text, message):
  """`specjax simulate --profile-json F` printed a traceback (JSONDecodeError, KeyError,
  TypeError) for each; now the parser's one-line error names the file and the problem."""
  import json
  fields = json.loads(sim.parse_devices("H200")[0].to_json())
  if text is None:
    fields |= {"kv_eff": 3} if "kv_eff" in message else {"speed": 1.0}
    text = json.dumps(fields)
  with pytest.raises(ConfigError, match=message):
    sim.DeviceProfile.from_json(text)
  path = tmp_path / "profile.json"
  path.write_text(text)
  with pytest.raises(SystemExit) as exit_info:
    simulate_main(["--profile-json", str(path)])
  assert exit_info.value.code == 2
  assert f"--profile-json {path}: DeviceProfile" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    simulate_main(["--profile-json", str(tmp_path / "missing.json")])
  assert "missing.json: cannot read it" in capsys.readouterr().err


def test_sim_calibrate_refuses_an_output_directory_that_does_not_exist_before_measuring(
    tmp_path, capsys, monkeypatch):
  from specjax.cli import main
  from specjax.experiments import device_profile
  monkeypatch.setattr(device_profile, "calibrate_profile", lambda **_: pytest.fail("measured"))
  with pytest.raises(SystemExit) as exit_info:
    main(["sim", "calibrate", "--out", str(tmp_path / "no" / "profile.json")])
  assert exit_info.value.code == 2
  assert f"its directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err


def test_calibration_takes_the_repeats_of_its_shapes_in_turn():
  # Round robin after one warm-up pass: a burst of load from other work then slows every
  # shape alike instead of bending the efficiency curve (sequential repeats would give
  # [0, 0, 0, 1, 1, 1, 2, 2, 2] after the warm-ups; `specjax.timing.interleaved` rotates
  # which goes first).
  from specjax.experiments.device_profile import _interleaved_medians
  order = []
  seconds = _interleaved_medians([lambda i=i: order.append(i) for i in range(3)], repeats=2)
  assert order == [0, 1, 2] + [0, 1, 2] + [1, 2, 0]
  assert len(seconds) == 3 and all(s >= 0 for s in seconds)


def test_calibrate_profile_measures_this_machine_and_the_cli_simulates_on_it(tmp_path, capsys):
  profile = calibrate_profile(matmul_dim=256, matmul_rows=(1, 64), copy_megabytes=16,
                              decode_cases=((128, 1, 1), (512, 1, 1)), repeats=2)
  assert profile.peak_flops > 1e8 and profile.hbm_bw > 1e8
  assert 0 < profile.mem_eff <= 1.5 and profile.layer_overhead_s >= 0
  path = tmp_path / "profile.json"
  path.write_text(profile.to_json())
  assert simulate_main(["--model", "tiny", "--profile-json", str(path), "--devices", "1",
                        "--rollout-batch", "2", "--group-size", "2", "--response-len", "16",
                        "--max-response-len", "32", "--acceptance", "2", "--drafter",
                        "ngram"]) == 0
  assert profile.name in capsys.readouterr().out


# Invalid inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: sim.model_spec("gpt-9"), "allowed tiny, .*qwen3-8b"),
    (lambda: sim.device_profile("A100"), "allowed H100, H200, B200, GB200"),
    (lambda: sim.parse_devices("32xA100"), "allowed H100"),
    (lambda: sim.parse_devices("0xH100"), "count must be >= 1"),
    (lambda: sim.Speculation.chain("eagle3", 3, acceptance=4.5), r"draft_length \+ 1 = 4"),
    (lambda: sim.Speculation.chain("medusa", 3, acceptance=2.0), "allowed mtp, eagle3"),
    (lambda: sim.Speculation.chain("draft-model", 3, acceptance=2.0), "needs draft_model"),
    (lambda: sim.Workload(-1, 4, 16, sim.Fixed(8)), "prompts=-1 is invalid"),
    (lambda: sim.Workload(2, 4, 16, sim.Fixed(0)), "length=0 is invalid"),
    (lambda: sim.Cluster(sim.device_profile("H100"), -2), "devices=-2 is invalid"),
    (lambda: sim.Cluster(sim.device_profile("H100"), 8, 6, 4), "must be <= devices=8"),
    (lambda: sim.Schedule(policy_lag=0), "policy_lag=0 is invalid"),
    (lambda: sim.simulate_rollout(SMALL, sim.Cluster(unit_profile(), 1),
                                  sim.Workload(1, 1, 4, sim.Fixed(4)), None, "greedy"),
     "allowed plain, fixed, adaptive"),
    (lambda: sim.simulate_rollout(sim.model_spec("qwen3-235b-a22b"),
                                  sim.Cluster(sim.device_profile("H100"), 2),
                                  sim.Workload(1, 1, 4, sim.Fixed(4))), "does not fit"),
])
def test_invalid_inputs_raise_clear_errors(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


# CLI ----------------------------------------------------------------------------------------


def test_cli_prints_the_step_table_and_speedups(capsys):
  assert simulate_main(["--model", "tiny", "--devices", "2xH100", "--rollout-batch", "4",
                        "--group-size", "4", "--prompt-len", "32", "--response-len", "64",
                        "--max-response-len", "256", "--draft-length", "3",
                        "--acceptance", "2.5", "--drafter", "mtp"]) == 0
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("stage (s)"))
  assert header.split()[2:] == ["data", "prepare", "generation", "reward", "log-prob",
                                "training", "sync", "overall"]
  for row in ("plain ", "spec chain3 ", "spec adaptive "):
    assert any(line.startswith(row) for line in out.splitlines()), row
  assert "generation" in out and "x vs plain" in out


def test_cli_async_split_adds_the_sync_baseline(capsys):
  simulate_main(["--model", "tiny", "--devices", "4xH100", "--rollout-devices", "2",
                 "--train-devices", "2", "--async", "--policy-lag", "2", "--rollout-batch", "2",
                 "--group-size", "4", "--response-len", "32", "--max-response-len", "64",
                 "--acceptance-per-depth", "0.9", "0.8", "--drafter", "ngram"])
  out = capsys.readouterr().out
  assert "plain sync, colocated" in out and "vs plain sync colocated" in out


def test_cli_rejects_an_unknown_model_naming_the_allowed_ones(capsys):
  with pytest.raises(SystemExit):
    simulate_main(["--model", "gpt-9", "--acceptance", "2"])
  assert "qwen3-235b-a22b" in capsys.readouterr().err


@pytest.mark.parametrize("length", ["0", "-2"])
def test_cli_refuses_a_draft_length_below_one_instead_of_simulating_the_default(capsys, length):
  with pytest.raises(SystemExit) as exit_info:
    simulate_main(["--model", "tiny", "--devices", "1xH100", "--draft-length", length,
                   "--acceptance", "2"])
  assert exit_info.value.code == 2
  assert f"--draft-length {length} is invalid: must be an int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("sweep", ["draft-length-x-acceptance", "devices-x-model"])
def test_cli_sweep_writes_a_png_heatmap(tmp_path, capsys, sweep):
  out = tmp_path / "sweep.png"
  simulate_main(["--model", "tiny", "--devices", "1xH100", "--rollout-batch", "2",
                 "--group-size", "2", "--response-len", "32", "--max-response-len", "64",
                 "--sweep", sweep, "--draft-lengths", "1,3", "--rates", "0.5,0.9",
                 "--sweep-devices", "1,2", "--sweep-models", "tiny,bench-1b", "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "speedup" in capsys.readouterr().out


# The `specjax` command ------------------------------------------------------------------------


def test_specjax_simulate_command_prints_the_step_table_and_speedups(capsys):
  from specjax.cli import main
  main(["simulate", "--model", "tiny", "--devices", "2xH100", "--rollout-batch", "4",
        "--group-size", "4", "--response-len", "64", "--max-response-len", "256",
        "--draft-length", "3", "--acceptance", "2.5", "--drafter", "ngram"])
  out = capsys.readouterr().out
  assert "devices   2x H100 SXM (spec sheet), colocated" in out
  lines = out.splitlines()
  assert any(line.startswith("stage (s)") for line in lines)
  for row in ("plain ", "spec chain3 ", "spec adaptive "):
    assert any(line.startswith(row) for line in lines), row
  assert "step" in out and "x vs plain" in out


def test_specjax_sim_calibrate_writes_a_profile_that_simulate_reads(tmp_path, capsys):
  from specjax.cli import main
  path = tmp_path / "profile.json"
  main(["sim", "calibrate", "--quick", "--out", str(path)])
  out = capsys.readouterr().out
  assert "GFLOP/s" in out and "GB/s copy" in out and out.strip().endswith(str(path))
  profile = sim.DeviceProfile.from_json(path.read_text())
  assert profile.peak_flops > 1e8 and profile.hbm_bw > 1e8
  main(["simulate", "--model", "tiny", "--profile-json", str(path), "--devices", "1",
        "--rollout-batch", "2", "--group-size", "2", "--response-len", "16",
        "--max-response-len", "32", "--acceptance", "2", "--drafter", "ngram"])
  assert profile.name in capsys.readouterr().out


def test_specjax_help_lists_the_simulator_commands_and_refuses_unknown_ones(capsys):
  from specjax.cli import main
  main(["--help"])
  out = capsys.readouterr().out
  for name in ("train", "train-drafter", "generate", "simulate", "sim"):
    assert any(line.split()[:1] == [name] for line in out.splitlines()), name
  with pytest.raises(SystemExit) as exit_:
    main(["sim", "calibrat"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "unknown command 'calibrat'" in err and "calibrate" in err
  with pytest.raises(SystemExit) as exit_:
    main(["simulat"])
  assert exit_.value.code == 2 and "simulate" in capsys.readouterr().err


# The reference system ----------------------------------------------------------------------


def test_reference_table_is_reproduced_within_15_percent_after_one_fitted_factor():
  r = sim.reproduce_table()
  changed = [f.name for f in dataclasses.fields(r.profile)
             if getattr(r.profile, f.name) != getattr(r.spec_sheet, f.name)]
  assert changed == ["spec_round_overhead_s"]
  assert r.worst_error <= 0.15
  think = r.rows[1]
  assert think.workload.name == "RL-Think"
  assert think.plain.generation == pytest.approx(133.6, rel=1e-3)  # its median is inferred
  # Negative control: with the spec sheet's speculative-round cost (nothing fitted) the
  # speculative generation misses the table by far more than the tolerance.
  zero = r.rows[0]
  unfitted = sim.simulate_rollout(
      sim.model_spec("qwen3-8b"), sim.Cluster(r.spec_sheet, 32), r.setup.workload(zero.median),
      sim.Speculation.chain("eagle3", 3, acceptance=3.32), "fixed").seconds
  assert abs(unfitted / zero.workload.spec_generation - 1) > 0.15


def test_specjax_simulate_reference_prints_the_table_and_the_235b_claim(capsys):
  from specjax.cli import main
  main(["simulate", "--reference"])
  out = capsys.readouterr().out
  assert "fitted (one efficiency factor): spec_round_overhead_s" in out
  for stage in ("generation plain", "generation spec", "overall plain", "overall spec"):
    assert out.count(stage) == 2, stage
  assert "Qwen3-235B-A22B on 2048 GB200" in out
  line = next(line for line in out.splitlines() if "end-to-end speedup" in line)
  assert "~2.5x" in line and float(line.split(":")[1].split("x")[0]) > 1.0
