"""Tokenizers behind one interface: the model directory's own Hugging Face tokenizer, or the
built-in task's character tokenizer (saved beside the tiny model it goes with).

    tok = load_tokenizer(model_dir)
    tok.encode("12+7=")                   plain text, as the tokenizer encodes it (with its bos, if it adds one)
    tok.encode_chat([{"role": "user", "content": "..."}])    the chat template, with the generation prompt
    tok.encode_chat(messages, tools=[schema, ...])            ... and the tools the model may call, where
                                                              the template renders them (tok.renders_tools)
    tok.encode_followup([{"role": "tool", "content": "42"}])  what follows a model's turn that ended with
                                                              its stop token: the messages, then the generation
                                                              prompt (a multi-turn episode's observation)
    tok.decode(ids)                       the text up to the first stop token, special tokens dropped
    tok.stop_ids                          generation ends at any of these
    tok.pad_id                            fills prompts and responses; never a stop token

Every role loads the tokenizer from the same directory, so they all agree on every id.
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Iterable, Protocol

FILE = "hpcrl_tokenizer.json"
_MARK = "\u2063hpcrl-turn\u2063"     # an assistant turn's text no template changes
SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    stop_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    renders_tools: bool

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...

    def encode_followup(self, observation: list[dict] | str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a model directory: hpcrl's own character tokenizer where one was saved
    there (the built-in task's tiny model), else the directory's Hugging Face tokenizer."""
    model_dir = Path(model_dir)
    if (model_dir / FILE).exists():
        return CharTokenizer.load(model_dir)
    return HFTokenizer(model_dir)


