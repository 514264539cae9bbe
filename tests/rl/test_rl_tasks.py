"""Tasks, rewards and prompt datasets: the JAX arithmetic reward against Python string
checks, GSM8K answer extraction, clear errors for bad data and bad reward functions, and the
TFDS / ArrayRecord round trip (local files only, no TensorFlow)."""

import json
import random
import re
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from specjax.models import ConfigError
from specjax.rl import (ARITHMETIC_ALPHABET, WORKED_ALPHABET, ArithmeticPrompts, ArithmeticTask, CustomTask,
                        Example, GSM8KTask, PromptReader, PythonReward, RewardError, Task,
                        TaskError, answers_match, decode_completions, encode_prompt, extract_answer,
                        parse_number, prepare_prompts, read_gsm8k_jsonl)
from specjax.tokenizer import CharTokenizer

TOK = CharTokenizer(ARITHMETIC_ALPHABET)


# ---------------------------------------------------------------------------------------------
# Arithmetic task


def test_arithmetic_examples_are_deterministic_disjoint_and_correct():
  task = ArithmeticTask(max_digits=2, num_operands=3, operators="+-*", num_train=300,
                        num_test=40, seed=3)
  assert isinstance(task, Task) and task.reward_in_jax
  again = ArithmeticTask(max_digits=2, num_operands=3, operators="+-*", num_train=300,
                         num_test=40, seed=3)
  assert task.examples("train") == again.examples("train")
  assert task.examples("train") != ArithmeticTask(max_digits=2, num_operands=3,
                                                  operators="+-*", num_train=300, num_test=40,
                                                  seed=4).examples("train")
  train, test = task.examples("train"), task.examples("test")
  assert (len(train), len(test)) == (300, 40)
  assert not {e.prompt for e in train} & {e.prompt for e in test}
  for e in train + test:
    assert re.fullmatch(r"\d{1,2}([-+*]\d{1,2}){2}=", e.prompt), e.prompt
    # Python's own evaluation (with * binding tighter) is the independent reference.
    assert e.answer == eval(e.prompt[:-1]) and e.reference == str(e.answer)  # noqa: S307
  assert {op for e in train for op in e.prompt if op in "+-*"} == {"+", "-", "*"}


def test_arithmetic_task_rejects_settings_that_cannot_work():
  with pytest.raises(ConfigError, match=r"max_digits=5 is invalid: .*9999800001.*int32"):
    ArithmeticTask(max_digits=5, operators="*")
  with pytest.raises(ConfigError, match=r"operators='/' is invalid: must be a non-empty subset"):
    ArithmeticTask(operators="/")
  with pytest.raises(ConfigError, match=r"num_operands=1 is invalid: must be an int >= 2"):
    ArithmeticTask(num_operands=1)
  with pytest.raises(ValueError, match=r"split='valid' is invalid"):
    ArithmeticTask(num_train=5, num_test=5).examples("valid")


def _python_reward(ids, length, answer, format_reward):
  """Reference: the response is the text before the first EOS; right iff it equals str(answer)."""
  ids = list(ids[:length])
  if TOK.eos_id not in ids:
    return 0.0
  body = ids[:ids.index(TOK.eos_id)]
  text = "".join(ARITHMETIC_ALPHABET[i - 3] if i >= 3 else "?" for i in body)
  if not re.fullmatch(r"-?[0-9]+", text):
    return 0.0
  return 1.0 if text == str(answer) else format_reward


def _random_response(rng: random.Random, answer: int, n: int) -> tuple[list[int], int]:
  kind = rng.randrange(8)
  if kind == 0:    # correct
    text = str(answer)
  elif kind == 1:  # off by a little
    text = str(answer + rng.choice([-10, -1, 1, 7]))
  elif kind == 2:  # leading zeros / negative zero
    text = rng.choice(["0", "00", "-0"]) + str(abs(answer)) * rng.randrange(2)
  elif kind == 3:  # too long for int32, possibly congruent to the answer mod 2**32
    text = str(answer + rng.choice([2**32, 10**10, 10**11]))
  elif kind == 4:  # garbage from the alphabet
    text = "".join(rng.choice(ARITHMETIC_ALPHABET) for _ in range(rng.randrange(0, 6)))
  elif kind == 5:  # correct then junk
    text = str(answer) + rng.choice(["+", "=", "1-"])
  elif kind == 6:  # sign games
    text = rng.choice(["-", "--", "+"]) + str(abs(answer))
  else:            # empty
    text = ""
  ids = TOK.encode(text)
  if rng.random() < 0.8:
    ids.append(TOK.eos_id)
  if rng.random() < 0.1:  # a special id in the middle
    ids.insert(rng.randrange(len(ids) + 1), rng.choice([TOK.pad_id, TOK.bos_id]))
  ids = ids[:n]
  length = len(ids) if rng.random() < 0.9 else rng.randrange(len(ids) + 1)
  ids += [rng.randrange(TOK.vocab_size) if rng.random() < 0.5 else TOK.pad_id
          for _ in range(n - len(ids))]
  return ids, length


