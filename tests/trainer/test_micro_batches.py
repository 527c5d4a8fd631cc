"""plan_micro_batches on hand-worked cases: row counts, token budgets, split groups, padding order."""

from grouprl.trainer.micro_batches import plan_micro_batches

# three groups: prompt A (3 tokens) rows 0-3, prompt B (5 tokens) rows 4-5, prompt C (2 tokens) rows 6-8
A, B, C = [1, 2, 3], [4, 5, 6, 7, 8], [9, 10]
PROMPTS = [A] * 4 + [B] * 2 + [C] * 3
LENGTHS = [2, 9, 4, 1, 3, 3, 6, 6, 5]  # response tokens per row


def plan(**kw):
    units = plan_micro_batches(list(range(len(PROMPTS))), PROMPTS, LENGTHS, **kw)
    return [(u.prompts, u.micro_batches) for u in units]


def test_row_count_packs_whole_groups_and_splits_a_large_one():
    # groups ordered by longest response: A (9), C (6), B (3); rows longest first inside a group
    assert plan(max_rows=4) == [
        ([A], [[1, 2, 0, 3]]),
        ([C], [[6, 7, 8]]),  # C + B would be 5 rows
        ([B], [[4, 5]]),
    ]
    assert plan(max_rows=5) == [([A], [[1, 2, 0, 3]]), ([C, B], [[6, 7, 8, 4, 5]])]
    # A does not fit in 3 rows: one prefix unit, two micro-batches reusing it
    assert plan(max_rows=3) == [([A], [[1, 2, 0], [3]]), ([C], [[6, 7, 8]]), ([B], [[4, 5]])]
    assert plan(max_rows=100) == [([A, C, B], [[1, 2, 0, 3, 6, 7, 8, 4, 5]])]


def test_token_budget_counts_distinct_prompts_and_padded_responses():
    # A alone: 3 prompt + 4 rows x 9 = 39; A + C: 2 prompts x 3 + 7 rows x 9 = 69
    # C: 2 + 3 x 6 = 20; C + B: 2 prompts x 5 + 5 rows x 6 = 40
    assert plan(max_rows=1, max_tokens=39) == [([A], [[1, 2, 0, 3]]), ([C], [[6, 7, 8]]), ([B], [[4, 5]])]
    assert plan(max_rows=1, max_tokens=40) == [([A], [[1, 2, 0, 3]]), ([C, B], [[6, 7, 8, 4, 5]])]
    assert plan(max_rows=1, max_tokens=38) == [
        ([A], [[1, 2, 0], [3]]),  # 38 - 3 = 35 for A's responses: 3 rows x 9 = 27, 4 x 9 = 36
        ([C], [[6, 7, 8]]),  # 2 + 3 x 6 = 20; + B would be 2 x 5 + 5 x 6 = 40
        ([B], [[4, 5]]),
    ]
    assert plan(max_rows=1, max_tokens=69) == [([A, C], [[1, 2, 0, 3, 6, 7, 8]]), ([B], [[4, 5]])]


def test_a_row_over_the_budget_still_gets_its_own_micro_batch():
    units = plan(max_rows=1, max_tokens=5)
    # A's responses get 5 - 3 = 2 tokens: rows 0 (2) fits alone, 0 + 3 would be 2 x 2 = 4
    assert [m for _, micro in units for m in micro] == [[1], [2], [0], [3], [6], [7], [8], [4], [5]]
    assert sorted(r for _, micro in units for m in micro for r in m) == list(range(9))


def test_without_shared_prefix_rows_are_packed_alone_by_full_width():
    units = plan_micro_batches(
        list(range(9)), PROMPTS, LENGTHS, max_rows=1, max_tokens=24, shared_prefix=False
    )
    # widths (prompt + response) in planning order 1:12 2:7 0:5 3:4 6:8 7:8 8:7 4:8 5:8;
    # rows x widest: [1, 2] = 24, [0, 3, 6] = 24, [7, 8, 4] = 24, [5]; groups do not matter here
    assert [u.micro_batches for u in units] == [[[1, 2]], [[0, 3, 6]], [[7, 8, 4]], [[5]]]
    assert all(len(u.micro_batches) == 1 for u in units)


def test_prompt_of_row_points_into_the_units_prompts():
    for unit in plan_micro_batches(list(range(9)), PROMPTS, LENGTHS, max_rows=5):
        for row in unit.rows:
            assert unit.prompts[unit.prompt_of_row[row]] == PROMPTS[row]


def test_a_subset_of_rows_and_empty_input():
    units = plan_micro_batches([4, 5, 0], PROMPTS, LENGTHS, max_rows=8)
    assert [(u.prompts, u.micro_batches) for u in units] == [([B, A], [[4, 5, 0]])]
    assert plan_micro_batches([], PROMPTS, LENGTHS, max_rows=8) == []
