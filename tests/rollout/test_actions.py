"""Reading a policy turn: one action, reasoning ignored, every malformed turn named."""

import pytest

from grouprl.rollout.actions import STOP_STRINGS, parse_action


@pytest.mark.parametrize(
    "text, kind, argument",
    [
        ("<search>eiffel tower height</search>", "search", "eiffel tower height"),
        ("<think>I need the height.</think>\n<search> eiffel tower </search>", "search", "eiffel tower"),
        ("<bbox>[10, 20, 110, 220]</bbox>", "bbox", "[10, 20, 110, 220]"),
        ("<search_complete>true</search_complete>", "search_complete", "true"),
        ("<search_complete> True </search_complete>", "search_complete", "True"),
        ("<answer>324 m</answer>", "answer", "324 m"),
        # the token that completed the stop string may carry text past it
        ("<search>q</search>\n<|im", "search", "q"),
        # a tag quoted inside a closed <think> block is reasoning, not the action
        ("<think>maybe <search>wrong</search>?</think><search>right</search>", "search", "right"),
        ("<search>multi\nline</search>", "search", "multi\nline"),
    ],
)
def test_valid_actions(text, kind, argument):
    action = parse_action(text)
    assert (action.kind, action.argument, action.error, action.multiple) == (kind, argument, None, False)
    assert action.valid


def test_two_actions_take_the_first_and_flag_it():
    action = parse_action("<search>first</search><bbox>[0, 0, 1, 1]</bbox>")
    assert (action.kind, action.argument, action.multiple, action.valid) == ("search", "first", True, True)
    # first by position in the text, whatever the tag
    action = parse_action("<bbox>[0, 0, 1, 1]</bbox> then <search>x</search>")
    assert (action.kind, action.argument, action.multiple) == ("bbox", "[0, 0, 1, 1]", True)


@pytest.mark.parametrize(
    "text, kind, error",
    [
        ("I think the answer is 3.", None, "no_action"),
        ("", None, "no_action"),
        ("<think>only thinking</think>", None, "no_action"),
        ("<think>unclosed thinking and nothing else", None, "no_action"),
        ("<search>never closed", "search", "unclosed_tag"),
        ("<bbox>[1, 2", "bbox", "unclosed_tag"),
        ("<search>mismatched</bbox>", "search", "unclosed_tag"),
        ("query</search>", None, "malformed_tag"),
        ("<search>   </search>", "search", "empty_argument"),
        ("<bbox></bbox>", "bbox", "empty_argument"),
        ("<answer>\n</answer>", "answer", "empty_argument"),
        ("<search_complete>false</search_complete>", "search_complete", "bad_search_complete"),
        ("<search_complete></search_complete>", "search_complete", "bad_search_complete"),
        ("<Search>caps are not the protocol</Search>", None, "no_action"),
    ],
)
def test_invalid_turns_name_their_error(text, kind, error):
    action = parse_action(text)
    assert (action.kind, action.error) == (kind, error)
    assert not action.valid


def test_every_action_has_a_stop_string_and_think_has_none():
    assert set(STOP_STRINGS) == {"</search>", "</bbox>", "</search_complete>", "</answer>"}