def test_jax_arithmetic_reward_equals_python_string_check_on_random_responses():
  rng = random.Random(0)
  task = ArithmeticTask(max_digits=3, num_operands=2, operators="+-*", num_train=1000,
                        num_test=10, format_reward=0.1)
  n, rows = 14, 3000
  answers = [rng.choice(task.examples("train")).answer for _ in range(rows)]
  responses = [_random_response(rng, a, n) for a in answers]
  tokens = np.array([r[0] for r in responses], np.int32)
  lengths = np.array([r[1] for r in responses], np.int32)
  got = np.asarray(jax.jit(task.reward)(tokens, lengths, np.array(answers, np.int32)))
  want = np.array([_python_reward(t, l, a, 0.1) for t, l, a in zip(tokens, lengths, answers)])
  np.testing.assert_array_equal(got, want.astype(np.float32))
  # Negative control: every reward level occurs, so agreement is not trivial.
  assert {0.0, 0.1, 1.0} <= set(want.tolist())
  assert (want == 1.0).mean() > 0.05 and (want == 0.1).mean() > 0.05


def test_arithmetic_reward_hand_cases():
  eos = [TOK.eos_id]
  rows = [TOK.encode("19") + eos, TOK.encode("019") + eos, TOK.encode("-7") + eos,
          TOK.encode("19"), TOK.encode("18") + eos, TOK.encode("-0") + eos,
          TOK.encode("0") + eos, TOK.encode("1000000019") + eos,
          TOK.encode("4294967315") + eos]
  # The last two are 10 digits: 1000000019 has 19 as its last nine digits, 4294967315 is
  # 19 + 2**32 (equal to 19 in wrapping int32); both are wrong, not overflowed into right.
  answers = [19, 19, -7, 19, 19, 0, 0, 19, 19]
  n = max(map(len, rows))
  tokens = np.array([r + [0] * (n - len(r)) for r in rows])
  lengths = np.array([len(r) for r in rows])
  got = ArithmeticTask(format_reward=0.25).reward(tokens, lengths, np.array(answers))
  np.testing.assert_array_equal(got, [1.0, 0.25, 1.0, 0.0, 0.25, 0.25, 1.0, 0.25, 0.25])


def _python_worked_reward(ids, length, answer, steps, format_reward):
  """Reference: the text before the first EOS must be "<steps '='> ... ;<answer>"."""
  ids = list(ids[:length])
  if TOK.eos_id not in ids:
    return 0.0
  text = "".join(WORKED_ALPHABET[i - 3] if i >= 3 else "?" for i in ids[:ids.index(TOK.eos_id)])
  if ";" not in text:
    return 0.0
  work, _, final = text.rpartition(";")
  if work.count("=") != steps or not re.fullmatch(r"-?[0-9]+", final):
    return 0.0
  return 1.0 if final == str(answer) else format_reward


