"""The reference for log-likelihoods: llama-cpp-python's own ``Llama`` behind OpenAI's text
completions endpoint, with ``echo`` + ``logprobs`` aligned as OpenAI defines them (issue 43,
item 4; run by :mod:`loadtest.bench.lm_eval_run`).

Why not ``python -m llama_cpp.server`` itself, which has ``echo`` and ``logprobs``: in
llama-cpp-python 0.3.36 (this project's pin) its echoed prompt log-probabilities are shifted by
one position. ``Llama._create_completion`` pairs token *i* with score row *i*, but row *i* is the
distribution *after* token *i* (it predicts token *i + 1*), so each prompt token gets the
log-probability of being repeated; and the generated token has no entry at all (it is sampled,
never evaluated), which lm-evaluation-harness's ``[ctxlen:-1]`` slice then mistakes for the last
continuation token. Reported upstream (abetlen/llama-cpp-python issues 1276 and 1983, open);
checked here on the default model: its 15 entries for ``"Question: What is 2 plus 3?\\nAnswer:
5"`` equal ``log_softmax(row i)[token i]`` to the last digit, not ``row i - 1``. llama.cpp's own
llama-server refuses ``echo`` ("Only no echo is supported").

So this server runs the same ``Llama`` (same weights, tokenizer, llama.cpp build), evaluates
the prompt with ``logits_all`` and reads each token's log-probability from the row before it:
``token_logprobs[0]`` is null (nothing predicts the first token), then one entry per prompt
token, then the generated token (greedy: the argmax of the last row), so that there are
``len(prompt) + 1`` entries as OpenAI's ``echo`` with ``max_tokens: 1`` gives. ``top_logprobs``
holds the ``logprobs`` most likely tokens of each row, and the token itself. A request without
``echo`` is ``Llama.create_completion``'s own answer (temperature 0: greedy; ``stop``).

Also: llama.cpp's extra CPU weight buffers (AMX, repacked layouts) crash on some Xeons at the
first batched decode, and ``Llama`` has no setting for them; ``--extra-buffers off`` makes
``llama_model_default_params`` (where ``Llama.__init__`` starts) say ``use_extra_bufts =
False``, as quicsrv's start-up canary decides for its own worker.

::

    python -m loadtest.bench.llama_cpp_reference --model M.gguf --port 0 --extra-buffers off

prints ``reference listening on port N`` once it serves (one request at a time: lm-eval's
``num_concurrent=1``). Plain HTTP on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["READY_PATTERN", "main", "prompt_logprobs"]

READY_PATTERN = r"reference listening on port (\d+)"


def _log_softmax(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    rows64 = rows.astype(np.float64)
    top = rows64.max(axis=-1, keepdims=True)
    return rows64 - top - np.log(np.exp(rows64 - top).sum(axis=-1, keepdims=True))


def prompt_logprobs(
    scores: npt.NDArray[np.float32], tokens: list[int], top_n: int
) -> tuple[list[float | None], list[dict[int, float] | None], int]:
    """OpenAI's echo from the logits of ``tokens`` (``scores[i]``: the row after token ``i``):
    each token's log-probability given the ones before it (None for the first), the ``top_n``
    best of each row (and the token itself) by token id, and the greedy next token, appended
    to both lists. Pure: the tests check the alignment on a made-up table."""
    logprobs = _log_softmax(scores[: len(tokens)])
    values: list[float | None] = [None]
    tops: list[dict[int, float] | None] = [None]
    for i in range(1, len(tokens)):
        row = logprobs[i - 1]
        values.append(float(row[tokens[i]]))
        tops.append(_top(row, top_n, tokens[i]))
    last = logprobs[len(tokens) - 1]
    generated = int(last.argmax())
    values.append(float(last[generated]))
    tops.append(_top(last, top_n, generated))
    return values, tops, generated


def _top(row: npt.NDArray[np.float64], n: int, token: int) -> dict[int, float]:
    n = min(max(n, 0), len(row))
    best = np.argpartition(-row, n - 1)[:n] if n else np.empty(0, dtype=np.int64)
    top = {int(t): float(row[t]) for t in sorted(best, key=lambda t: -row[t])}
    top[token] = float(row[token])
    return top


class _Reference:
    """One ``Llama`` and a lock (one request at a time)."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.extra_buffers == "off":
            _without_extra_buffers()
        from llama_cpp import Llama

        self.model_name = args.model.stem
        self.llm = Llama(
            str(args.model),
            n_ctx=args.ctx,
            n_batch=args.batch,
            n_ubatch=args.batch,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            flash_attn=args.flash_attn,
            logits_all=True,
            verbose=False,
        )
        self.lock = threading.Lock()

    def piece(self, token: int, before: list[int]) -> str:
        return self.llm.detokenize([token], prev_tokens=before).decode("utf-8", "replace")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be one string")
        with self.lock:
            if body.get("echo"):
                choice, usage = self._echo(prompt, int(body.get("logprobs") or 0))
            else:
                choice, usage = self._generate(prompt, body)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": usage,
        }

    def _echo(self, prompt: str, top_n: int) -> tuple[dict[str, Any], dict[str, int]]:
        """One token after ``prompt``, with the prompt's own log-probabilities (see the
        module docstring)."""
        llm = self.llm
        tokens = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
        llm.reset()  # every prompt evaluated whole: no state from the previous request
        llm.eval(tokens)
        values, tops, generated = prompt_logprobs(np.asarray(llm.scores), tokens, top_n)
        everything = [*tokens, generated]
        texts = [self.piece(t, everything[:i]) for i, t in enumerate(everything)]
        top_texts = [
            None if top is None else {self.piece(t, everything[:i]): v for t, v in top.items()}
            for i, top in enumerate(tops)
        ]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        logprobs = {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": top_texts,
            "text_offset": offsets,
        }
        choice = {
            "index": 0,
            "text": "".join(texts),
            "logprobs": logprobs,
            "finish_reason": "length",
        }
        return choice, {
            "prompt_tokens": len(tokens),
            "completion_tokens": 1,
            "total_tokens": len(tokens) + 1,
        }

    def _generate(self, prompt: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
        """``Llama.create_completion``'s own greedy answer, the prompt evaluated whole (``reset``:
        else ``Llama`` evaluates only what follows the longest prefix it shares with the
        previous request, and how a prompt is split into batches moves llama.cpp's last digits:
        enough to flip a greedy pick between near-equal tokens)."""
        self.llm.reset()
        done = self.llm.create_completion(
            prompt,
            max_tokens=int(body.get("max_tokens") or 16),
            temperature=float(body.get("temperature") or 0.0),
            stop=body.get("stop") or [],
            seed=body.get("seed"),
        )
        assert isinstance(done, dict)
        choice = done["choices"][0]
        return (
            {
                "index": 0,
                "text": choice["text"],
                "logprobs": None,
                "finish_reason": choice["finish_reason"],
            },
            dict(done["usage"]),
        )


def _without_extra_buffers() -> None:
    import llama_cpp.llama_cpp as low

    defaults = low.llama_model_default_params

    def model_params() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = model_params


def _handler(reference: _Reference) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/v1/models":
                entry = {
                    "id": reference.model_name,
                    "object": "model",
                    "owned_by": "llama-cpp-python",
                }
                self._answer(200, {"object": "list", "data": [entry]})
            else:
                self._answer(404, {"error": {"message": "not found", "code": "not_found"}})

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/v1/completions":
                self._answer(404, {"error": {"message": "not found", "code": "not_found"}})
                return
            length = int(self.headers.get("content-length") or 0)
            try:
                body = json.loads(self.rfile.read(length))
                self._answer(200, reference.complete(body))
            except (ValueError, TypeError) as exc:
                self._answer(400, {"error": {"message": str(exc), "code": "invalid_value"}})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.llama_cpp_reference")
    add = parser.add_argument
    add("--model", type=Path, required=True)
    add("--port", type=int, default=0)
    add("--ctx", type=int, default=2048)
    add("--batch", type=int, default=512)
    add("--threads", type=int, default=1)
    add("--flash-attn", action=argparse.BooleanOptionalAction, default=True)
    add("--extra-buffers", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    reference = _Reference(args)
    server = HTTPServer(("127.0.0.1", args.port), _handler(reference))
    print(f"reference listening on port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
