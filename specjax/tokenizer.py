"""Tokenizers: the small interface the rest of specjax needs, a built-in character-level one
for the built-in tasks, and a wrapper of a Hugging Face `tokenizer.json`.

`encode` never adds special tokens; a caller that wants a BOS prepends `bos_id` when it is not
None. `decode` drops special tokens (PAD, BOS, EOS, and the HF tokenizer's other specials).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import tokenizers

from specjax.checks import is_int
from specjax.errors import ConfigError, TokenizerError
from specjax.files import read_object, write_text_atomic
from specjax.hub import local_checkpoint


def with_bos(ids: list[int], bos_id: int | None) -> list[int]:
  """`ids` led by `bos_id` (when there is one): prepended unless already first, as when the
  prompt text spells the BOS token itself (chat-formatted prompts often do)."""
  if bos_id is None or ids[:1] == [bos_id]:
    return list(ids)
  return [bos_id] + list(ids)


def _check_text(text: Any) -> None:
  if not isinstance(text, str):
    raise TokenizerError(f"text={text!r} is invalid: encode takes a str, got "
                         f"{type(text).__name__}")


def _checked_ids(ids: Sequence[int], vocab_size: int, *, beyond: bool = False) -> list[int]:
  """`ids` as Python ints, each an id of a `vocab_size`-token vocabulary (`beyond`: or any
  larger id). A float id is refused rather than truncated, a negative one rather than
  wrapped or left to the tokenizers library's bare OverflowError."""
  out = []
  for n, i in enumerate(ids):
    try:
      i = operator.index(i)
    except TypeError:
      raise TokenizerError(f"ids[{n}]={i!r} is invalid: allowed an int token id in "
                           f"0..{vocab_size - 1}") from None
    if i < 0 or (i >= vocab_size and not beyond):
      raise TokenizerError(f"id {i} is out of range: allowed 0..{vocab_size - 1} (ids[{n}])")
    out.append(i)
  return out