def test_worked_solutions_and_their_reward():
  task = ArithmeticTask(max_digits=1, num_operands=4, operators="+-", num_train=300,
                        num_test=20, worked=True, format_reward=0.1)
  tok = task.tokenizer
  assert tok.vocab_size == len(WORKED_ALPHABET) + 3
  assert tok.encode("0-=") == TOK.encode("0-=")  # the shared ids do not move
  for e in task.examples("train") + task.examples("test"):
    steps, answer = e.reference.split(";")
    assert int(answer) == e.answer and len(steps.split(",")) == 3
    total = e.prompt[0]
    for step in steps.split(","):  # each step continues from the previous total
      assert step.startswith(total) and eval(step.split("=")[0]) == int(step.split("=")[1])
      total = step.split("=")[1]
    assert len(e.reference) + 1 <= task.max_answer_tokens
  rng = random.Random(1)
  rows, answers = [], []
  for e in rng.choices(task.examples("train"), k=2000):
    steps, answer = e.reference.split(";")
    text = rng.choice([
        e.reference, f"{steps};{e.answer + rng.choice([-1, 2])}", f";{e.answer}",
        steps.rsplit(",", 1)[0] + f";{e.answer}", steps, f"{steps};0{abs(e.answer)}",
        f"{steps};-{abs(e.answer)}", f"{steps};{e.answer};{e.answer}", e.reference + "="])
    ids = tok.encode(text) + ([tok.eos_id] if rng.random() < 0.85 else [])
    rows.append(ids)
    answers.append(e.answer)
  n = max(map(len, rows))
  tokens = np.array([r + [tok.pad_id] * (n - len(r)) for r in rows], np.int32)
  lengths = np.array([len(r) for r in rows], np.int32)
  got = np.asarray(jax.jit(task.reward)(tokens, lengths, np.array(answers, np.int32)))
  want = np.array([_python_worked_reward(t, l, a, 3, 0.1)
                   for t, l, a in zip(tokens, lengths, answers)], np.float32)
  np.testing.assert_array_equal(got, want)
  assert {0.0, np.float32(0.1), 1.0} <= set(want.tolist())  # every level: not trivial
  with pytest.raises(ConfigError, match="worked=True only"):
    ArithmeticTask(operators="+*", worked=True)


def test_long_tail_problems_spread_over_ten_times_and_the_reward_reads_each_rows_steps():
  task = ArithmeticTask(max_digits=1, num_operands=2, max_operands=14, operand_decay=0.7,
                        operators="+-", num_train=3000, num_test=100, worked=True,
                        format_reward=0.1)
  examples = task.examples("train")
  steps = np.array([e.reference.count("=") for e in examples])
  lengths = np.array([len(e.reference) + 1 for e in examples])
  # Operand counts follow operand_decay: each one more is 0.7 times as frequent.
  share = np.bincount(steps + 1, minlength=15)[2:] / len(examples)
  want = np.array(list(task.operand_probabilities.values()))
  assert np.abs(share - want).max() < 0.03, (share, want)
  # Reasoning-RL-like lengths: a 10x spread between the median and the longest, a tail.
  assert np.max(lengths) >= 5 * np.median(lengths) and np.max(lengths) >= 10 * np.min(lengths)
  assert np.max(lengths) <= task.max_answer_tokens
  for e, n in zip(examples, steps):  # the key carries the answer and the step count
    assert e.answer == ArithmeticTask.answer_key(int(e.reference.split(";")[1]), int(n))
  tok, rng = task.tokenizer, random.Random(2)
  rows, keys, want_rewards = [], [], []
  for e in rng.choices(examples, k=600):
    work, answer = e.reference.split(";")
    text, reward = rng.choice([
        (e.reference, 1.0), (f"{work};{int(answer) + 1}", 0.1),
        # one step too few or too many: the row's own count decides, not a fixed one
        (work.split(",", 1)[1] + f";{answer}" if "," in work else f";{answer}", 0.0),
        (f"{work},{answer}+0={answer};{answer}", 0.0)])
    rows.append(tok.encode(text) + [tok.eos_id])
    keys.append(e.answer)
    want_rewards.append(reward)
  n = max(map(len, rows))
  tokens = np.array([r + [tok.pad_id] * (n - len(r)) for r in rows], np.int32)
  got = jax.jit(task.reward)(tokens, np.array([len(r) for r in rows], np.int32),
                             np.array(keys, np.int32))
  np.testing.assert_array_equal(np.asarray(got), np.array(want_rewards, np.float32))
  with pytest.raises(ConfigError, match="max_operands=1 is invalid"):
    ArithmeticTask(num_operands=2, max_operands=1)
  with pytest.raises(ConfigError, match="operand_decay=0 is invalid"):
    ArithmeticTask(max_operands=4, operand_decay=0)
  with pytest.raises(ConfigError, match="max_operands=40 is invalid: must be at most 32"):
    ArithmeticTask(max_digits=1, max_operands=40, worked=True)


# ---------------------------------------------------------------------------------------------
# GSM8K


