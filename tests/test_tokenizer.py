"""Tokenizers: the character-level tokenizer, and HF tokenizers checked against transformers."""

import json

import pytest
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from specjax.errors import ConfigError
from specjax.tokenizer import (CharTokenizer, HFTokenizer, Tokenizer, TokenizerError,
                               check_vocab_fits)

TEXTS = ["hello world", "the quick brown fox", "héllo wörld, ünïcode ✓", "", "  spaces  "]
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_end|>"]


def test_char_tokenizer_round_trips_text_and_reserves_special_ids():
  tok = CharTokenizer("0123456789+= ")
  assert isinstance(tok, Tokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 16)
  ids = tok.encode("12+3= 15")
  assert ids == [4, 5, 13, 6, 14, 15, 4, 8]
  assert min(ids) >= 3  # text never produces a special id
  assert tok.decode(ids) == "12+3= 15"


def test_char_tokenizer_decode_drops_specials_and_ids_past_its_vocabulary():
  tok = CharTokenizer("ab")
  assert tok.decode([tok.bos_id, 3, 4, tok.eos_id, tok.pad_id, tok.pad_id]) == "ab"
  assert tok.decode([3, 5, 4, 1000]) == "ab"  # a padded model vocabulary's ids: no text
  with pytest.raises(TokenizerError, match=r"id -1 is out of range: allowed 0\.\.4"):
    tok.decode([3, -1])


def test_char_tokenizer_rejects_out_of_alphabet_char_naming_it():
  tok = CharTokenizer("abc")
  with pytest.raises(TokenizerError, match=r"character 'x' at position 2 of 'abxc'.*'abc'"):
    tok.encode("abxc")


@pytest.mark.parametrize("alphabet", ["", "abca"])
def test_char_tokenizer_rejects_empty_or_repeated_alphabet(alphabet):
  with pytest.raises(TokenizerError, match="alphabet"):
    CharTokenizer(alphabet)


def _train_tokenizer() -> RawTokenizer:
  tok = RawTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 5, trainer)
  return tok


@pytest.fixture(scope="module")
def raw_tokenizer():
  return _train_tokenizer()


@pytest.fixture
def model_dir(tmp_path, raw_tokenizer):
  raw_tokenizer.save(str(tmp_path / "tokenizer.json"))
  return tmp_path


def _write(path, name, content) -> None:
  (path / name).write_text(json.dumps(content))