@runtime_checkable
class Tokenizer(Protocol):
  """What the models, tasks and samplers need of a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (the model's V may be larger)."""
    ...

  @property
  def eos_id(self) -> int:
    """The id that ends a sequence."""
    ...

  @property
  def pad_id(self) -> int:
    """The id written into padding (always masked out)."""
    ...

  @property
  def bos_id(self) -> int | None:
    """The id a sequence starts with, or None when the model uses none (e.g. Qwen)."""
    ...

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without special tokens."""
    ...

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, dropping special tokens."""
    ...


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """One id per character of a fixed alphabet, after three special ids.

  Ids: 0 PAD, 1 BOS, 2 EOS, then `3 + i` for `alphabet[i]`.

  Attributes:
    alphabet: the characters, each once, e.g. "0123456789+=".
  """

  alphabet: str

  PAD = 0
  BOS = 1
  EOS = 2
  NUM_SPECIAL = 3

  def __post_init__(self):
    if not isinstance(self.alphabet, str) or not self.alphabet:
      raise TokenizerError(f"alphabet={self.alphabet!r} is invalid: must be a non-empty str")
    repeated = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
    if repeated:
      raise TokenizerError(f"alphabet={self.alphabet!r} is invalid: characters {repeated} "
                           "appear more than once")

  @functools.cached_property
  def _ids(self) -> dict[str, int]:
    return {c: self.NUM_SPECIAL + i for i, c in enumerate(self.alphabet)}

  @property
  def vocab_size(self) -> int:
    return self.NUM_SPECIAL + len(self.alphabet)

  @property
  def eos_id(self) -> int:
    return self.EOS

  @property
  def pad_id(self) -> int:
    return self.PAD

  @property
  def bos_id(self) -> int:
    return self.BOS

  def encode(self, text: str) -> list[int]:
    _check_text(text)
    ids = self._ids
    try:
      return [ids[c] for c in text]
    except KeyError:
      pos = next(i for i, c in enumerate(text) if c not in ids)
      raise TokenizerError(f"character {text[pos]!r} at position {pos} of {text!r} is not in "
                           f"the alphabet {self.alphabet!r}") from None

  SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # the spellings of PAD, BOS, EOS in a save

  def save(self, directory: str | os.PathLike) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` to `directory` (which must exist):
    a character-level tokenizer that `HFTokenizer.from_dir` and transformers'
    `AutoTokenizer` load with the same ids, specials and decoding as this one, and whose
    prompts both start with BOS, as specjax's (`encode_prompt`) do."""
    vocab = {t: i for i, t in enumerate(self.SPECIAL_TOKENS)} | dict(self._ids)
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("[\\s\\S]"),
                                                        behavior="isolated")
    raw.decoder = tokenizers.decoders.Fuse()  # characters, not words: joined without spaces
    raw.add_special_tokens(list(self.SPECIAL_TOKENS))
    # transformers adds what tokenizer.json's post-processor adds (its add_bos_token is
    # ignored when there is a tokenizer.json), so the BOS a specjax prompt starts with is
    # written there, as Llama 3's tokenizer.json writes <|begin_of_text|>.
    bos = self.SPECIAL_TOKENS[self.BOS]
    raw.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, self.BOS)])
    directory = Path(directory)
    write_text_atomic(directory / "tokenizer.json", raw.to_str())
    pad, bos, eos = self.SPECIAL_TOKENS
    write_text_atomic(directory / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad, "bos_token": bos,
        "eos_token": eos, "add_bos_token": True, "clean_up_tokenization_spaces": False},
        indent=2) + "\n")

  def decode(self, ids: Sequence[int]) -> str:
    # Ids past the alphabet decode to nothing, as `HFTokenizer.decode`'s do: a model's
    # vocabulary may be larger than its tokenizer's, and a sampled id may land there.
    return "".join(self.alphabet[i - self.NUM_SPECIAL]
                   for i in _checked_ids(ids, self.vocab_size, beyond=True)
                   if self.NUM_SPECIAL <= i < self.vocab_size)


# Fallback special tokens, tried in order when neither tokenizer_config.json nor
# generation_config.json names one: the spellings of SentencePiece Llama/Mistral ("</s>"),
# GPT-2/Qwen ("<|endoftext|>"), Llama 3 ("<|end_of_text|>") and Gemma ("<eos>").
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")


def _token_content(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value


def _read_json(file: Path) -> dict[str, Any]:
  """The JSON object in `file` ({} when there is no such file); a `TokenizerError` naming the
  file and the position when it is not one."""
  if not file.is_file():
    return {}
  return read_object(file, TokenizerError, "re-download it or save the tokenizer again")


def _config_ids(file: Path, field: str, value: Any) -> list[int]:
  """Token ids as `file` (generation_config.json) writes `field`: an int, or for
  `eos_token_id` also a list of them; a bool, float or string is refused, not converted."""
  many = field == "eos_token_id" and isinstance(value, list)
  ids = value if many else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise TokenizerError(f"{file}: {field}={value!r} is invalid: allowed a token id (an int)"
                         + (" or a list of them" if field == "eos_token_id" else ""))
  return ids


@dataclasses.dataclass(frozen=True, eq=False)
class HFTokenizer:
  """A Hugging Face fast tokenizer (`tokenizer.json`) with resolved special ids.

  Build it with `from_dir` (a model directory) or `from_file` (a lone `tokenizer.json`).

  Attributes:
    tokenizer: the `tokenizers.Tokenizer`.
    eos_id: the id that ends a sequence.
    pad_id: the padding id (the EOS id when the tokenizer defines no pad token).
    bos_id: the id a prompt starts with, or None: the BOS that `tokenizer.json`'s
      post-processor adds, as transformers' tokenizer adds it (a GPT-2-style tokenizer names
      a BOS token and adds none), unless `bos_token` is passed to `from_dir` / `from_file`.
    eos_ids: every id that ends a sequence, `eos_id` first (chat models stop on several, e.g.
      generation_config.json's `eos_token_id` list).
    chat_template: the Jinja chat template of the model directory (`tokenizer_config.json`'s
      `chat_template`, or `chat_template.jinja`), rendered by `render_chat`; None: none.
    source: the directory or file it was loaded from (what a run's config records of it).
    chat_template_note: why `chat_template` is None although the directory names one (an
      empty template, named templates without a "default"): `render_chat`'s error says it.
    chat_bos_id: the BOS token the directory names (`tokenizer_config.json`'s `bos_token`,
      ...), which a chat template renders as `bos_token`; None: `bos_id`.
    guesses: what was inferred rather than read from the files, one sentence each (an EOS
      or pad id guessed from the vocabulary, a chat template's turn end added to `eos_ids`):
      a run logs them once.
  """

  tokenizer: tokenizers.Tokenizer = dataclasses.field(repr=False, metadata={"record": False})
  eos_id: int
  pad_id: int
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = dataclasses.field(default=None, repr=False,
                                                metadata={"record": False})
  source: str | None = None
  chat_template_note: str | None = dataclasses.field(default=None, repr=False,
                                                     metadata={"record": False})
  chat_bos_id: int | None = dataclasses.field(default=None, repr=False,
                                              metadata={"record": False})
  guesses: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False,
                                               metadata={"record": False})

  def __post_init__(self):
    if not self.eos_ids:
      object.__setattr__(self, "eos_ids", (self.eos_id,))
    if self.eos_ids[0] != self.eos_id:
      raise TokenizerError(f"eos_ids={self.eos_ids} is invalid: must start with eos_id="
                           f"{self.eos_id}")
    named = {"eos_id": self.eos_id, "pad_id": self.pad_id, "bos_id": self.bos_id}
    named |= {f"eos_ids[{i}]": v for i, v in enumerate(self.eos_ids)}
    for field, value in named.items():
      if value is not None and not 0 <= value < self.vocab_size:
        raise TokenizerError(f"{field}={value} is invalid: allowed 0..{self.vocab_size - 1}")

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    _check_text(text)
    try:
      return self.tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as err:  # tokenizers raises a bare Exception (a WordLevel without [UNK])
      raise TokenizerError(f"text={_preview(text)} cannot be encoded by "
                           f"{self.source or 'this tokenizer'}: {err}") from None

  def decode(self, ids: Sequence[int]) -> str:
    # Ids past the tokenizer's vocabulary decode to nothing, as in transformers: a model's
    # vocabulary is often padded beyond its tokenizer's, and a sampled id may land there.
    return self.tokenizer.decode(_checked_ids(ids, self.vocab_size, beyond=True),
                                 skip_special_tokens=True)

  def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True, **variables: Any) -> str:
    """`messages` (`[{"role": ..., "content": ...}, ...]`) as the text the model was trained on
    for them: `chat_template` rendered as Hugging Face renders it (Jinja2 in a sandbox, with
    `bos_token`, `eos_token`, `raise_exception` and `strftime_now`), ending, with
    `add_generation_prompt`, with the header of the assistant's turn. `variables` are the
    template's own options, as `apply_chat_template(**kwargs)` passes them (Qwen3's
    `enable_thinking=False`).

    Raises:
      TokenizerError: no chat template, or it does not render these messages (its own
        `raise_exception`, a syntax error, a missing field).
    """
    if self.chat_template is None:
      raise TokenizerError(f"{self.source or 'this tokenizer'} has no chat template "
                           f"({self.chat_template_note or _NO_TEMPLATE}); give prompts as "
                           "text, or use a model directory that has one")
    template = _compiled_template(self.chat_template, self.source)
    special = lambda i: None if i is None else self.tokenizer.id_to_token(i)
    try:
      return template.render(**variables, messages=list(messages),
                             add_generation_prompt=add_generation_prompt,
                             bos_token=special(self.chat_bos_id if self.chat_bos_id is not None
                                               else self.bos_id) or "",
                             eos_token=special(self.eos_id), pad_token=special(self.pad_id))
    except Exception as err:  # jinja2's errors, and whatever the template's filters raise
      raise TokenizerError(f"the chat template of {self.source or 'this tokenizer'} does not "
                           f"render {_preview(messages)}: {type(err).__name__}: {err}") from None

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, eos_token: str | None = None,
                pad_token: str | None = None, bos_token: str | None = None) -> HFTokenizer:
    """Load a lone `tokenizer.json`; special tokens not given are guessed.

    Guessing takes the first of `EOS_CANDIDATES` / `BOS_CANDIDATES` / `PAD_CANDIDATES` that
    is in the vocabulary; no EOS is an error, no BOS means None, no pad means the EOS id.
    Without `bos_token`, prompts start with the BOS the post-processor adds (`bos_id`).
    """
    return cls._build(Path(path), {}, {}, eos_token, pad_token, bos_token)

  @classmethod
  def from_dir(cls, path: str | os.PathLike, *, eos_token: str | None = None,
               pad_token: str | None = None, bos_token: str | None = None) -> HFTokenizer:
    """Load `tokenizer.json` of an HF model directory (or Hugging Face Hub id: `specjax.hub`).

    Each special token comes from, in order: the argument; `tokenizer_config.json`
    (`eos_token`, `pad_token`, `bos_token`; an explicit null BOS means none);
    `generation_config.json` (`eos_token_id` — its whole list goes to `eos_ids` —,
    `pad_token_id`, `bos_token_id`); the guesses of `from_file`. The BOS found so is what a
    chat template renders (`chat_bos_id`); without `bos_token`, a prompt starts with the BOS
    `tokenizer.json`'s post-processor adds (`bos_id`), as in transformers.
    """
    path = local_checkpoint(path, "path")
    tok_config = _read_json(path / "tokenizer_config.json")
    out = cls._build(path / "tokenizer.json", tok_config,
                     _read_json(path / "generation_config.json"), eos_token, pad_token,
                     bos_token)
    template, note = _chat_template(path, tok_config)
    out = dataclasses.replace(out, chat_template=template, chat_template_note=note,
                              source=str(path))
    return _with_turn_end(out)

  @classmethod
  def _build(cls, file: Path, tok_config: Mapping[str, Any], gen_config: Mapping[str, Any],
             eos_token: str | None, pad_token: str | None,
             bos_token: str | None) -> HFTokenizer:
    if not file.is_file():
      raise TokenizerError(f"{file}: missing; only fast tokenizers (tokenizer.json) are "
                           "supported")
    try:
      tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception that names no file
      raise TokenizerError(f"{file}: not a readable tokenizer.json ({err}); it is corrupt, "
                           "truncated or not a tokenizers file: re-download it or save the "
                           "tokenizer again") from None

    def content(field: str) -> str | None:
      value = _token_content(tok_config.get(field))
      if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{file.parent / 'tokenizer_config.json'}: {field}="
                             f"{tok_config[field]!r} is invalid: allowed a token string or an "
                             "AddedToken object with a string 'content'")
      return value

    def token_id(token: str, source: str) -> int:
      i = tok.token_to_id(token)
      if i is None:
        raise TokenizerError(f"{source}={token!r} is not in the vocabulary of {file}")
      return i

    def guess(candidates: tuple[str, ...]) -> int | None:
      return next((tok.token_to_id(c) for c in candidates if tok.token_to_id(c) is not None),
                  None)

    guesses: list[str] = []
    gen_file = file.parent / "generation_config.json"
    gen_id = lambda field: _config_ids(gen_file, field, gen_config[field])[0]
    gen_eos = gen_config.get("eos_token_id")
    gen_eos = [] if gen_eos is None else _config_ids(gen_file, "eos_token_id", gen_eos)
    if eos_token is not None:
      eos_id = token_id(eos_token, "eos_token")
    elif content("eos_token") is not None:
      eos_id = token_id(content("eos_token"), "tokenizer_config.eos_token")
    elif gen_eos:
      eos_id = gen_eos[0]
    else:
      eos_id = guess(EOS_CANDIDATES)
      if eos_id is None:
        raise TokenizerError(f"{file}: no EOS token: none given, none in tokenizer_config.json "
                             f"or generation_config.json, and none of {EOS_CANDIDATES} in the "
                             "vocabulary; pass eos_token")
      guesses.append(f"EOS guessed: {tok.id_to_token(eos_id)!r} (id {eos_id}), the first of "
                     f"{EOS_CANDIDATES} in the vocabulary (no eos_token given or named in "
                     "tokenizer_config.json / generation_config.json)")

    if bos_token is not None:
      bos_id = token_id(bos_token, "bos_token")
    elif "bos_token" in tok_config:
      bos = content("bos_token")
      bos_id = None if bos is None else token_id(bos, "tokenizer_config.bos_token")
    elif gen_config.get("bos_token_id") is not None:
      bos_id = gen_id("bos_token_id")
    else:
      bos_id = guess(BOS_CANDIDATES)
    chat_bos_id = bos_id
    if bos_token is None:
      # A prompt starts with what transformers puts there: the token tokenizer.json's
      # post-processor adds in front (transformers ignores add_bos_token when there is a
      # tokenizer.json), not any BOS the files name. An appended EOS is not a BOS; a special
      # token in front is, even where it is the EOS too (GPT-2's <|endoftext|> both ways).
      bos_id = _front_special(tok, eos_id)

    if pad_token is not None:
      pad_id = token_id(pad_token, "pad_token")
    elif content("pad_token") is not None:
      pad_id = token_id(content("pad_token"), "tokenizer_config.pad_token")
    elif gen_config.get("pad_token_id") is not None:
      pad_id = gen_id("pad_token_id")
    else:
      # Padding is always masked, so any id works; EOS is the usual choice when none exists.
      pad_id = guess(PAD_CANDIDATES)
      guesses.append(f"pad guessed: {tok.id_to_token(pad_id)!r} (id {pad_id}) from the "
                     "vocabulary" if pad_id is not None else
                     f"pad = the EOS id {eos_id} (no pad token named; padding is masked)")
      pad_id = eos_id if pad_id is None else pad_id

    eos_ids = (eos_id,) + tuple(dict.fromkeys(int(i) for i in gen_eos if i != eos_id))
    return cls(tokenizer=tok, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id, eos_ids=eos_ids,
               source=str(file), chat_bos_id=chat_bos_id, guesses=tuple(guesses))


_TURN_MARK = "SPECJAX_TURN_MARK"


def _with_turn_end(tok: HFTokenizer) -> HFTokenizer:
  """`tok` stopping on its chat template's turn end too. A chat model ends its answer with
  the token its template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`); where the
  files name another EOS (or none, and `<|endoftext|>` was guessed), rollouts would run to
  the token limit. The rule: the special token that follows an assistant message in the
  rendered template joins `eos_ids`, and `guesses` says so. A template that does not render
  a plain exchange is left alone."""
  if tok.chat_template is None:
    return tok
  try:
    text = tok.render_chat([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": _TURN_MARK}],
                           add_generation_prompt=False)
  except TokenizerError:
    return tok
  after = text.partition(_TURN_MARK)[2]
  if not after:
    return tok
  ids = tok.tokenizer.encode(after, add_special_tokens=False).ids
  special = {i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special}
  end = ids[0] if ids and ids[0] in special else None
  if end is None or end in tok.eos_ids:
    return tok
  note = (f"turn end added to eos_ids: the chat template ends an assistant turn with "
          f"{tok.tokenizer.id_to_token(end)!r} (id {end}), which the EOS ids {tok.eos_ids} "
          "lack; responses end on either")
  return dataclasses.replace(tok, eos_ids=tok.eos_ids + (end,), guesses=tok.guesses + (note,))


def _front_special(tok: Any, eos_id: int) -> int | None:
  """The special token `tok`'s post-processor puts in front of a text, or None."""
  try:
    added = tok.encode("a", add_special_tokens=True)
  except Exception:  # a vocabulary without "a" nor an unknown token (tokenizers' Exception)
    ids = tok.encode("", add_special_tokens=True).ids  # front or back: an EOS counts as back
    return ids[0] if ids and ids[0] != eos_id else None
  return added.ids[0] if added.ids and added.special_tokens_mask[0] else None


