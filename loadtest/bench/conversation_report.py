"""Results of the conversation benchmark and their tables: TTFT per turn by system, and the
last turn against the targets of issue 30 (≤ 1.5× raw incremental prefill, ≤ llama-server).

Pure: built from :class:`TurnResult` values, which the JSON keeps (``--report-only`` re-renders).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LLAMA_SERVER",
    "NO_BUILD",
    "QUICSRV",
    "RAW_COLD",
    "RAW_INCREMENTAL",
    "SYSTEMS",
    "TurnResult",
    "render",
]

RAW_INCREMENTAL = "raw incremental"
RAW_COLD = "raw cold"
QUICSRV = "quicsrv"
QUICSRV_RESPONSES = "quicsrv responses"
LLAMA_SERVER = "llama-server"
SYSTEMS = (RAW_INCREMENTAL, RAW_COLD, QUICSRV, LLAMA_SERVER, QUICSRV_RESPONSES)

NO_BUILD = "skipped: no build (python -m loadtest.bench.llama_server_build)"

#: Issue 30's targets for the last turn: quicsrv's TTFT over the other system's.
TARGET_VS_RAW = 1.5
TARGET_VS_LLAMA_SERVER = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """One turn of one conversation with one system."""

    system: str
    repeat: int
    turn: int
    """1-based."""
    ttft_s: float
    """Request sent (or, raw, prefill started) → first content chunk (raw: first token)."""
    prompt_tokens: int | None
    """The whole history's tokens, as the system counted them (``usage.prompt_tokens``)."""
    reused_tokens: int | None
    """Prompt tokens the system did not prefill again: ``usage.prompt_tokens_details.
    cached_tokens`` (llama-server: ``timings.cache_n``), raw incremental: KV cells kept.
    None: the system does not say."""
    reusable_tokens: int | None = None
    """Raw only: the common prefix of this turn's tokens with the previous turn's prompt and
    answer, what a perfect prefix cache would keep."""
    completion_tokens: int | None = None
    others_cpu_share: float = 0.0
    """CPU other processes used during this system's whole conversation (share of machine)."""


def _median(results: Sequence[TurnResult], system: str, turn: int) -> TurnResult | None:
    mine = [r for r in results if r.system == system and r.turn == turn]
    if not mine:
        return None
    ttft = statistics.median(r.ttft_s for r in mine)
    # The other fields agree across repeats (same script, greedy); take the first's.
    return TurnResult(
        system=system,
        repeat=-1,
        turn=turn,
        ttft_s=ttft,
        prompt_tokens=mine[0].prompt_tokens,
        reused_tokens=mine[0].reused_tokens,
        reusable_tokens=mine[0].reusable_tokens,
        completion_tokens=mine[0].completion_tokens,
        others_cpu_share=max(r.others_cpu_share for r in mine),
    )


def _ms(result: TurnResult | None, skipped: str) -> str:
    return skipped if result is None else f"{result.ttft_s * 1000:.0f}"


def _count(value: int | None) -> str:
    return "–" if value is None else str(value)


def _reuse(result: TurnResult | None, skipped: str) -> str:
    if result is None:
        return skipped
    return f"{_count(result.reused_tokens)} / {_count(result.prompt_tokens)}"


