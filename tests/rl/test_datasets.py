"""The user's own data and rewards: `DatasetTask` (JSONL / JSON / Parquet / rows, chat
templates) and batched Python `RewardFunction`s, checked when the task is built."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import NoBosTokenizer

from specjax.errors import ConfigError, RewardError, TaskError, TokenizerError
from specjax.rl.datasets import DatasetTask, read_rows
from specjax.rl.gsm8k import gsm8k_dataset
from specjax.rl.rewards import (JaxReward, RewardFunction, answer_tag_reward, format_reward,
                                math_answer_reward, score)
from specjax.tokenizer import CharTokenizer, HFTokenizer

TOK = CharTokenizer("abcdefghij +=0123456789")
CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# Llama 3's shape: BOS from the template, a system turn, loop controls, raise_exception.
LLAMA_LIKE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if loop.index0 > 8 %}{% break %}{% endif %}
    {{- '<h>' + message['role'] + '</h>\\n\\n' + message['content'] | trim + '<e>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<h>assistant</h>\\n\\n' }}
{%- endif %}
"""


def _rows(n=40):
  return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(n)]


def exact(prompts, completions, answer):
  return [float(c.strip() == a) for c, a in zip(completions, answer)]


def length_penalty(completions, level, **_):
  return [None if lv == 0 else -0.1 * len(c) for c, lv in zip(completions, level)]


def test_rewards_are_weighted_sums_of_the_functions_that_scored_each_row():
  fns = (RewardFunction(exact), RewardFunction(length_penalty, weight=2.0, name="short"))
  total, means = score(fns, ["p"] * 3, ["4", "5", "666"],
                       {"answer": ["4", "4", "6"], "level": [0, 1, 2]})
  # Row 0: exact 1, penalty None; row 1: 0 + 2 * -0.1; row 2: 0 + 2 * -0.3.
  np.testing.assert_allclose(total, [1.0, -0.2, -0.6], rtol=1e-6)
  assert means["reward_exact"] == pytest.approx(1 / 3)
  assert means["reward_short"] == pytest.approx(-0.2)  # over the two rows it scored


def test_a_row_no_function_scored_is_an_error_naming_it():
  with pytest.raises(RewardError, match="no reward function scored sample 0"):
    score((RewardFunction(length_penalty),), ["p"], ["x"], {"level": [0]})


@pytest.mark.parametrize("returned, message", [
    ([1.0], "returned 1 values for 2 completions"),
    ([1.0, "x"], "returned 'x' for sample 1"),
    ([1.0, float("nan")], "rewards must be finite"),
    (3.0, "allowed a list"),
    ({0: 5.0, 1: 6.0}, "allowed a list"),  # iterable, but its keys are not rewards
    ({5.0, 6.0}, "allowed a list"),  # unordered
    ("12", "allowed a list"),
    (["1", 0.5], "returned '1' for sample 0"),  # text is not a reward
])
def test_a_reward_returning_the_wrong_thing_is_named(returned, message):
  fn = RewardFunction(lambda prompts, completions: returned, name="bad")
  with pytest.raises(RewardError, match=f"'bad'.*{message}"):
    fn(["p", "q"], ["a", "b"], {})


def test_a_reward_that_raises_is_named_with_the_cause():
  def broken(prompts, completions):
    raise KeyError("oops")
  with pytest.raises(RewardError, match="'broken' raised KeyError"):
    RewardFunction(broken)(["p"], ["a"], {})


def test_a_reward_missing_a_column_fails_when_the_task_is_built():
  def needs_solution(prompts, completions, solution):
    return [0.0] * len(prompts)
  with pytest.raises(ConfigError, match=r"'needs_solution' needs column\(s\) solution.*"
                                        r"its columns: answer, level"):
    DatasetTask(_rows(), TOK, [needs_solution])


def test_a_reward_without_completions_or_prompts_parameters_is_refused():
  with pytest.raises(ConfigError, match="'no_completions' takes no completions argument"):
    DatasetTask(_rows(), TOK, [RewardFunction(lambda prompts, answer: [0.0],
                                              name="no_completions")])
  with pytest.raises(ConfigError, match="name='<lambda>' is invalid: must be an identifier"):
    RewardFunction(lambda prompts, completions: [0.0])