@pytest.mark.parametrize("text,value", [
    ("#### 1,234", 1234.0),
    ("The answer is $1,234.50.", 1234.5),
    ("#### -3", -3.0),
    ("It costs $-5 now", -5.0),
    ("He owes -$5", -5.0),
    ("x = \u22127", -7.0),
    ("#### 18.", 18.0),
    ("#### .75", 0.75),
    ("a 10% rise", 10.0),
    ("nothing here", None),
    # Read whole, not by a prefix ("#### 3/4" once read as 3, "#### 1e3" as 1).
    ("#### 3/4", 0.75),
    ("It is 3/4.", 0.75),
    ("#### -1/2", -0.5),
    ("#### 1e3", 1000.0),
    ("2.5e-1 of it", 0.25),
    ("on 12/25/2020", 12.0),
])
def test_parse_number_handles_commas_dollars_signs_decimals_exponents_fractions(text, value):
  assert parse_number(text) == value


@pytest.mark.parametrize("text,value", [
    ("5 apples and 7 pears make 12.", 12.0),
    ("Pages 3-4 then 10-3", 3.0),           # hyphens between numbers are not signs
    ("so 5 + 7 #### 12 because 12 > 3", 12.0),  # after the last ####, the first number
    ("#### 1 #### 2", 2.0),
    ("values 1,2,3", 3.0),                 # not thousands grouping
    ("total: $1,000,000.", 1_000_000.0),
    ("it is -2.5", -2.5),
    ("no digits", None),
])
def test_extract_answer_takes_last_number_or_the_one_after_hashes(text, value):
  assert extract_answer(text) == value


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return path


GOOD = [json.dumps({"question": "Tom has 3 apples and buys 2,000 more. How many?",
                    "answer": "3 + 2000 = 2003\n#### 2,003"}),
        "",
        json.dumps({"question": "Half of 1?", "answer": "#### 0.5"}),
        json.dumps({"question": "Debt?", "answer": "#### -$40."})]


def test_read_gsm8k_jsonl_parses_answers_and_skips_blank_lines(tmp_path):
  rows = read_gsm8k_jsonl(_write(tmp_path / "a.jsonl", GOOD))
  assert [v for _, v in rows] == [2003.0, 0.5, -40.0]


@pytest.mark.parametrize("bad,message", [
    ('{"question": "q", "answer": "#### 1"', r"not valid JSON"),
    ('["q", "a"]', r"expected a JSON object"),
    ('{"question": "q", "answer": "#### 1", "answer": "#### 2"}',
     r"names the key 'answer' twice"),
    ('{"question": "q"}', r"field 'answer' is missing or not a string"),
    ('{"question": 3, "answer": "#### 1"}', r"field 'question' is missing or not a string"),
    ('{"question": "q", "answer": "it is 4"}', r"'answer' has no '#### <number>'"),
    ('{"question": "q", "answer": "#### four"}', r"no number after '####'"),
])
def test_malformed_jsonl_line_raises_naming_file_and_line(tmp_path, bad, message):
  path = _write(tmp_path / "bad.jsonl", GOOD[:2] + [bad] + GOOD[2:])
  with pytest.raises(TaskError, match=re.escape(f"{path}:3: ") + message):
    GSM8KTask(path, CharTokenizer("ab")).examples("train")


def test_gsm8k_reward_and_splits(tmp_path):
  tok = CharTokenizer("".join(sorted(set("".join(GOOD) + "QuestionAnswer:\n?"))))
  train = _write(tmp_path / "train.jsonl", GOOD)
  task = GSM8KTask(train, tok, test_file=_write(tmp_path / "test.jsonl", GOOD[2:]),
                   format_reward=0.1)
  assert [e.reference for e in task.examples("train")] == ["2003", "0.5", "-40"]
  assert task.examples("test")[0].prompt == "Question: Half of 1?\nAnswer:"
  got = task.reward(["so #### 2,003", "It is 2003.", "I think 2002", "no idea", "-40 dollars"],
                    ["2003", "2003", "2003", "2003", "-40"])
  np.testing.assert_array_equal(got, np.float32([1.0, 1.0, 0.1, 0.0, 1.0]))
  # Without a test file a hashed share of the questions is held out, disjoint from train.
  held = GSM8KTask(train, tok, test_fraction=0.5, seed=1)
  prompts = [{e.prompt for e in held.examples(s)} for s in ("train", "test")]
  assert not prompts[0] & prompts[1] and len(prompts[0]) + len(prompts[1]) == 3


# ---------------------------------------------------------------------------------------------
# Python reward functions


def test_reward_function_that_raises_names_task_and_sample():
  def fn(completion, reference):
    return 1.0 / int(completion)

  reward = PythonReward(fn, "my_task")
  np.testing.assert_allclose(reward(["2", "4"], ["", ""]), [0.5, 0.25])
  with pytest.raises(RewardError, match=r"task 'my_task' on sample 1 \(completion='0', "
                     r"reference='r1'\) raised ZeroDivisionError"):
    reward(["2", "0"], ["r0", "r1"])


