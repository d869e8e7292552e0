"""A Hugging Face model folder's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library,
with the special tokens and the chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``).

The same small interface as :class:`tritonllm.data.Tokenizer` (``encode``, ``decode``,
``vocab_size``, ``eos_id``, ``path``) plus ``bos_id`` and :meth:`HFTokenizer.apply_chat_template`,
which renders a list of ``{"role", "content"}`` messages with the model's own Jinja template in a
sandboxed environment (as ``transformers`` does). ``encode`` adds no special tokens: the chat
template or the caller places them.
"""

from __future__ import annotations

import json
import os

from tritonllm.errors import DataError

#: files of a model folder that belong to its tokenizer (copied along on export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")


def _token_text(value) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """The tokenizer of the Hugging Face model folder ``folder``."""

    def __init__(self, folder: str):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError("reading a Hugging Face tokenizer needs the `tokenizers` package: "
                            "pip install tokenizers") from None
        self.folder = folder
        self.path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(self.path):
            extra = (" (it has a SentencePiece tokenizer.model: convert it to tokenizer.json with "
                     "transformers' AutoTokenizer(...).save_pretrained)"
                     if os.path.isfile(os.path.join(folder, "tokenizer.model")) else "")
            raise DataError(f"{folder} has no tokenizer.json{extra}")
        try:
            self.tok = _Tokenizer.from_file(self.path)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise DataError(f"{self.path} is not a readable tokenizer: {e}") from None
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        self.config = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                self.config = json.load(f)
        self.chat_template = self.config.get("chat_template")
        jinja = os.path.join(folder, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja):
            with open(jinja) as f:
                self.chat_template = f.read()
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def bos_id(self) -> int | None:
        return self._id(self.bos_token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` rendered with the model's chat template; a DataError when it has none."""
        if self.chat_template is None:
            raise DataError(f"the tokenizer in {self.folder} has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise DataError(f"the chat template of {self.folder} rejected the messages: {e}") from None