def test_two_rewards_of_one_name_are_refused():
  with pytest.raises(ConfigError, match="named exact appear more than once"):
    DatasetTask(_rows(), TOK, [exact, exact])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_file_format_reads_the_same_rows(tmp_path, suffix):
  rows = _rows()
  path = tmp_path / f"data{suffix}"
  if suffix == ".jsonl":
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  elif suffix == ".json":
    path.write_text(json.dumps(rows))
  else:
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
  assert read_rows(path) == rows
  task = DatasetTask(str(path), TOK, [exact])
  in_memory = DatasetTask(rows, TOK, [exact])
  for split in ("train", "test"):
    assert [e.prompt for e in task.examples(split)] == [e.prompt for e in
                                                       in_memory.examples(split)]
  assert task.examples("test") and task.examples("train")
  assert task.columns == ("answer", "level")


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "1+1="}\nnot json\n', "line 2 is not JSON"),
    ('[1, 2]\n', "line 1 is a JSON list"),
    ("", "holds no rows"),
    ('{"prompt": "1+1="}\n{"prompt": "2+2=", "answer": "4", "answer": "zzz"}\n',
     "line 2 names the key 'answer' twice"),
    (b'{"prompt": "\xff"}\n', "not UTF-8 text"),
])
def test_malformed_files_are_located(tmp_path, content, message):
  path = tmp_path / "data.jsonl"
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  with pytest.raises(TaskError, match=message):
    DatasetTask(str(path), TOK, [exact])


def test_a_prompt_the_hf_tokenizer_cannot_encode_is_located(tmp_path):
  """tokenizers raises a bare Exception for text a WordLevel vocabulary without [UNK] lacks:
  the task names the row and the text, as for a character tokenizer's unknown character."""
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import models, pre_tokenizers
  raw = RawTokenizer(models.WordLevel({"1+1=": 0, "</s>": 1}, unk_token=None))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  raw.save(str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer.from_dir(tmp_path)
  rows = [{"prompt": "1+1=", "answer": "2"}] * 4 + [{"prompt": "2+2=", "answer": "4"}]
  with pytest.raises(TaskError, match=r"row 4.*cannot encode its prompt \(text='2\+2=' "
                                      r"cannot be encoded"):
    DatasetTask(rows, tok, [exact], test_source=rows[:1])


def test_a_row_without_the_prompt_column_is_named():
  rows = _rows()
  rows[5] = {"question": "1+1=", "answer": "2", "level": 0}
  with pytest.raises(TaskError, match="row 5 has columns"):
    DatasetTask(rows, TOK, [exact])
  with pytest.raises(TaskError, match="no prompt column 'question'"):
    DatasetTask(_rows(), TOK, [exact], prompt_column="question")


def test_a_dataset_without_held_out_prompts_says_how_to_get_some():
  with pytest.raises(ConfigError, match="no test prompts"):
    DatasetTask(_rows(2), TOK, [exact], test_fraction=0.01)
  task = DatasetTask(_rows(4), TOK, [exact], test_source=_rows(2))
  assert len(task.examples("train")) == 4 and len(task.examples("test")) == 2


class CountingTokenizer(CharTokenizer):
  """Counts `encode` calls per text; its BOS is 3 (added to plain-text prompts)."""

  def __init__(self, alphabet):
    super().__init__(alphabet)
    self.calls = {}

  @property
  def bos_id(self):
    return 3

  def encode(self, text):
    self.calls[text] = self.calls.get(text, 0) + 1
    return super().encode(text)


def test_each_prompt_is_tokenized_once_from_the_check_to_the_prompt_records(tmp_path):
  from specjax.rl.data import prepare_prompts
  tok = CountingTokenizer("abcdefghij +=0123456789")
  task = DatasetTask(_rows(), tok, [exact])
  records = prepare_prompts(task, tmp_path / "data")
  assert sum(len(records[s]) for s in ("train", "test")) == 40
  assert set(tok.calls) == {f"{i}+{i}=" for i in range(40)}
  assert set(tok.calls.values()) == {1}
  plain = CharTokenizer("abcdefghij +=0123456789")
  for split in ("train", "test"):  # the ids read back are the prompt's, BOS first
    examples = task.examples(split)
    for record in records[split]:
      text = examples[int(record["index"])].prompt
      assert list(record["prompt"]) == [3] + plain.encode(text), text


def test_prompt_records_of_a_chat_task_are_its_templates_ids(tmp_path):
  """A chat template writes its own special tokens: the records add no BOS the template
  left out (ChatML has none), as the run's own prompts do (`DatasetTask.encode_prompt`)."""
  from specjax.rl.data import prepare_prompts
  (tmp_path / "tok").mkdir()
  tok = _chat_dir(tmp_path / "tok", CHATML)
  assert tok.bos_id is not None
  rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}
          for i in range(30)]
  task = DatasetTask(rows, tok, [exact])
  records = prepare_prompts(task, tmp_path / "data")
  for split in ("train", "test"):
    examples = task.examples(split)
    for record in records[split]:
      ids = tok.encode(examples[int(record["index"])].prompt)
      assert ids[0] != tok.bos_id and list(record["prompt"]) == ids