@pytest.mark.parametrize("value,message", [(float("nan"), "must be finite"),
                                           (float("inf"), "must be finite"),
                                           ("high", "not a real number"),
                                           (None, "not a real number")])
def test_reward_function_returning_non_finite_or_non_number_is_an_error(value, message):
  task = CustomTask("custom", TOK, [Example("1+1=", "2")], [Example("2+2=", "4")],
                    lambda c, r: value)
  assert not task.reward_in_jax and isinstance(task, Task)
  with pytest.raises(RewardError, match=f"task 'custom' on sample 0 .*{message}"):
    task.reward(["2"], ["2"])


def test_decode_completions_cuts_rows_at_their_lengths():
  tokens = np.array([TOK.encode("12") + [TOK.eos_id, 5], TOK.encode("3-4") + [9]])
  assert decode_completions(TOK, tokens, np.array([3, 2])) == ["12", "3-"]


# ---------------------------------------------------------------------------------------------
# TFDS / ArrayRecord datasets and the reader


def test_tfds_array_record_round_trip_without_tensorflow(tmp_path):
  task = ArithmeticTask(num_train=40, num_test=8, seed=5)
  sources = prepare_prompts(task, tmp_path)
  assert "tensorflow" not in sys.modules  # tensorflow_datasets is, TensorFlow itself is not
  files = sorted(p.name for p in tmp_path.rglob("*.array_record*"))
  assert files == ["arithmetic_prompts-test.array_record-00000-of-00001",
                   "arithmetic_prompts-train.array_record-00000-of-00001"]
  for split in ("train", "test"):
    examples = task.examples(split)
    assert len(sources[split]) == len(examples)
    for record in sources[split]:
      e = examples[record["index"]]
      assert record["prompt"].tolist() == encode_prompt(TOK, e.prompt)
      assert record["answer"] == e.answer and record["reference"].decode() == e.reference

  # Preparing again reuses the files; a different task writes a different dataset.
  mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.array_record*")}
  prepare_prompts(task, tmp_path)
  assert mtimes == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.array_record*")}
  prepare_prompts(ArithmeticTask(num_train=40, num_test=8, seed=6), tmp_path)
  assert len(list(tmp_path.rglob("*train.array_record*"))) == 2


def test_a_damaged_prompt_file_is_refused_naming_the_directory_to_delete(tmp_path):
  task = ArithmeticTask(num_train=3000, num_test=8, seed=5)
  prepare_prompts(task, tmp_path)
  file = next(tmp_path.rglob("*train.array_record*"))
  data = file.read_bytes()
  file.write_bytes(data[:len(data) // 2])  # truncated: refused when the split is opened
  with pytest.raises(TaskError, match=r"1\.0\.0: the 'train' prompt file is unreadable "
                                      r"\(.*\)\. It is a cache derived from task 'arithmetic': "
                                      r"delete .*1\.0\.0 and rerun"):
    prepare_prompts(task, tmp_path)
  middle = len(data) // 2  # a damaged chunk mid-file: refused when its records are read
  file.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 256])
                   + data[middle + 256:])
  reader = PromptReader(prepare_prompts(task, tmp_path)["train"], 8, pad_id=TOK.pad_id)
  with pytest.raises(TaskError, match=r"prompt records \[\d+, .*\]\.\.\. are unreadable "
                                      r"\(.*\); delete .*1\.0\.0 and rerun"):
    reader.padded_len


def test_gsm8k_builder_round_trip_keeps_float_answers_and_references(tmp_path):
  tok = CharTokenizer("".join(sorted(set("".join(GOOD) + "QuestionAnswer:\n?"))))
  task = GSM8KTask(_write(tmp_path / "train.jsonl", GOOD), tok,
                   test_file=_write(tmp_path / "test.jsonl", GOOD[2:]))
  sources = prepare_prompts(task, tmp_path / "data")
  reader = PromptReader(sources["train"], 3, pad_id=tok.pad_id, shuffle=False)
  batch = reader.batch_at(0)
  records = {int(i): sources["train"][int(i)] for i in batch.index}
  order = [int(records[int(i)]["index"]) for i in batch.index]
  assert sorted(order) == [0, 1, 2]
  np.testing.assert_allclose(batch.answers, [[2003.0, 0.5, -40.0][k] for k in order])
  assert reader.references(batch.index) == [["2003", "0.5", "-40"][k] for k in order]
  assert [tok.decode(t[:n]) for t, n in zip(batch.tokens, batch.lengths)] == [
      task.examples("train")[k].prompt for k in order]


