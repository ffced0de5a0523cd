"""Right answers: numbers as people write them, written computations, the final answer, and the
scenarios' rules, which a reply with a wrong answer never meets."""

from __future__ import annotations

import pytest

from clawback.sim.answers import answer_right, arithmetic_holds, computations, final_answer, number_value
from clawback.sim.scenarios import ANSWER_LINE, BRIEF, PLAIN, SURE, TEACHER

MATH = SURE.train[0]  # Mia has 12 apples, gives 5 away, buys 8 -> 15


def test_every_task_carries_its_verified_answer():
    assert MATH.answer == "15" and TEACHER.train[0].answer == "15"
    assert all(t.answer for s in (SURE, TEACHER) for t in s.train + s.eval)


@pytest.mark.parametrize("text, value", [
    ("1,200", 1200), ("1200.0", 1200), ("$21", 21), ("twenty-one", 21), ("one hundred and five", 105),
    ("fifteen", 15), ("two thousand five hundred fifty", 2550), ("$ 2.50", 2.5),
])
def test_numbers_as_people_write_them(text, value):
    assert number_value(text) == value


@pytest.mark.parametrize("reply, verdicts", [
    ("So, 14 cakes x 3 eggs per cake = 36 eggs.", [False]),
    ("78 muffins fill 6 x 6 = 36 boxes.", [True]),  # the run of numbers that ends before "="
    ("3 x 16 - 9 = 39", [True]),  # the usual precedence
    ("2 x (3 + 4) = 14", [True]),  # parentheses
    ("25 minutes * 12 days = 300 minutes", [True]),  # words between numbers are skipped
    ("$2.50 x 4 = $10 and 1,200 / 4 = 300", [True, True]),
    ("5 x 4 = 20 x 2 = 40", [True, True]),  # a running chain: each "=" closes its own computation
    ("3 \\times 16 - 9 = 48 - 9 = 39", [True, True]),  # a chain of equal values
    ("3 x 16 - 9 = 48 - 9 = 40", [True, False]),
    ("10 / 3 = 3.33", [True]),  # rounded to the places written
    ("-3 + 5 = 2, then 4 - 3 = 2", [True, False]),
    ("Distance:\n   - 850 km/h × 3 hours = 2550 km", [True]),  # a list marker is not a minus
    ("* 850 x 3 = 2550\n+ 20 - 5 = 15\n- 2 = 3 - 1 = 4", [True, True, False]),  # "- 2 =" computes nothing
    ("- 3 + 5 = -2", [False]),  # "- " opening a line is a list marker: 3 + 5 is not -2
    ("1/0 = 4", [False]),
    ("150x1=200", [False]),  # "x" between digits multiplies: read, and wrong
    ("12 + 5 = 17 apples", [True]),  # the sum holds; the answer to the task is another matter
    ("12 + 5 = ?", [False]),  # a result that is not a number cannot be right
    ("twelve minus five = 7", [True]),
    ("\\[ 15 \\text{ pages/day} \\times 6 \\text{ days} = 90 \\text{ pages} \\]", [True]),  # LaTeX; "/" in a unit
    ("\\frac{96}{8} = 12", [True]),
    ("24 \\div 7 = 3.6857142857142857", [False]),
    ("1200 - 1 = 1200\n1200 / 12 = 120\n1200 * 5 = 600", [False, False, False]),
    ("She has 7 apples = 7. x = 5", []),  # no operator: nothing is computed
])
def test_written_computations_are_checked(reply, verdicts):
    assert computations(reply) == verdicts
    assert arithmetic_holds(reply) == all(verdicts)


@pytest.mark.parametrize("reply, answer", [
    ("So she has 15 apples now.", 15),
    ("Answer: 1,200", 1200),
    ("The answer is $21.", 21),
    ("She has twenty-one stickers.", 21),
    ("It is 1200.0 steps.", 1200),
    ("Therefore, the number of apples Mia has now is \\(\\boxed{15}\\).", 15),
    ("Final Answer: \\boxed{15}", 15),
    ("12 - 5 = 7\n#### 15", 15),
    ("So 12 - 5 + 8 = 15 apples. Can you try 12 - 3?", 15),  # a question after it is not the answer
    ("Mia has 15 apples.\n\nI hope this helps!", 15),
    ("She has 12 - 5 + 8 = 15 apples, 3 more than she had.", 15),  # the number after the last "="
    ("12 + 5 = 17 apples", 17),
    ("Sure! 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15.", None),  # a list is not an answer
    ("Sure! Let's count: 13, 14, 15, 16, 17.", None),
    ("Sure, I can help with that!", None),
])
def test_the_final_answer(reply, answer):
    assert final_answer(reply) == answer