def _chat_dir(tmp_path, template):
  tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz<>|_/\n =+0123456789")
  tok.save(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template":
                                                                      template}))
  return HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE], ids=["chatml", "llama"])
def test_chat_templates_render_as_transformers_renders_them(tmp_path, template):
  from transformers import AutoTokenizer
  tok = _chat_dir(tmp_path, template)
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1= "}]
  reference = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert tok.render_chat(messages) == reference
  assert tok.render_chat(messages, add_generation_prompt=False) == AutoTokenizer \
      .from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)


# Qwen3's shape: an option of the template's own (`enable_thinking`), which transformers passes
# through `apply_chat_template(**kwargs)`.
THINKING = CHATML + ("{%- if add_generation_prompt and enable_thinking is defined and "
                     "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}")


def test_chat_template_options_render_as_transformers_passes_them(tmp_path):
  from transformers import AutoTokenizer
  tok = _chat_dir(tmp_path, THINKING)
  reference = AutoTokenizer.from_pretrained(tmp_path)
  messages = [{"role": "user", "content": "1+1="}]
  for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
    assert tok.render_chat(messages, **variables) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **variables)
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
  plain = DatasetTask(rows, tok, [exact], chat_template=True)
  quiet = DatasetTask(rows, tok, [exact], chat_template=True,
                      chat_variables={"enable_thinking": False})
  assert not plain.examples("train")[0].prompt.endswith("</think>\n\n")
  assert quiet.examples("train")[0].prompt.endswith("<think>\n\n</think>\n\n")
  for bad in ({"messages": []}, {"enable thinking": False}, ["enable_thinking"]):
    with pytest.raises(ConfigError, match="task.chat_variables=.* is invalid"):
      DatasetTask(rows, tok, [exact], chat_template=True, chat_variables=bad)


def test_chat_prompts_are_rendered_and_keep_the_templates_special_tokens(tmp_path):
  tok = _chat_dir(tmp_path, LLAMA_LIKE)
  rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}
          for i in range(30)]
  task = DatasetTask(rows, tok, [exact], test_fraction=0.3)
  example = task.examples("train")[0]
  assert example.prompt.startswith("<s><h>user</h>") and example.prompt.endswith(
      "<h>assistant</h>\n\n")
  ids = task.encode_prompt(example.prompt)
  assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's BOS, not a second
  text_task = DatasetTask(_rows(), tok, [exact], chat_template=True)
  assert text_task.examples("train")[0].prompt.startswith("<s><h>user</h>")


def test_a_template_that_does_not_render_a_prompt_fails_when_the_task_is_built(tmp_path):
  tok = _chat_dir(tmp_path, LLAMA_LIKE)
  rows = [{"prompt": [{"role": "tool", "content": "x"}], "answer": "1"}] * 3
  with pytest.raises(TokenizerError, match="does not render.*unknown role tool"):
    DatasetTask(rows, tok, [exact], test_fraction=0.5)
  with pytest.raises(TokenizerError, match="not a valid Jinja template"):
    _chat_dir(tmp_path, "{% for m in messages %}").render_chat([])