def test_arithmetic_builder_rejects_other_tasks(tmp_path):
  with pytest.raises(TypeError, match="needs an ArithmeticTask"):
    ArithmeticPrompts(task=CustomTask("c", TOK, [], [], lambda c, r: 0.0), data_dir=tmp_path)


@pytest.fixture(scope="module")
def arithmetic_source(tmp_path_factory):
  task = ArithmeticTask(num_train=30, num_test=5, seed=2)
  return task, prepare_prompts(task, tmp_path_factory.mktemp("arith"))["train"]


def test_reader_batches_are_padded_prompts_with_answers(arithmetic_source):
  task, source = arithmetic_source
  reader = PromptReader(source, 8, pad_id=TOK.pad_id, seed=0)
  batch = reader.batch_at(0)
  assert batch.tokens.shape == (8, reader.padded_len) and batch.tokens.dtype == np.int32
  assert reader.padded_len == max(len(encode_prompt(TOK, e.prompt))
                                  for e in task.examples("train"))
  for row, n, answer, i in zip(batch.tokens, batch.lengths, batch.answers, batch.index):
    e = task.examples("train")[int(source[int(i)]["index"])]
    assert row[:n].tolist() == encode_prompt(TOK, e.prompt)
    assert (row[n:] == TOK.pad_id).all() and answer == e.answer
  assert batch.answers.dtype == np.int32
  with pytest.raises(ValueError, match=r"prompt of \d+ tokens, more than prompt_len=3"):
    PromptReader(source, 8, prompt_len=3).batch_at(0)


def test_reader_is_deterministic_resumable_and_covers_each_epoch(arithmetic_source):
  _, source = arithmetic_source
  n = len(source)
  reader = PromptReader(source, 7, seed=11)
  # An uninterrupted stream of 12 batches (84 positions, crossing two epoch boundaries) ...
  stream, position = [], 0
  for _ in range(12):
    stream.append(reader.batch_at(position))
    position = reader.next_position(position)
  # ... equals a fresh reader resumed from the checkpointed position 35.
  resumed = PromptReader(source, 7, seed=11)
  for k in range(5, 12):
    np.testing.assert_array_equal(resumed.batch_at(7 * k).tokens, stream[k].tokens)
  # Each epoch visits every record exactly once, in a different order.
  order = np.concatenate([b.index for b in stream])
  assert sorted(order[:n]) == list(range(n)) and sorted(order[n:2 * n]) == list(range(n))
  assert (order[:n] != order[n:2 * n]).any()
  # Another seed shuffles differently (negative control); no shuffle is file order.
  assert (PromptReader(source, 7, seed=12).batch_at(0).index != stream[0].index).any()
  np.testing.assert_array_equal(PromptReader(source, 7, shuffle=False).batch_at(28).index,
                                [28, 29, 0, 1, 2, 3, 4])


def test_reader_process_slices_tile_the_global_batch(arithmetic_source):
  _, source = arithmetic_source
  whole = PromptReader(source, 8, seed=4).batch_at(16)
  parts = [PromptReader(source, 8, seed=4, process_index=i, process_count=4).batch_at(16)
           for i in range(4)]
  np.testing.assert_array_equal(np.concatenate([p.index for p in parts]), whole.index)
  with pytest.raises(ValueError, match=r"process_count=3 is invalid: must be an int >= 1 "
                     r"dividing batch_size=8"):
    PromptReader(source, 8, process_count=3)


def test_encode_prompt_adds_bos_once_even_when_the_text_spells_it():
  tok = SimpleNamespace(bos_id=1, encode=lambda text: ([1] if text.startswith("<s>") else [])
                        + [5, 6])
  assert encode_prompt(tok, "hi") == [1, 5, 6]
  assert encode_prompt(tok, "<s>hi") == [1, 5, 6]
  assert encode_prompt(SimpleNamespace(bos_id=None, encode=lambda text: [5]), "x") == [5]


def test_an_overflowing_number_matches_no_reference():
  assert not answers_match(parse_number("9" * 400), 3.0)
  assert not answers_match(3.0, float("inf"))
  assert answers_match(0.1 + 0.2, 0.3)
