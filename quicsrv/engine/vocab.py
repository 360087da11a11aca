"""The model's vocabulary: tokenizing, detokenizing and the chat template, without any weights.

The server process needs these synchronously for every request, but must not load the weights
or touch llama.cpp's compute kernels (those live in the engine worker process, where a crash
cannot take the server down). llama.cpp loads a GGUF ``vocab_only`` in milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections import OrderedDict
from pathlib import Path

import blake3
import jinja2
import llama_cpp
from llama_cpp import _logger as llama_cpp_logger
from llama_cpp._internals import LlamaModel
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ._api import Grammar, InvalidSchema
from .facts import ModelInfo
from .grammar import SchemaRejected, check_compiles, grammar_for_schema
from .tool_call_grammar import is_tool_call_blocks, tool_call_blocks_grammar

__all__ = ["HERMES_TOOL_CALLS", "Vocabulary", "check_chat_template", "file_digest"]

#: :attr:`Vocabulary.tool_call_format` of a template that renders tools and speaks of
#: ``<tool_call>`` (Qwen 2.5/3, Hermes, SmolLM3 and many more).
HERMES_TOOL_CALLS = "hermes"
_PROBE_TOOL = "quicsrv_probe_tool"

_GRAMMARS_KEPT = 256


class Vocabulary:
    """Tokenizer, token pieces and chat template of one GGUF model."""

    def __init__(
        self, model: LlamaModel, model_digest: bytes, chat_template: str | None = None
    ) -> None:
        """``chat_template``: a Jinja chat template used instead of the GGUF's own."""
        self._model = model
        self._owned = False
        self.model_digest = model_digest
        self.chat_template = chat_template or model.metadata().get("tokenizer.chat_template")
        """The template prompts are rendered with (None: the GGUF has none)."""
        self._chat = _chat_formatter(model, self.chat_template)
        self.tool_call_format = _tool_call_format(self._chat)
        """:data:`HERMES_TOOL_CALLS` when the template renders tools in that style, else None
        (tools are then shown the generic way: :mod:`quicsrv.http.tool_format`)."""
        # Filled as tokens are met: the decode thread asks for every token it samples, and a
        # list index is cheaper there than a ctypes call (into cache lines a decode evicted).
        n_vocab = int(model.n_vocab())
        self._pieces: list[bytes | None] = [None] * n_vocab
        self._end_of_generation = bytearray(n_vocab)  # 0: not looked up, 1: no, 2: yes
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._grammars_lock = threading.Lock()

    @classmethod
    def load(cls, model_path: Path, chat_template: str | None = None) -> Vocabulary:
        """The vocabulary alone (``vocab_only``): no weights, no compute backend."""
        llama_cpp_logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = LlamaModel(path_model=str(model_path), params=params, verbose=False)
        vocabulary = cls(model, file_digest(model_path), chat_template)
        vocabulary._owned = True
        return vocabulary

    def grammar_for(self, schema: str) -> Grammar:
        """The grammar of a JSON schema (JSON text), checked to compile against this
        vocabulary, so that a bad one is refused here and never reaches the engine worker;
        raises InvalidSchema. The last few hundred are kept: clients resend the same schema."""
        with self._grammars_lock:  # requests are prepared on worker threads too
            found = self._grammars.get(schema)
            if found is not None:
                self._grammars.move_to_end(schema)
                return found
        try:
            value = json.loads(schema)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise InvalidSchema("the schema is not valid JSON") from None
        try:
            converted = (
                tool_call_blocks_grammar(value)
                if is_tool_call_blocks(value)
                else grammar_for_schema(value)
            )
            check_compiles(converted, self.handle)
        except SchemaRejected as exc:
            raise InvalidSchema(exc.message, exc.path) from None
        made = Grammar(gbnf=converted.gbnf, digest=converted.digest)
        with self._grammars_lock:
            self._grammars[schema] = made
            while len(self._grammars) > _GRAMMARS_KEPT:
                self._grammars.popitem(last=False)
        return made

    @property
    def handle(self) -> llama_cpp.llama_vocab_p:
        """llama.cpp's vocabulary, for what takes one (a grammar sampler)."""
        vocab: llama_cpp.llama_vocab_p = self._model.vocab
        return vocab

    @property
    def n_vocab(self) -> int:
        return int(self._model.n_vocab())

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """``text``'s tokens; ``add_special``: BOS in front where the model wants one;
        ``parse_special``: a special token's text (``<|im_end|>``) is that token, else plain
        text (llama-server's ``/tokenize`` flags, same defaults as every prompt here)."""
        return list(self._model.tokenize(text.encode("utf-8"), add_special, parse_special))

    def render_chat(
        self, messages: list[dict[str, str]], tools: list[dict[str, object]] | None = None
    ) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's shape) passed to the template, for
        one that renders them (:attr:`tool_call_format`)."""
        if self._chat is None:
            # No template in the GGUF: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        return str(self._chat(messages=messages, tools=tools).prompt)  # type: ignore[arg-type]

    def is_end_of_generation(self, token_id: int) -> bool:
        known = self._end_of_generation[_checked(token_id)]
        if not known:
            known = 2 if llama_cpp.llama_vocab_is_eog(self._model.vocab, token_id) else 1
            self._end_of_generation[token_id] = known
        return known == 2

    def piece(self, token_id: int) -> bytes:
        """The token's bytes (possibly part of a UTF-8 character)."""
        piece = self._pieces[_checked(token_id)]
        if piece is None:
            piece = self._pieces[token_id] = self._look_up_piece(token_id)
        return piece

    def token_text(self, token_id: int) -> bytes:
        """The token's bytes with a control token shown as its text (``<|im_end|>``, which
        :meth:`piece` leaves out of answers): llama-server's ``/detokenize`` and pieces."""
        if token_id >= self.n_vocab:
            raise IndexError(f"token id {token_id} is outside the vocabulary")
        return self._look_up_piece(_checked(token_id), special=True)

    def _look_up_piece(self, token_id: int, *, special: bool = False) -> bytes:
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(
                self._model.vocab, token_id, buffer, size, 0, special
            )
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def describe(self, path: Path) -> ModelInfo:
        """The facts of the model file at ``path`` (this vocabulary's): from its header, which
        a ``vocab_only`` load reads whole (parameter count and size included; hyperparameters
        are not loaded then, so the context and width come from the header's keys)."""
        header = self._model.metadata()
        architecture = header.get("general.architecture")

        def number(key: str) -> int | None:
            value = header.get(f"{architecture}.{key}") if architecture else None
            return int(value) if value is not None and value.isdigit() else None

        def special_text(token_id: int) -> str | None:
            if not 0 <= token_id < self.n_vocab:  # -1: the model has none
                return None
            return self.token_text(token_id).decode("utf-8", "replace")

        return ModelInfo(
            file_name=path.name,
            name=header.get("general.name"),
            architecture=architecture,
            n_vocab=self.n_vocab,
            vocab_type=int(llama_cpp.llama_vocab_type(self.handle)),
            n_ctx_train=number("context_length"),
            n_embd=number("embedding_length"),
            n_params=int(llama_cpp.llama_model_n_params(self._model.model)),
            size_bytes=int(llama_cpp.llama_model_size(self._model.model)),
            chat_template=self.chat_template or None,
            bos_token=special_text(int(self._model.token_bos())),
            eos_token=special_text(int(self._model.token_eos())),
            tool_call_format=self.tool_call_format,
        )

    def close(self) -> None:
        if self._owned:
            self._model.close()  # type: ignore[no-untyped-call]
            self._owned = False