def test_chat_prompts_need_a_chat_template():
  rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 3
  with pytest.raises(TaskError, match="CharTokenizer has none"):
    DatasetTask(rows, TOK, [exact], test_fraction=0.5)
  with pytest.raises(TaskError, match="chat_template=False"):
    DatasetTask(rows, TOK, [exact], test_fraction=0.5, chat_template=False)
  bad = [{"prompt": [{"content": "no role"}], "answer": "2"}] * 3
  with pytest.raises(TaskError, match="'role'"):
    DatasetTask(bad, TOK, [exact], test_fraction=0.5)


def test_rewards_see_the_datasets_prompts_and_columns():
  seen = {}

  def spy(prompts, completions, **columns):
    seen.update(prompts=prompts, columns=columns)
    return [1.0] * len(prompts)

  task = DatasetTask(_rows(), TOK, [spy])
  examples = task.examples("train")[:2]
  total, means = task.score(examples, ["x", "y"])
  assert seen["prompts"] == [e.columns["prompt"] for e in examples]
  assert seen["columns"] == {"answer": [e.columns["answer"] for e in examples],
                             "level": [e.columns["level"] for e in examples]}
  assert total.tolist() == [1.0, 1.0] and means == {"reward_spy": 1.0}


def _ends_early(tokens, lengths, answers):
  return (lengths <= 2).astype(jnp.float32)


def test_a_task_whose_rewards_are_all_jax_is_rewarded_in_jax():
  task = DatasetTask(_rows(), TOK, [JaxReward(_ends_early, weight=0.5)], answer_column="level")
  assert task.reward_in_jax
  assert not DatasetTask(_rows(), TOK, [JaxReward(_ends_early), exact]).reward_in_jax
  assert [e.answer for e in task.examples("train")[:3]] == [
      r["level"] for r in _rows() if r["prompt"] in
      {e.prompt for e in task.examples("train")[:3]}]
  total, parts = jax.jit(task.reward)(jnp.zeros((3, 4), jnp.int32), jnp.array([1, 2, 3]),
                                      jnp.zeros(3))
  np.testing.assert_allclose(total, [0.5, 0.5, 0.0])
  np.testing.assert_allclose(parts["_ends_early"], [1.0, 1.0, 0.0])


def test_python_and_jax_rewards_score_together_on_the_host():
  task = DatasetTask(_rows(), TOK, [JaxReward(_ends_early, weight=2.0), exact],
                     answer_column="level")
  examples = task.examples("train")[:2]
  tokens = np.zeros((2, 4), np.int32)
  total, means = task.score(examples, [examples[0].columns["answer"], "x"], tokens,
                            np.array([1, 4], np.int32))
  np.testing.assert_allclose(total, [2.0 + 1.0, 0.0])
  assert means == {"reward__ends_early": 0.5, "reward_exact": 0.5}


def test_a_jax_reward_is_checked_on_the_steps_own_batch():
  """One that returns [B] values only for the 3 rows `check_traceable` tries passes the task's
  check; the step's batch of 4 rows is refused as it traces, not gathered out of range."""
  task = DatasetTask(_rows(), TOK, [JaxReward(lambda tokens, lengths, answers: jnp.zeros(3),
                                              name="three")], answer_column="level")
  with pytest.raises(ConfigError, match=r"'three' returns shape \(3,\) float32 for 4 rows"):
    jax.jit(task.reward)(jnp.zeros((4, 4), jnp.int32), jnp.ones(4, jnp.int32), jnp.zeros(4))


@pytest.mark.parametrize("values, message", [
    ([1.0, np.nan], r"'_ends_early' returned nan for sample 1.*must be finite"),
    ([1.0, 2.0, 3.0], r"'_ends_early' returned shape \(3,\) for 2 completions"),
    ([1e39, 0.0], r"total reward of sample 0 is 2e\+39.*beyond float32"),
])
def test_jax_values_scored_on_the_host_are_checked(values, message):
  """Beside a Python reward, a JAX reward's NaN is an error (a JAX reward scores every row;
  only a Python reward's None means unscored), and so is a total float32 cannot hold."""
  task = DatasetTask(_rows(), TOK, [JaxReward(_ends_early, weight=2.0), exact],
                     answer_column="level")
  with pytest.raises(RewardError, match=message):
    score(task.rewards, ["p", "q"], ["a", "b"], {"answer": ["a", "x"]},
          {"_ends_early": np.array(values)})