def test_hf_tokenizer_encode_decode_match_transformers(model_dir):
  _write(model_dir, "tokenizer_config.json",
         {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
  ours = HFTokenizer.from_dir(model_dir)
  ref = transformers.AutoTokenizer.from_pretrained(model_dir)
  assert isinstance(ours, Tokenizer)
  assert ours.vocab_size == len(ref)
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
  assert ours.decode([ours.eos_id] + ours.encode("hello")) == "hello"


def test_hf_tokenizer_special_ids_from_tokenizer_config_match_transformers(model_dir):
  _write(model_dir, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
      "pad_token": "<pad>", "bos_token": None})
  # generation_config's extra stop ids join eos_ids after the tokenizer's own EOS.
  _write(model_dir, "generation_config.json", {"eos_token_id": [2, 3], "bos_token_id": 1})
  ours = HFTokenizer.from_dir(model_dir)
  ref = transformers.AutoTokenizer.from_pretrained(model_dir)
  assert ours.eos_id == ref.eos_token_id == 3
  assert ours.pad_id == ref.pad_token_id == 0
  assert ours.bos_id is None and ref.bos_token_id is None  # explicit null: no BOS
  assert ours.eos_ids == (3, 2)


def test_hf_tokenizer_eos_from_generation_config_without_tokenizer_config(model_dir):
  _write(model_dir, "generation_config.json",
         {"eos_token_id": [3, 2], "pad_token_id": 2, "bos_token_id": 1})
  tok = HFTokenizer.from_dir(model_dir)
  assert (tok.eos_id, tok.eos_ids, tok.pad_id, tok.chat_bos_id) == (3, (3, 2), 2, 1)
  assert tok.bos_id is None  # a BOS no post-processor adds: prompts start without it


def test_hf_tokenizer_from_file_guesses_documented_specials(model_dir):
  tok = HFTokenizer.from_file(model_dir / "tokenizer.json")
  assert (tok.eos_id, tok.chat_bos_id, tok.pad_id) == (2, 1, 0)  # "</s>", "<s>", "<pad>"
  assert tok.bos_id is None  # what prompts start with: the post-processor adds none
  explicit = HFTokenizer.from_file(model_dir / "tokenizer.json", eos_token="<|im_end|>")
  assert explicit.eos_id == 3


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_guessed_eos_is_said_and_the_chat_templates_turn_end_also_ends_a_response(model_dir):
  """No EOS named anywhere: "</s>" is guessed; the template ends each turn with <|im_end|>,
  which then also ends a response (the stated rule), and both are said."""
  _write(model_dir, "tokenizer_config.json", {"chat_template": CHATML.replace(
      "<|im_start|>", "<s>")})
  tok = HFTokenizer.from_dir(model_dir)
  assert tok.eos_id == 2 and tok.eos_ids == (2, 3)
  assert any(g.startswith("EOS guessed: '</s>' (id 2)") for g in tok.guesses), tok.guesses
  assert any("turn end added to eos_ids: the chat template ends an assistant turn with "
             "'<|im_end|>' (id 3)" in g for g in tok.guesses), tok.guesses
  # Named as the EOS already: nothing is added and nothing guessed.
  _write(model_dir, "tokenizer_config.json", {"chat_template": CHATML.replace(
      "<|im_start|>", "<s>"), "eos_token": "<|im_end|>", "pad_token": "<pad>"})
  named = HFTokenizer.from_dir(model_dir)
  assert named.eos_ids == (3,) and named.guesses == ()


def test_hf_tokenizer_pad_falls_back_to_eos(tmp_path):
  tok = RawTokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}, unk_token=None))
  tok.save(str(tmp_path / "tokenizer.json"))
  loaded = HFTokenizer.from_dir(tmp_path)
  assert (loaded.eos_id, loaded.pad_id, loaded.bos_id) == (2, 2, None)


def test_hf_tokenizer_without_any_eos_raises_naming_candidates(tmp_path):
  tok = RawTokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token=None))
  tok.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(TokenizerError, match=r"no EOS token.*</s>.*pass eos_token"):
    HFTokenizer.from_dir(tmp_path)


def test_hf_tokenizer_unknown_special_token_raises_naming_it(model_dir):
  _write(model_dir, "tokenizer_config.json", {"eos_token": "<|not_there|>"})
  with pytest.raises(TokenizerError, match=r"tokenizer_config.eos_token='<\|not_there\|>'"):
    HFTokenizer.from_dir(model_dir)


def test_hf_tokenizer_missing_tokenizer_json_raises(tmp_path):
  with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
    HFTokenizer.from_dir(tmp_path)


def test_check_vocab_fits_allows_a_padded_model_vocab_and_refuses_a_smaller_one():
  tok = CharTokenizer("abcde")  # 8 ids
  check_vocab_fits(tok, 8)
  check_vocab_fits(tok, 64)  # checkpoints pad V; the extra ids are never produced
  with pytest.raises(ConfigError, match=r"tokenizer vocab 8 > model vocab_size 7 \(ids 7\.\.7 "
                                        r"have no embedding\)"):
    check_vocab_fits(tok, 7)


