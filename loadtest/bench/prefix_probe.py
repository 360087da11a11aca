"""Does a turn that continues from kept KV cells compute what a cold run computes, and can a
replay that follows how those cells were made reproduce it bit for bit? (issue 30's groundwork)

Per conversation and turn, in one llama.cpp context (the server's settings, one sequence):

* **warm**: the previous turn's cells (its prompt, chunk-prefilled from 0, and its answer,
  decoded one token at a time) are kept; the cells past the longest common prefix with this
  turn's prompt are removed, the rest of the prompt is chunk-prefilled from there, and the
  answer decoded greedily;
* **cold**: the cells cleared, this turn's whole prompt chunk-prefilled from 0, the answer
  decoded greedily;
* **replay**: the cells cleared, then rebuilt the way the warm cells were made (every earlier
  turn's segments: chunked prefill from its start, its answer token by token), the rest of the
  prompt prefilled as the warm run did, and the warm answer's tokens fed one by one: the logits
  must be the warm run's, bit for bit, for an exact resume.

Printed per turn: prompt tokens, the common prefix reused, whether warm and cold answers are
the same tokens, the largest logit difference at the first answer token, and whether replay
matched warm exactly.

    python -m loadtest.bench.prefix_probe --conversations 3 --turns 4
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import llama_cpp
import numpy as np

from loadtest.bench.conversation_script import common_prefix
from loadtest.bench.raw import _RawEngine
from loadtest.bench.servers import ServerSettings
from quicsrv.engine import default_model_path
from quicsrv.engine.vocab import Vocabulary

__all__ = ["main"]

CHUNK = 64  # the server's prefill_chunk_tokens
TOPICS = ("a lighthouse", "a mountain village", "a ship's cook", "an old clockmaker")


@dataclass(frozen=True, slots=True)
class Segment:
    """Cells [start, end) of one sequence, made by chunked prefill from ``start`` or token by
    token (an answer being decoded)."""

    start: int
    end: int
    one_by_one: bool


@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    reused_tokens: int
    same_answer: bool
    first_logit_max_diff: float
    replay_exact: bool


class _Probe(_RawEngine):
    """The raw loop's context (one sequence) and the model's vocabulary."""

    def __init__(self, model_path: Path, answer_tokens: int) -> None:
        super().__init__(ServerSettings(model_path=model_path, parallel=1))
        self.vocabulary = Vocabulary.load(model_path)
        self.answer_tokens = answer_tokens

    def close(self) -> None:
        super().close()
        self.vocabulary.close()

    def _decode_run(self, tokens: list[int], start: int) -> np.ndarray:
        """Decode ``tokens`` at positions from ``start`` in one batch; the last one's logits."""
        batch = self.batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(self.context.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        pointer = llama_cpp.llama_get_logits_ith(self.context.ctx, len(tokens) - 1)
        array = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )
        return array.copy()

    def prefill(self, tokens: list[int], start: int) -> np.ndarray:
        """Cells for ``tokens[start:]``, in chunks from ``start``: the last logits."""
        logits = None
        for at in range(start, len(tokens), CHUNK):
            logits = self._decode_run(tokens[at : at + CHUNK], at)
        assert logits is not None
        return logits

    def answer(self, logits: np.ndarray, position: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy answer from ``logits`` (the prompt's last), one token at a time."""
        tokens, seen = [], [logits]
        for i in range(self.answer_tokens):
            token = int(np.argmax(seen[-1]))
            tokens.append(token)
            if i + 1 < self.answer_tokens:
                seen.append(self._decode_run([token], position + i))
        return tokens, seen

    def feed(self, tokens: list[int], position: int) -> list[np.ndarray]:
        """Decode given tokens one by one (a replay of an answer): their logits."""
        return [self._decode_run([token], position + i) for i, token in enumerate(tokens[:-1])]

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def keep(self, n_tokens: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self.memory, 0, n_tokens, -1):
            raise RuntimeError("llama_memory_seq_rm refused a partial removal")


def _user_text(conversation: int, turn: int) -> str:
    topic = TOPICS[conversation % len(TOPICS)]
    return (
        f"Turn {turn + 1}. Tell me more about {topic}: who lives there, what they do from "
        "morning to night, what they fear and what they hope for, what the weather is like in "
        "each season, which sounds and smells fill the place, and what a visitor would notice "
        "first. Describe it in a calm voice, with concrete details, no lists, and no summary."
    )


def _conversation(probe: _Probe, index: int, turns: int) -> list[TurnResult]:
    messages: list[dict[str, str]] = []
    segments: list[Segment] = []  # how the kept cells were made, in order
    kept: list[int] = []  # the tokens whose cells are kept (prompt and answer)
    results = []
    probe.clear()
    for turn in range(turns):
        messages.append({"role": "user", "content": _user_text(index, turn)})
        prompt = probe.vocabulary.tokenize(probe.vocabulary.render_chat(messages), add_special=True)
        reused = common_prefix(kept, prompt) if kept else 0
        reused = min(reused, len(prompt) - 1)  # the last prompt token is always decoded
        # warm: keep [0, reused), prefill the rest from there, answer
        probe.keep(reused)
        warm_logits = probe.prefill(prompt, reused)
        warm_answer, warm_seen = probe.answer(warm_logits, len(prompt))
        turn_segments = [
            *(_cut(segments, reused)),
            Segment(reused, len(prompt), one_by_one=False),
            Segment(len(prompt), len(prompt) + len(warm_answer) - 1, one_by_one=True),
        ]
        # cold: everything from 0
        probe.clear()
        cold_logits = probe.prefill(prompt, 0)
        cold_answer, _ = probe.answer(cold_logits, len(prompt))
        # replay: the warm cells as they were made, then the warm answer fed back
        probe.clear()
        sequence = [*prompt, *warm_answer]
        replay_seen = _replay(probe, sequence, turn_segments)
        replay_exact = len(replay_seen) == len(warm_seen) and all(
            np.array_equal(a, b) for a, b in zip(replay_seen, warm_seen, strict=True)
        )
        results.append(
            TurnResult(
                conversation=index,
                turn=turn + 1,
                prompt_tokens=len(prompt),
                reused_tokens=reused,
                same_answer=warm_answer == cold_answer,
                first_logit_max_diff=float(np.max(np.abs(warm_logits - cold_logits))),
                replay_exact=replay_exact,
            )
        )
        # The replay rebuilt the warm cells: the conversation goes on from them.
        answer_text = b"".join(probe.vocabulary.piece(t) for t in warm_answer)
        messages.append({"role": "assistant", "content": answer_text.decode("utf-8", "replace")})
        segments, kept = turn_segments, sequence[:-1]
    return results


def _cut(segments: list[Segment], upto: int) -> list[Segment]:
    """The segments that made cells [0, upto)."""
    kept = []
    for segment in segments:
        if segment.start >= upto:
            break
        kept.append(Segment(segment.start, min(segment.end, upto), segment.one_by_one))
    return kept


def _replay(probe: _Probe, sequence: list[int], segments: list[Segment]) -> list[np.ndarray]:
    """Rebuild cells by ``segments``; the logits the last two segments gave, as the warm run
    saw them (the prompt's last, then one per fed answer token)."""
    seen: list[np.ndarray] = []
    for n, segment in enumerate(segments):
        last_two = n >= len(segments) - 2
        if segment.one_by_one:
            logits = probe.feed(sequence[segment.start : segment.end + 1], segment.start)
            if last_two:
                seen.extend(logits)
        else:
            logits_one = _prefill_segment(probe, sequence, segment)
            if last_two:
                seen.append(logits_one)
    return seen


def _prefill_segment(probe: _Probe, sequence: list[int], segment: Segment) -> np.ndarray:
    logits = None
    for at in range(segment.start, segment.end, CHUNK):
        logits = probe._decode_run(sequence[at : min(at + CHUNK, segment.end)], at)
    assert logits is not None
    return logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.prefix_probe")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    probe = _Probe(default_model_path(), args.answer_tokens)
    try:
        results = [
            r for c in range(args.conversations) for r in _conversation(probe, c, args.turns)
        ]
    finally:
        probe.close()
    for r in results:
        print(
            f"conversation {r.conversation} turn {r.turn}: prompt {r.prompt_tokens}, reused "
            f"{r.reused_tokens}, warm answer == cold: {r.same_answer}, first-token logits "
            f"max |diff| {r.first_logit_max_diff:.2e}, replay exact: {r.replay_exact}"
        )
    later = [r for r in results if r.turn > 1]
    print(
        f"turns after the first: {sum(r.same_answer for r in later)}/{len(later)} answers equal "
        f"a cold run's; replay exact in {sum(r.replay_exact for r in results)}/{len(results)}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out / f"prefix-probe-{stamp}.json"
    out.write_text(json.dumps({"argv": sys.argv[1:], "turns": [asdict(r) for r in results]}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