@pytest.mark.parametrize("fn, message", [
    (lambda tokens, lengths, answers: float(tokens[0, 0]), "does not trace"),
    (lambda tokens, lengths, answers: tokens, r"returns .*\(3, 5\)"),
    (lambda tokens, lengths, answers: jnp.zeros(2), r"returns shape \(2,\) float32 for 3 rows"),
])
def test_a_jax_reward_that_cannot_work_fails_when_the_task_is_built(fn, message):
  with pytest.raises(ConfigError, match=f"JAX reward 'bad' {message}"):
    DatasetTask(_rows(), TOK, [JaxReward(fn, name="bad")])


def test_a_non_numeric_answer_column_is_named():
  with pytest.raises(TaskError, match="answer column 'answer' holds '0'"):
    DatasetTask(_rows(), TOK, [exact], answer_column="answer")


def test_math_answer_reward_judges_values_not_spellings():
  reward = math_answer_reward()
  completions = ["so it is 1/2", "\\boxed{0.5}", "I get 3", "she makes $18 every day. #### 18"]
  values = reward(["p"] * 4, completions, {"answer": ["0.5", "\\frac{1}{2}", "4", "18"]})
  assert values.tolist() == [1.0, 1.0, 0.0, 1.0]
  rows = [{"prompt": f"{i}+{i}=", "solution": str(2 * i)} for i in range(30)]
  with pytest.raises(ConfigError, match=r"'math_answer' needs column\(s\) answer"):
    DatasetTask(rows, TOK, [reward])
  assert DatasetTask(rows, TOK, [math_answer_reward("solution")]).columns == ("solution",)


def test_math_answer_reward_runs_off_the_main_thread_and_over_workers():
  """math-verify's own timeout is a SIGALRM, which threads cannot set: in async mode's
  background scoring and in thread workers the reward runs without it, and in worker processes
  (their main thread) with it."""
  import threading

  from specjax.rl.reward_workers import RewardPool, RewardWorkers
  reward = math_answer_reward(timeout_s=2)
  completions, answers = ["so it is 1/2", "I get 3"], {"answer": ["0.5", "4"]}
  out = []
  thread = threading.Thread(target=lambda: out.append(reward(["p"] * 2, completions, answers)))
  thread.start()
  thread.join()
  assert out[0].tolist() == [1.0, 0.0]
  for kind in ("thread", "process"):
    with RewardPool(RewardWorkers(workers=2, kind=kind)) as pool:
      assert reward(["p"] * 2, completions, answers, pool).tolist() == [1.0, 0.0]
  for bad in (0, 1.5, "5"):
    with pytest.raises(ConfigError, match=rf"timeout_s={bad!r} is invalid"):
      math_answer_reward(timeout_s=bad)


def test_gsm8k_is_a_dataset_task_with_the_math_answer_reward(tmp_path):
  lines = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
           for i in range(40)]
  path = tmp_path / "gsm8k.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  tok = CharTokenizer("abcdefghijklmnopqrstuvwxyzAQW ?:\n0123456789")
  task = gsm8k_dataset(path, tok, test_fraction=0.25)
  examples = task.examples("test")[:2]
  assert examples[0].prompt.startswith("Question: What is") and examples[0].prompt.endswith(
      "Answer:")
  assert examples[0].reference == examples[0].columns["answer"]  # what the warm start learns
  total, means = task.score(examples, [f" the sum is {examples[0].reference}", " 999"])
  assert total.tolist() == [1.0, 0.0] and means == {"reward_math_answer": 0.5}