def _turn_table(results: Sequence[TurnResult], turns: int, llama_server_note: str) -> list[str]:
    lines = [
        "| turn | prompt tokens | reusable prefix | raw incremental TTFT ms | raw prefilled "
        "| raw cold TTFT ms | quicsrv TTFT ms | quicsrv reused / prompt "
        "| llama-server TTFT ms | llama-server reused / prompt "
        "| quicsrv responses TTFT ms | responses reused / prompt |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|",
    ]
    skipped = "skipped" if llama_server_note else "–"
    for turn in range(1, turns + 1):
        raw = _median(results, RAW_INCREMENTAL, turn)
        cold = _median(results, RAW_COLD, turn)
        quicsrv = _median(results, QUICSRV, turn)
        llama = _median(results, LLAMA_SERVER, turn)
        chained = _median(results, QUICSRV_RESPONSES, turn)
        prefilled = (
            "–"
            if raw is None or raw.prompt_tokens is None or raw.reused_tokens is None
            else str(raw.prompt_tokens - raw.reused_tokens)
        )
        lines.append(
            f"| {turn} | {_count(raw.prompt_tokens if raw else None)} "
            f"| {_count(raw.reusable_tokens if raw else None)} | {_ms(raw, '–')} | {prefilled} "
            f"| {_ms(cold, '–')} | {_ms(quicsrv, '–')} | {_reuse(quicsrv, '–')} "
            f"| {_ms(llama, skipped)} | {_reuse(llama, skipped)} "
            f"| {_ms(chained, '–')} | {_reuse(chained, '–')} |"
        )
    return lines


def _ratio_row(
    name: str, quicsrv: TurnResult | None, other: TurnResult | None, target: float, why_not: str
) -> str:
    if quicsrv is None or other is None:
        return f"| {name} | {why_not or 'not measured'} | – |"
    ratio = quicsrv.ttft_s / other.ttft_s
    met = "yes" if ratio <= target else "**no**"
    return (
        f"| {name} | {quicsrv.ttft_s * 1000:.0f} / {other.ttft_s * 1000:.0f} ms "
        f"= {ratio:.2f}× | {met} |"
    )


def _targets(results: Sequence[TurnResult], turns: int, llama_server_note: str) -> list[str]:
    quicsrv = _median(results, QUICSRV, turns)
    reported = [r.turn for r in results if r.system == QUICSRV and r.reused_tokens is not None]
    return [
        "| target | measured | met |",
        "|---|---|---|",
        _ratio_row(
            f"turn-{turns} TTFT quicsrv ≤ {TARGET_VS_RAW}× raw incremental",
            quicsrv,
            _median(results, RAW_INCREMENTAL, turns),
            TARGET_VS_RAW,
            "",
        ),
        _ratio_row(
            f"turn-{turns} TTFT quicsrv ≤ llama-server's",
            quicsrv,
            _median(results, LLAMA_SERVER, turns),
            TARGET_VS_LLAMA_SERVER,
            llama_server_note,
        ),
        _ratio_row(
            f"turn-{turns} TTFT quicsrv responses (previous_response_id) ≤ {TARGET_VS_RAW}× raw "
            "incremental",
            _median(results, QUICSRV_RESPONSES, turns),
            _median(results, RAW_INCREMENTAL, turns),
            TARGET_VS_RAW,
            "not measured (--no-responses)",
        ),
        f"| quicsrv reports reused prompt tokens | "
        f"{'in ' + str(len(set(reported))) + ' turns' if reported else 'not reported'} "
        f"| {'yes' if reported else '**no**'} |",
    ]


def _others(results: Sequence[TurnResult]) -> str:
    parts = []
    for system in SYSTEMS:
        shares = [r.others_cpu_share for r in results if r.system == system]
        if shares:
            parts.append(f"{system} {min(shares):.0%}–{max(shares):.0%}")
    return "others' CPU during the conversations: " + (", ".join(parts) or "–")


def render(
    results: Sequence[TurnResult], *, turns: int, repeats: int, llama_server_note: str = ""
) -> str:
    """The markdown report: the per-turn table (medians over ``repeats``), the targets, and
    the others' CPU. ``llama_server_note``: why llama-server has no rows ("" if it has)."""
    lines = [
        f"{turns} turns, the whole history resent each turn; TTFT medians over {repeats} "
        "conversation(s) per system. prompt tokens and reusable prefix: the raw run's "
        "tokenization (reusable = common prefix with the previous turn's prompt + answer).",
        "",
        *_turn_table(results, turns, llama_server_note),
        "",
    ]
    if llama_server_note:
        lines += [f"llama-server: {llama_server_note}", ""]
    lines += [*_targets(results, turns, llama_server_note), "", _others(results), ""]
    return "\n".join(lines)
