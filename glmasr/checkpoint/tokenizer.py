"""Tokenizer and the transcription prompt.

The tokenizer comes from the checkpoint folder. When the folder's ``tokenizer.json`` is all there is to it (a
``TokenizersBackend`` / ``PreTrainedTokenizerFast`` config without settings transformers applies on top: no
clean-up of spaces, no added BOS/EOS switches), it is run through the HF ``tokenizers`` library that
transformers' fast tokenizer wraps, which loads in ~30 ms; importing transformers to do the same costs 1.5 s
here and ~9 s on the H200 machine, most of a cold start. Anything else goes through
``transformers.AutoTokenizer``. Tests hold the two to the same ids and texts. Every special token id is read
from the tokenizer; none is hard-coded. The prompt for one audio with N audio tokens is rendered here, exactly as
the reference chat template plus processor produce it (``shared/spec/glmasr-model.md`` section 1.4):

    <|user|>\\n<|begin_of_audio|><|pad|>*N<|end_of_audio|><|user|>\\n{prompt}<|assistant|>\\n

and the whole string is tokenized like ``GlmAsrProcessor`` does: with the tokenizer's default special-token
handling, unless the text starts with the BOS token (then without), so a tokenizer that adds prefix tokens
gives the same ids as transformers.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from ..errors import TokenizerError

DEFAULT_PROMPT = "Please transcribe this audio into text"
AUDIO_TOKEN = "<|pad|>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
BEGIN_AUDIO, END_AUDIO = "<|begin_of_audio|>", "<|end_of_audio|>"


def build_instruction(prompt: str | None, hotwords: list[str], default: str | None = None) -> str | None:
    """The model's instruction with hotwords: ``prompt`` (or ``default``, else the default transcription
    instruction, when None) plus ``\nHotwords: a, b`` when there are hotwords (the CLI's --hotwords, the
    server's keywords[]). None = the checkpoint's default instruction unchanged."""
    words = [w.strip() for w in hotwords]
    if any(not w for w in words):
        raise ValueError("hotwords must be non-empty text")
    if not words:
        return prompt
    if prompt is None:
        prompt = default or DEFAULT_PROMPT
    return f"{prompt}\nHotwords: {', '.join(words)}"


def _processor_settings(folder: Path) -> dict:
    for name in ("processor_config.json", "preprocessor_config.json"):
        p = folder / name
        if p.exists():
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{p} is not valid JSON: {e}") from None
            if isinstance(data, dict) and ("audio_token" in data or "default_transcription_prompt" in data):
                return data
    return {}


class PromptBuilder:
    """Renders and tokenizes GLM-ASR transcription prompts with one checkpoint's tokenizer."""

    def __init__(self, tokenizer, audio_token_id: int, default_prompt: str = DEFAULT_PROMPT,
                 audio_token: str = AUDIO_TOKEN, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.audio_token = audio_token
        self.default_prompt = default_prompt
        self.special_ids = {}
        for tok in (USER, ASSISTANT, BEGIN_AUDIO, END_AUDIO, audio_token):
            ids = tokenizer.convert_tokens_to_ids([tok])
            tid = ids[0] if ids else None
            if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens([tid])[0] != tok:
                raise TokenizerError(f"the checkpoint's tokenizer has no special token {tok!r}")
            self.special_ids[tok] = tid
        if self.special_ids[audio_token] != audio_token_id:
            raise TokenizerError(f"audio placeholder {audio_token!r} is id {self.special_ids[audio_token]} in the "
                                 f"tokenizer but audio_token_id is {audio_token_id} in config.json")
        self.audio_token_id = audio_token_id
        self.chat_template = chat_template
        self._encoded: dict[tuple[int, str | None], tuple[int, ...]] = {}
        # Many callers' threads tokenize and detokenize at once; the tokenizer object is not documented as
        # thread-safe (its call path sets truncation/padding state), so calls into it are serialized (~us each).
        self._lock = threading.Lock()
        if chat_template:
            self._check_chat_template(chat_template)

    @classmethod
    def from_folder(cls, folder: str | Path, audio_token_id: int, backend: str = "auto") -> "PromptBuilder":
        """backend: "auto" (``tokenizers`` when the folder allows it, see the module docstring),
        "tokenizers" or "transformers"."""
        folder = Path(folder)
        if backend not in ("auto", "tokenizers", "transformers"):
            raise ValueError(f"unknown tokenizer backend {backend!r}")
        tokenizer = None
        if backend != "transformers":
            tokenizer = TokenizersAdapter.from_folder(folder)
            if tokenizer is None and backend == "tokenizers":
                raise TokenizerError(f"{folder}: this tokenizer needs transformers (not a plain tokenizer.json)")
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(folder))
            except Exception as e:
                raise TokenizerError(f"cannot load the tokenizer from {folder} ({type(e).__name__}: {e}); a "
                                     f"checkpoint folder needs tokenizer.json and tokenizer_config.json") from None
        settings = _processor_settings(folder)
        template = getattr(tokenizer, "chat_template", None)
        if not template and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tokenizer, audio_token_id,
                   default_prompt=settings.get("default_transcription_prompt", DEFAULT_PROMPT),
                   audio_token=settings.get("audio_token", AUDIO_TOKEN), chat_template=template)

    def render(self, num_audio_tokens: int, prompt: str | None = None) -> str:
        text = self.default_prompt if prompt is None else prompt
        return (f"{USER}\n{BEGIN_AUDIO}{self.audio_token * num_audio_tokens}{END_AUDIO}"
                f"{USER}\n{text}{ASSISTANT}\n")

    def encode(self, num_audio_tokens: int, prompt: str | None = None) -> list[int]:
        if num_audio_tokens < 1:
            raise ValueError(f"a prompt needs at least one audio token, got {num_audio_tokens}")
        # Memoized: a batch of 30 s windows asks for the same prompt hundreds of times (~0.3 ms a call).
        key = (num_audio_tokens, prompt)
        with self._lock:
            if key not in self._encoded:
                if len(self._encoded) >= 4096:
                    self._encoded.clear()
                self._encoded[key] = tuple(self._encode(num_audio_tokens, prompt))
            return list(self._encoded[key])

    def _encode(self, num_audio_tokens: int, prompt: str | None) -> list[int]:
        text = self.render(num_audio_tokens, prompt)
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos is not None and text.startswith(bos))
        ids = list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])
        if ids.count(self.audio_token_id) != num_audio_tokens:
            raise TokenizerError(f"tokenizing the prompt gave {ids.count(self.audio_token_id)} audio placeholders, "
                                 f"expected {num_audio_tokens}; does the custom prompt contain {self.audio_token!r}?")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _check_chat_template(self, template: str) -> None:
        """The checkpoint's own template must render the same string as ``render`` (warn if not). Rendered with
        jinja2 the way transformers renders chat templates (sandboxed, trim_blocks, lstrip_blocks, loop
        controls, ``raise_exception``), without importing transformers."""
        conversation = [{"role": "user", "content": [{"type": "audio", "path": "x.wav"},
                                                     {"type": "text", "text": self.default_prompt}]}]
        try:
            rendered = render_chat_template(template, conversation,
                                            **getattr(self.tokenizer, "special_tokens_map", {}))
        except Exception as e:  # a template we cannot render is the checkpoint's problem, not fatal
            warnings.warn(f"could not render the checkpoint's chat template ({e}); using the built-in prompt")
            return
        if rendered != self.render(1):
            warnings.warn(f"the checkpoint's chat template renders {rendered!r}, which differs from the "
                          f"GLM-ASR prompt {self.render(1)!r}; using the GLM-ASR prompt")