_NO_TEMPLATE = "tokenizer_config.json's chat_template or chat_template.jinja"


def _chat_template(path: Path, tok_config: Mapping[str, Any]) -> tuple[str | None, str | None]:
  """`(template, note)`: the chat template of model directory `path` — `chat_template.jinja`
  (how transformers saves it since 4.43), else `tokenizer_config.json`'s `chat_template` (a
  string, or a list of named templates of which "default" is the one) —, or None and why
  there is none that can be used. An empty template counts as none: it would render every
  prompt as '' (transformers refuses it too)."""
  file = path / "chat_template.jinja"
  where = str(file)
  if file.is_file():
    try:
      value = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
      raise TokenizerError(f"{file}: not UTF-8 text ({err}); allowed a Jinja template saved "
                           "as UTF-8: re-download it or save the tokenizer again") from None
  else:
    where = f"{path / 'tokenizer_config.json'}'s chat_template"
    value = tok_config.get("chat_template")
    if isinstance(value, list):
      named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
      if "default" not in named:
        return None, (f"{where} lists named templates {sorted(map(str, named))} and none is "
                      "'default', the one a prompt is rendered with")
      value = named["default"]
    if value is not None and not isinstance(value, str):
      raise TokenizerError(f"{path / 'tokenizer_config.json'}: chat_template={value!r:.80} is "
                           "invalid: allowed a Jinja template string, or a list of "
                           "{name, template} with a 'default'")
  if value is not None and not value.strip():
    return None, f"{where} is empty"
  return value, None