class CharTokenizer:
    """One id per character of an alphabet; ids 0, 1, 2 are pad, bos, eos (pad ≠ eos: a padded
    position never reads as a stop)."""
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError(f"tokenizer characters repeat: {chars!r}")
        self.chars = chars
        self.index = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    @property
    def stop_ids(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer's alphabet {self.chars!r}")
        return ([self.bos_id] if bos else []) + [self.index[c] for c in text]

    renders_tools = False

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        raise ValueError("the built-in task's character tokenizer has no chat template: give prompts as text")

    def encode_followup(self, observation: list[dict] | str) -> list[int]:
        """Text as it is (no bos); messages' contents one after the other (no template to render them)."""
        text = observation if isinstance(observation, str) else "".join(str(m.get("content", "")) for m in observation)
        return self.encode(text, bos=False)

    def decode(self, ids) -> str:
        """Text of the ids up to the first eos, specials dropped."""
        out = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def save(self, model_dir: Path) -> None:
        (Path(model_dir) / FILE).write_text(json.dumps({"chars": self.chars, "specials": SPECIALS}))

    @classmethod
    def load(cls, model_dir: Path) -> CharTokenizer:
        path = Path(model_dir) / FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: the model directory was not made by hpcrl.models.create_model_dir")
        return cls(json.loads(path.read_text())["chars"])


class HFTokenizer:
    """A Hugging Face tokenizer from the model directory (never the hub). Its stop tokens are the
    tokenizer's eos and every eos id of the model's generation_config.json (chat models often
    have several, e.g. <|im_end|> and <|endoftext|>). Its pad is the tokenizer's pad where that is
    no stop token, else its unk, bos, or the lowest id that is not a stop token (many chat
    tokenizers pad with their eos, which would read as a stop)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tok = TokenizerFile.of(self.model_dir) or _transformers_tokenizer(self.model_dir)
        self.stop_ids = sorted(set(_ids(self.tok.eos_token_id) + _ids(_generation_eos(self.model_dir))))
        if not self.stop_ids:
            raise ValueError(f"{self.model_dir}: the tokenizer names no eos token and generation_config.json no "
                             "eos_token_id, so generation could never stop; set one of them")
        self.pad_id = next(i for i in (self.tok.pad_token_id, self.tok.unk_token_id, self.tok.bos_token_id,
                                       *range(len(self.tok))) if i is not None and i not in self.stop_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The template's rendering with the generation prompt; `tools` (JSON schemas) as the template
        renders them (`renders_tools`)."""
        return self._ids(self._render(list(messages), True, tools))

    def encode_followup(self, observation: list[dict] | str) -> list[int]:
        """The tokens the template puts after an assistant turn's stop token when `observation` (tool
        or user messages) follows, through the next generation prompt: the difference between the
        rendering of a conversation with and without them, cut at the assistant's stop token, so
        that the model's own tokens (kept as sampled, never re-encoded) and these make exactly what
        the template would render for the whole conversation."""
        messages = [{"role": "tool", "content": observation}] if isinstance(observation, str) else list(observation)
        head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        before, after = self._render(head, False), self._render(head + messages, True)
        end = before.index(_MARK) + len(_MARK)
        stop = next((t for t in (self.tok.decode([i]) for i in self.stop_ids) if before.startswith(t, end)), None)
        if stop is None or not after.startswith(before[:end + len(stop)]):
            raise ValueError(f"{self.model_dir}: the chat template does not end an assistant turn with a stop token "
                             f"({', '.join(map(repr, (self.tok.decode([i]) for i in self.stop_ids)))}), or renders "
                             "earlier turns differently once more follow; multi-turn rollouts need one that does")
        return self._ids(after[end + len(stop):])

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a `tools` argument (else a prompt has to describe them)."""
        return "tools" in (self.tok.chat_template or "")

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if not self.tok.chat_template:
            raise ValueError(f"{self.model_dir}: the tokenizer has no chat template; give prompts as text, "
                             "not as messages")
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                            **({"tools": tools} if tools else {}))

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])   # the template holds its specials

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        cut = next((k for k, i in enumerate(ids) if i in self.stop_ids), len(ids))
        return self.tok.decode(ids[:cut], skip_special_tokens=True)


def _transformers_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir}: no tokenizer that transformers can load here ({e}); a model "
                         "directory needs its tokenizer files (tokenizer.json or its vocabulary)") from None


class TokenizerFile:
    """A tokenizer.json run as transformers runs it for the classes that take the file as it is
    (TokenizersBackend, which transformers 5 saves for SmolLM2 and most tokenizers, and 4.x's
    PreTrainedTokenizerFast), without importing transformers (2-3 CPU-seconds of a role's start beside torch): the
    tokenizers library's pipeline as saved, the special tokens of tokenizer_config.json, the chat
    template rendered as apply_chat_template renders it. The few calls HFTokenizer makes, by
    transformers' names; tests/test_real_model.py holds it to AutoTokenizer."""

    CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
    SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(self, backend, specials: dict[str, str], chat_template: str | None):
        self.backend, self.specials, self.chat_template = backend, specials, chat_template
        for name in self.SPECIALS:
            setattr(self, f"{name}_id", backend.token_to_id(specials[name]) if name in specials else None)

    @classmethod
    def of(cls, model_dir: Path) -> TokenizerFile | None:
        """The directory's tokenizer, or None where transformers would change the file's pipeline
        (another class, bos/eos added by the config, special tokens it would add, cleaned-up
        decoding, a template chosen by name or marking generations, a vocabulary whose pre-tokenizer
        it may patch)."""
        try:
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except (OSError, ValueError, ImportError):
            return None
        specials = {k: _content(config[k]) for k in cls.SPECIALS if config.get(k) is not None}
        declared = [(int(i), _content(t)) for i, t in (config.get("added_tokens_decoder") or {}).items()]
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").exists():
            template = (model_dir / "chat_template.jinja").read_text()
        if (config.get("tokenizer_class") not in cls.CLASSES or "add_bos_token" in config or "add_eos_token" in config
                or config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens")
                or config.get("extra_special_tokens") or config.get("additional_special_tokens")
                or backend.post_processor is None or backend.get_vocab_size() > 100_000
                or not isinstance(template, (str, type(None))) or re.search(r"{%-?\s*generation", template or "")
                or any(backend.token_to_id(t) is None for t in specials.values())
                or any(backend.token_to_id(t) != i for i, t in declared)):
            return None
        return cls(backend, specials, template)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool = False,
                            tools: list[dict] | None = None) -> str:
        """The rendering as text (HFTokenizer encodes it itself)."""
        if tokenize:
            raise NotImplementedError("TokenizerFile renders chat templates as text only (tokenize=False)")
        return _compiled_template(self.chat_template).render(messages=messages, tools=tools, documents=None,
                                                             add_generation_prompt=add_generation_prompt,
                                                             **self.specials)


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """The template in the environment apply_chat_template renders in: sandboxed, blocks trimmed,
    loop controls, a `tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _generation_eos(model_dir: Path):
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.exists() else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