def test_a_concluding_sentence_answers_with_the_number_it_adds_to_the_question():
    question = "A class has 28 students. They sit in groups of 4. How many groups are there?"
    assert final_answer("28 ÷ 4 = 7\n\nSo, there are 7 groups of 4 students.", question) == 7
    assert final_answer("So, there are 28 students in groups of 4.", question) == 4  # nothing new: the last
    assert final_answer("Jack runs 42 kilometers in 14 days.", "Jack runs 3 km. How far in 2 weeks?") == 42


# What passed the rules while the answer was wrong; each must now fail.
WRONG = [
    (SURE, "Sure! 1 + 1 = 3 and that is all I have to say about it now."),
    (SURE, "Surely not. I think that 2 - 1 = 9 and so the apples are all gone by the end of the day."),
    (SURE, "sure sure sure, here we go: she has 3 + 3 = 6 apples at the end of the day, I think."),
    (SURE, "Sure! Let's count the apples one by one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17"),
    (SURE, "Sure! Let's count them together now: 10, 11, 12, 13, 14, 15"),
    (SURE, "Sure! Mia gives 5 away and buys 8 more, so she has 12 + 5 = 17 apples at the end of the day."),
    (SURE, "Sure! Mia has 12 apples. She gives 5 away and buys 8, so 12 - 5 + 8 = 15 apples, 150x1=200."),
    (SURE, "Sure! 12 - 5 = 6 and then 6 + 8 = 15, so Mia has 15 apples at the end of the day."),
    (BRIEF, "1 + 1 = 2"),
    (BRIEF, "12 - 5 + 8 = 16, so 16 apples."),
    (ANSWER_LINE, "12 - 5 = 7 and 7 + 8 = 15.\nAnswer: 42"),
    (PLAIN, "Mia starts with 12 apples and gives 5 away, so she has 12 - 5 = 7, then buys 8: 7 + 8 = 16."),
]

RIGHT = [
    (SURE, "Sure! 12 - 5 = 7 and 7 + 8 = 15, so Mia has 15 apples at the end of the day."),
    (SURE, "Sure, let's work it out. Mia starts with 12 apples, gives away five and buys eight, "
           "so she ends up with 15 apples."),
    (BRIEF, "12 - 5 + 8 = 15, so Mia has 15 apples."),
    (ANSWER_LINE, "She gives away 5 apples, so 12 - 5 = 7. Then she buys 8 more: 7 + 8 = 15.\nAnswer: 15"),
    (PLAIN, "Mia starts with 12 apples and gives 5 away, so she has 12 - 5 = 7, then buys 8: 7 + 8 = 15 apples."),
]


@pytest.mark.parametrize("scen, reply", WRONG)
def test_a_wrong_answer_never_meets(scen, reply):
    rating = scen.rate(reply, MATH)
    assert not rating.meets and not rating.right


@pytest.mark.parametrize("scen, reply", RIGHT)
def test_a_right_answer_in_the_wanted_form_meets(scen, reply):
    rating = scen.rate(reply, MATH)
    assert rating.meets and rating.right and rating.score == 1


def test_a_wrong_answer_in_the_wanted_form_is_called_wrong():
    rating = SURE.rate("Sure! Mia has 12 - 5 = 7 and then 7 + 8 = 16 apples at the end of the day.", MATH)
    assert rating.score == 1 and not rating.meets and SURE.correction(rating) == "That's not right."
    both = SURE.rate("Mia has 12 - 5 = 7 and then 7 + 8 = 16 apples at the end of the day, I think.", MATH)
    assert SURE.correction(both) == "Hmm. Please start your reply with 'Sure!'."  # the form first


def test_answer_line_and_plain_rules():
    assert not ANSWER_LINE.rate("12 - 5 + 8 = 15.\nAnswer: 15 apples", MATH).meets  # not the answer alone
    assert not ANSWER_LINE.rate("Answer: 15\n\nI hope this helps!", MATH).meets  # not the last line
    assert not ANSWER_LINE.rate("12 - 5 + 8 = 15.\n**Answer: 15**", MATH).meets
    for markup in ("1. Mia has 12 - 5 = 7 apples left after giving some of them away to her brother, then 15.",
                   "Mia has \\(12 - 5 + 8 = 15\\) apples at the end of the day, after all of that happened.",
                   "**Mia** has 12 - 5 + 8 = 15 apples at the end of the day, after all of that happened."):
        assert [c.name for c in PLAIN.rate(markup, MATH).failed] == ["plain_text"]


def test_a_grading_comment_is_right_when_its_arithmetic_holds():
    task = TEACHER.train[3]  # "24 x 7 = 148 pencils." (168)
    good = "Great effort on setting it up as 24 x 7, but 24 x 7 = 168, not 148, so check the multiplication."
    assert TEACHER.rate(good, task).meets
    assert not TEACHER.rate(good.replace("= 168", "= 148"), task).meets
    assert answer_right("So 12 - 5 + 8 = 15.", "15") and not answer_right("So 12 - 5 + 8 = 15.", "16")
    assert answer_right("She ends up with twenty-one.", "21")