def _bpe_dir(path, raw_tokenizer, bos, post_processor: bool):
  """A model directory of the module's BPE tokenizer, with tokenizer_config.json naming `bos`
  (None: Qwen's null) and, with `post_processor`, Llama 3's TemplateProcessing that puts it
  first."""
  from tokenizers import processors
  raw = RawTokenizer.from_str(raw_tokenizer.to_str())  # the module fixture stays unchanged
  if post_processor:
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))])
  raw.save(str(path / "tokenizer.json"))
  _write(path, "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                         "eos_token": "</s>", "bos_token": bos})
  return path


@pytest.mark.parametrize("kind", ["char_save", "llama3_style", "qwen_style", "gpt2_style",
                                  "bos_is_eos"])
def test_prompts_encode_as_transformers_autotokenizer_encodes_them(tmp_path, raw_tokenizer,
                                                                   kind):
  """What a user of a model directory gets from `AutoTokenizer(text)` is what specjax's
  prompts hold (`encode_prompt`): BOS first where the model has one (a saved
  `CharTokenizer`, whose prompts were trained with it; Llama 3's post-processor), none for
  Qwen's null bos_token, nor for a tokenizer that names a BOS its post-processor does not add
  (GPT-2 style; its chat template still renders that BOS); the EOS where the post-processor
  puts the EOS in front (one token for both)."""
  from specjax.rl import encode_prompt
  if kind == "char_save":
    own = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.0123456789+=")
    own.save(tmp_path)
    texts = ["1+2=", "hello world", "", "a"]
  else:
    bos = {"qwen_style": None, "bos_is_eos": "</s>"}.get(kind, "<s>")
    _bpe_dir(tmp_path, raw_tokenizer, bos, post_processor=kind in ("llama3_style", "bos_is_eos"))
    own, texts = None, TEXTS
  ours = HFTokenizer.from_dir(tmp_path)
  ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for text in texts:
    want = ref(text)["input_ids"]
    assert encode_prompt(ours, text) == want, text
    if own is not None:  # the run's own tokenizer, whose ids the model was trained on
      assert encode_prompt(own, text) == want, text
  assert (ours.bos_id is None) == (kind in ("qwen_style", "gpt2_style"))
  if kind == "gpt2_style":
    assert ours.chat_bos_id == ref.bos_token_id is not None
  if kind == "bos_is_eos":
    assert ours.bos_id == ours.eos_id == ref.eos_token_id


@pytest.mark.parametrize("write, note", [
    (lambda d: _write(d, "tokenizer_config.json", {"chat_template": ""}),
     r"tokenizer_config\.json's chat_template is empty"),
    (lambda d: (d / "chat_template.jinja").write_text(" \n"), r"chat_template\.jinja is empty"),
    (lambda d: _write(d, "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "{{ messages[0].content }}"}]}),
     r"lists named templates \['tool_use'\] and none is 'default'"),
])
def test_an_empty_or_undefaulted_chat_template_is_refused_when_rendering_naming_why(
    model_dir, write, note):
  """An empty template would render every prompt as '' (transformers refuses it), and named
  templates without a "default" leave none to render with: either is no template, and the
  error says which."""
  write(model_dir)
  tok = HFTokenizer.from_dir(model_dir)
  assert tok.chat_template is None
  with pytest.raises(TokenizerError, match=rf"has no chat template \(.*{note}"):
    tok.render_chat([{"role": "user", "content": "hi"}])


def test_a_chat_template_file_that_is_not_utf8_is_refused_naming_it(model_dir):
  (model_dir / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
  with pytest.raises(TokenizerError, match=r"chat_template\.jinja: not UTF-8 text"):
    HFTokenizer.from_dir(model_dir)


def test_text_the_tokenizer_cannot_encode_raises_a_tokenizer_error_naming_it(tmp_path):
  """A WordLevel vocabulary without [UNK]: tokenizers raises a bare Exception."""
  RawTokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token=None)).save(
      str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer.from_dir(tmp_path)
  assert tok.encode("a") == [0]
  with pytest.raises(TokenizerError, match=r"text='zz' cannot be encoded by .*Missing \[UNK\]"):
    tok.encode("zz")