def _preview(messages: Any) -> str:
  text = repr(messages)
  return text if len(text) <= 120 else text[:117] + "..."


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str, where: str | None):
  """A chat template compiled as Hugging Face compiles it (sandboxed, blocks trimmed, loop
  controls, a `tojson` that keeps non-ASCII text)."""
  try:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError:
    raise TokenizerError("chat templates need jinja2: pip install 'specjax[hf]'") from None

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def strftime_now(fmt):
    import datetime
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
      x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
  env.globals |= {"raise_exception": raise_exception, "strftime_now": strftime_now}
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateError as err:
    raise TokenizerError(f"the chat template of {where or 'this tokenizer'} is not a valid "
                         f"Jinja template: {err}") from None


def check_vocab_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
  """Raise a `ConfigError` unless every id `tokenizer` can produce is a token of a model with
  `vocab_size` ids.

  Called where a tokenizer and a model are put together, so a mismatched pair fails there,
  naming both sizes, rather than later as out-of-range prompt ids. A model vocabulary larger
  than the tokenizer's is fine and common (checkpoints pad V to a multiple of 64 or 128; the
  padding ids are never produced).
  """
  if not is_int(vocab_size) or vocab_size < 1:
    raise ConfigError(f"vocab_size={vocab_size!r} is invalid: allowed the model's vocabulary "
                      "size, an int >= 1")
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"the tokenizer does not fit the model: tokenizer vocab "
                      f"{tokenizer.vocab_size} > model vocab_size {vocab_size} (ids "
                      f"{vocab_size}..{tokenizer.vocab_size - 1} have no embedding); allowed: "
                      "a tokenizer vocabulary at most the model's, e.g. the tokenizer saved "
                      "with this checkpoint")


