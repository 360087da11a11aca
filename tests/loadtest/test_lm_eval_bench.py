"""The lm-evaluation-harness run's pure parts: the tasks' data (the committed files are the
seeded generator's output), the reference's echo alignment, the lm_eval command line, the
per-item comparison and its table. lm-eval itself is never run here (its own venv, minutes)."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.bench.llama_cpp_reference import prompt_logprobs
from loadtest.bench.lm_eval_run import (
    compare_choices,
    compare_generations,
    lm_eval_argv,
    render,
)
from loadtest.eval import make_tasks


def test_the_committed_task_data_is_the_generator_s_output() -> None:
    for name, text in make_tasks.rendered().items():
        assert (make_tasks.DATA / name).read_text() == text, (
            "run python -m loadtest.eval.make_tasks"
        )


def test_the_items_are_well_formed_and_distinct() -> None:
    items = make_tasks.multiple_choice_items()
    assert len(items) == 300 and len({i["question"] for i in items}) == 300
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == 4
        assert 0 <= item["answer"] < 4
    generation = make_tasks.generation_items()
    assert len(generation) == 100 and all(g["prompt"].endswith("\nA:") for g in generation)


def test_the_reference_reads_each_token_from_the_row_before_it() -> None:
    """Row i of the logits predicts token i + 1: token 1's log-probability comes from row 0,
    the generated token is row 2's argmax (llama-cpp-python's server pairs token i with row i)."""
    scores = np.log(
        np.array(
            [[0.1, 0.7, 0.2], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [1.0, 1.0, 1.0]],
            dtype=np.float32,
        )
    )
    values, tops, generated = prompt_logprobs(scores, [2, 1, 0], top_n=1)
    assert generated == 2
    assert values[0] is None and tops[0] is None
    assert values[1:] == pytest.approx([np.log(0.7), np.log(0.5), np.log(0.6)], rel=1e-6)
    assert tops[1] == pytest.approx({1: np.log(0.7)})
    assert tops[2] == pytest.approx({0: np.log(0.5)})
    assert tops[3] == pytest.approx({2: np.log(0.6)})


def test_lm_eval_sends_text_prompts_one_at_a_time(tmp_path) -> None:
    argv = lm_eval_argv(
        tmp_path / "lm_eval",
        completions_url="https://localhost:1/v1/completions",
        model="m",
        tokenizer=tmp_path / "tok",
        tasks=["quicsrv_mc"],
        output=tmp_path / "out",
        limit=5,
    )
    model_args = argv[argv.index("--model_args") + 1].split(",")
    assert argv[argv.index("--model") + 1] == "local-completions"
    assert {"tokenized_requests=False", "num_concurrent=1", "max_retries=1"} <= set(model_args)
    assert argv[-2:] == ["--limit", "5"] and "--log_samples" in argv


def _mc(doc_id: int, lls: list[float], acc: float) -> dict:
    return {"doc_id": doc_id, "filtered_resps": [[str(x), "False"] for x in lls], "acc": acc}


def test_the_comparison_finds_the_largest_difference_and_the_disagreements() -> None:
    ours = [_mc(0, [-1.0, -2.0], 1.0), _mc(1, [-3.0, -2.9], 0.0)]
    theirs = [_mc(0, [-1.01, -2.0], 1.0), _mc(1, [-2.8, -2.9], 1.0)]
    result = compare_choices(ours, theirs, tolerance=0.05)
    assert result.items == 2 and result.same_choice == 1
    assert result.max_abs_diff == pytest.approx(0.2)
    assert result.within_tolerance == 3 and result.continuations == 4
    assert result.accuracy == (0.5, 1.0)
    assert [d["doc_id"] for d in result.disagreements] == [1]
    with pytest.raises(ValueError):
        compare_choices(ours, theirs[:1], tolerance=0.05)
    gen = compare_generations(
        [{"doc_id": 0, "resps": [[" 7"]], "exact_match": 1.0}],
        [{"doc_id": 0, "resps": [[" 8"]], "exact_match": 0.0}],
    )
    assert gen.same_text == 0 and gen.exact_match == (1.0, 0.0)
    table = render(result, gen, tolerance=0.05, heading="h", wall_s={"quicsrv": 1.0})
    assert "same choice on 1/2" in table and "max 0.2" in table and "same text on 0/1" in table