@pytest.mark.parametrize("change, error, message", [
    (dict(source=[]), TaskError, "holds no rows"),
    (dict(source=5), TaskError, "source=5 is invalid: allowed a .jsonl"),
    (dict(source={"prompt": "x"}), TaskError, "source=.* is invalid"),
    (dict(source="data.csv"), TaskError, "unknown dataset format '.csv'"),
    (dict(test_fraction="a lot"), ConfigError, "test_fraction='a lot' is invalid"),
    (dict(prompt_column=3), ConfigError, "prompt_column=3 is invalid"),
    (dict(answer_column=["a"]), ConfigError, "answer_column=\\['a'\\] is invalid"),
    (dict(success_reward=float("nan")), ConfigError, "success_reward=nan is invalid"),
])
def test_a_task_that_cannot_work_is_named_when_built(change, error, message):
  with pytest.raises(error, match=message):
    DatasetTask(**({"source": _rows(), "tokenizer": TOK, "rewards": [exact]} | change))


def test_a_prompt_that_encodes_to_no_tokens_is_named_when_the_task_is_built():
  rows = [{"prompt": ""}] + [{"prompt": f"{i}+{i}="} for i in range(20)]
  with pytest.raises(TaskError, match=r"row \d+: its prompt '' encodes to no tokens"):
    DatasetTask(rows, NoBosTokenizer(), [RewardFunction(lambda prompts, completions: [0.0] * len(
        completions), name="zero")], test_fraction=0.5)


@pytest.mark.parametrize("column", ["prompts", "completions"])
def test_a_column_named_as_a_rewards_own_argument_is_refused(column):
  rows = [dict(r, **{column: "x"}) for r in _rows()]
  with pytest.raises(ConfigError, match=f"column\\(s\\) {column} take the name of an argument"):
    DatasetTask(rows, TOK, [exact])


@pytest.mark.parametrize("missing", [None, float("nan")])  # NaN: a pandas row's empty cell
def test_a_null_reference_is_refused_not_learned_as_text(missing):
  rows = [dict(r, ref=missing) for r in _rows()]
  with pytest.raises(TaskError, match=f"reference column 'ref' holds {missing}; allowed a "
                                      "string"):
    DatasetTask(rows, TOK, [exact], reference_column="ref")


@pytest.mark.parametrize("answer, ok", [
    (np.int64(4), True), (np.float32(0.5), True), (10**40, False), (10**400, False),
    (3_000_000_000, False), (float("inf"), False), ("4", False), (True, False)])
def test_answers_are_finite_float32_numbers_numpy_ones_included(answer, ok):
  rows = [dict(r, level=answer) for r in _rows()]
  if ok:
    task = DatasetTask(rows, TOK, [exact], answer_column="level")
    assert task.examples("train")[0].answer == answer
  else:
    with pytest.raises(TaskError, match="allowed a finite number within float32's range, an "
                                        "integer within int32's"):
      DatasetTask(rows, TOK, [exact], answer_column="level")


def test_a_numpy_weight_is_a_number():
  assert RewardFunction(exact, weight=np.float32(0.5)).weight == 0.5


def test_format_and_answer_tag_rewards_score_the_recipe_layout():
  r1 = "<think>2 and 2\nmake 4</think> <answer> 4 </answer>"
  completions = [r1, "<answer>5</answer>", "4", "<answer>3</answer> or <answer>4</answer>"]
  layout = format_reward(r"<think>.*</think>\s*<answer>.*</answer>", full=True)
  assert layout.fn(["q"] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
  assert format_reward(r"<answer>").fn(["q"] * 4, completions) == [1.0, 1.0, 0.0, 1.0]
  tag = answer_tag_reward("answer")
  assert tag.name == "answer_tag"
  # The last tag counts; no tag scores 0; whitespace inside the tag does not matter.
  assert tag.fn(["q"] * 4, completions, answer=["4"] * 4) == [1.0, 0.0, 0.0, 1.0]
  rows = [{"prompt": f"{i}+1=", "sum": str(i + 1)} for i in range(10)]
  with pytest.raises(ConfigError, match=r"reward function 'answer_tag' needs column\(s\) answer"):
    DatasetTask(rows, TOK, [tag], test_fraction=0.5)  # the rows lack its column
  with pytest.raises(ConfigError, match=r"pattern='\(' is not a valid regular expression"):
    format_reward("(")
  with pytest.raises(ConfigError, match=r"tag='a b' is invalid"):
    answer_tag_reward(tag="a b")
