"""The request bodies' models (``portattn.server.protocol``) on their own: each form a completion's prompt may
take comes out as that form, the union's order that keeps token ids cheap to validate, and NaN or infinities
refused as not finite."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from portattn.server.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", ["hi"]),
        ([5, 6, 7], [[5, 6, 7]]),
        (["a", "b"], ["a", "b"]),
        (["1", "2"], ["1", "2"]),  # digits stay text: not token ids
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_prompt_form_comes_out_as_given(prompt, expected):
    prompts = CompletionRequest.model_validate({"prompt": prompt}).prompts()
    assert prompts == expected
    assert [type(p) for p in prompts] == [type(e) for e in expected]
    for got, want in zip(prompts, expected, strict=True):
        if isinstance(want, list):
            assert [type(x) for x in got] == [type(x) for x in want]


def test_token_ids_are_tried_before_lists_of_strings_and_a_wrong_type_names_the_string():
    # pydantic tries the union's members in order; list[str] before list[int] made 1,024 ids 9x slower to check
    members = typing.get_args(CompletionRequest.model_fields["prompt"].annotation)
    assert members.index(list[int]) < members.index(list[str]), members
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": 5})
    assert info.value.errors()[0]["msg"] == "Input should be a valid string"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p", "repetition_penalty"])
def test_nan_and_infinities_are_refused_as_not_finite(field, value):
    chat = {"messages": [{"role": "user"}]}
    for model, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, chat)):
        with pytest.raises(ValidationError) as info:
            model.model_validate({**body, field: value})
        error = info.value.errors()[0]
        assert error["loc"] == (field,) and error["msg"] == "Input should be a finite number", error