def read_table(path: str | os.PathLike) -> tokenizers.Tokenizer:
  """The tokenizer file `path` read alone, to compare with another: not built as an
  `HFTokenizer` (whose special-token settings are the user's to override in `from_dir`)."""
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as err:  # tokenizers raises a bare Exception on a malformed file
    raise ConfigError(f"{path} is not a tokenizer file tokenizers can read ({err})") from None


def different_ids(ours: Tokenizer, path: str | os.PathLike) -> str | None:
  """Why a model trained with the tokenizer file `path` would read `ours`'s ids as other
  text, or None. An `HFTokenizer`'s table must lie within the file's (which may add tokens);
  another kind (a `CharTokenizer`, whose run `specjax export` wrote) must give each of its
  ids' text the same id there, its specials only existing there."""
  table = read_table(path)
  theirs = table.get_vocab(with_added_tokens=True)
  if isinstance(ours, HFTokenizer):
    other = sorted(t for t, i in ours.tokenizer.get_vocab(with_added_tokens=True).items()
                   if theirs.get(t) != i)
    return f"{len(other)} token(s) with another id or none there, e.g. {other[0]!r}" if other \
        else None
  ids = set(theirs.values())
  for i in range(ours.vocab_size):
    text = ours.decode([i])  # specials decode to nothing
    if not (table.encode(text, add_special_tokens=False).ids == [i] if text else i in ids):
      return f"its id {i} ({text!r}) means other text there"
  return None