def _checked(token_id: int) -> int:
    # A negative id would index the caches from the end; one past the vocabulary raises there.
    if token_id < 0:
        raise IndexError(f"token id {token_id} is negative")
    return token_id


def check_chat_template(template: str) -> None:
    """Raise ValueError (saying where) unless ``template`` parses as a Jinja chat template."""
    try:
        Jinja2ChatFormatter(template=template, eos_token="", bos_token="")
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        raise ValueError(f"{exc}" + (f" (line {line})" if line else "")) from None


def _tool_call_format(chat: Jinja2ChatFormatter | None) -> str | None:
    """Whether the template renders tools, and in which style: a probe conversation rendered
    with a probe tool must show the tool's name (most templates without a tools section ignore
    ``tools``), and the template must speak of ``<tool_call>`` (the Hermes style: calls as
    ``<tool_call>`` JSON, results as ``<tool_response>``). Other styles (Llama 3.x's bare JSON,
    Mistral's ``[TOOL_CALLS]``) are not read yet: they get the generic format."""
    if chat is None:
        return None
    probe = {
        "type": "function",
        "function": {
            "name": _PROBE_TOOL,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    try:
        rendered = str(chat(messages=[{"role": "user", "content": "hi"}], tools=[probe]).prompt)  # type: ignore[list-item]
    except Exception:  # a template's own raise_exception, or one that cannot take tools
        return None
    if _PROBE_TOOL not in rendered:
        return None
    return HERMES_TOOL_CALLS if "<tool_call>" in rendered + chat.template else None


def _chat_formatter(model: LlamaModel, template: str | None) -> Jinja2ChatFormatter | None:
    if not template:
        return None
    eos = model.token_to_piece(model.token_eos(), special=True)
    bos = model.token_to_piece(model.token_bos(), special=True)
    return Jinja2ChatFormatter(
        template=template,
        eos_token=eos.decode("utf-8", "replace"),
        bos_token=bos.decode("utf-8", "replace"),
    )


def file_digest(path: Path) -> bytes:
    """BLAKE3 of the model file: a resumed session must meet the very same weights."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.digest()
