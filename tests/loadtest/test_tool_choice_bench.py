"""The tool-choice bench's own logic (no server): its questions and its table."""

from __future__ import annotations

from loadtest.bench.tool_choice import QUESTIONS, render


def test_the_suite_s_question_is_asked_word_for_word_beside_questions_no_tool_fits() -> None:
    suite = QUESTIONS[0]
    assert suite.text == "What's the weather like in San Francisco?" and suite.fits
    assert suite.tool["function"]["name"] == "get_weather"
    assert any(q.fits for q in QUESTIONS[1:]) and any(not q.fits for q in QUESTIONS)


def test_the_table_shows_each_server_s_calls_out_of_n() -> None:
    counts = {"quicsrv": [2, 7, 5, 6, 2, 0], "llama-server": [0] * 6}
    table = render(counts, 12, "# run").splitlines()
    assert table[2] == "| question | a tool fits | quicsrv: calls | llama-server: calls |"
    assert table[4] == "| suite: weather in SF | yes | 2/12 | 0/12 |"
    assert table[-1] == "| a capital | no | 0/12 | 0/12 |"