def render_chat_template(template: str, messages: list, **special_tokens) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TokenizersAdapter:
    """The part of the transformers tokenizer interface that PromptBuilder uses, over ``tokenizers.Tokenizer``
    (what transformers' fast tokenizer runs underneath)."""

    SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
    # tokenizer_config settings under which transformers' tokenizer differs from the bare tokenizer.json
    _NEEDS_TRANSFORMERS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "tokenizer_file")

    def __init__(self, tokenizer, config: dict):
        self._tok = tokenizer
        self.special_tokens_map = {k: t for k in self.SPECIAL_KEYS if (t := _token_text(config.get(k)))}
        self.bos_token = self.special_tokens_map.get("bos_token")
        unk = self.special_tokens_map.get("unk_token")
        self.unk_token_id = tokenizer.token_to_id(unk) if unk else None
        self.chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None

    @classmethod
    def from_folder(cls, folder: Path) -> "TokenizersAdapter | None":
        path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not path.exists() or not cfg_path.exists():
            return None
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {e}") from None
        if (config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast")
                or config.get("clean_up_tokenization_spaces") or any(k in config for k in cls._NEEDS_TRANSFORMERS)):
            return None
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), config)
        except Exception as e:
            raise TokenizerError(f"cannot load {path} ({type(e).__name__}: {e})") from None

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class IncrementalDetokenizer:
    """Text of a growing token list, piece by piece, in time linear in its length: each ``push`` decodes only
    the tokens since the last emitted piece plus the few before them (for context at the boundary), and holds
    text back while it ends in an incomplete multi-byte character."""

    def __init__(self, prompts: PromptBuilder):
        self.prompts = prompts
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens up to here are reflected in the emitted text

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        if len(self.ids) == self._read:
            return ""
        before = self.prompts.decode(self.ids[self._prefix: self._read])
        now = self.prompts.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before):]
