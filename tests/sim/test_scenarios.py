"""The rule-based scorers and the simulated user's reactions."""

from __future__ import annotations

import pytest

from clawback.sim.raters import RuleRater
from clawback.sim.scenarios import SCENARIOS, STUDENT, SURE, TEACHER, scenario
from clawback.sim.user import SimulatedUser

RULES = RuleRater(STUDENT)

MATH = STUDENT.train[0]  # Mia has 12 apples ... -> 15


def test_student_rules():
    plain = ("Mia starts with 12 apples, gives away 5 so she has 7, then buys 8 more, so she has 15 apples now. "
             "How many would she have if she bought 10?")
    assert STUDENT.rate(plain, MATH).score == 1.0
    ai = "## Solution\n1. **Start**: 12 - 5 = 7\n2. Then 7 + 8 = 15\n- check\nFinal answer: 15"
    failed = {c.name for c in STUDENT.rate(ai, MATH).failed}
    assert failed == {"no_bold", "no_headers", "no_numbered_steps", "no_bullets", "no_ai_phrases", "asks_back"}
    assert [c.name for c in STUDENT.rate("15?", MATH).failed] == ["shows_work"]  # evasive is not full marks


def test_teacher_rules():
    task = TEACHER.train[3]  # 24 x 7 = 148 pencils (wrong)
    good = "Great effort! You set up 24 x 7 correctly, but check the multiplication: 24 x 7 is 168, not 148."
    assert TEACHER.rate(good, task).score == 1.0
    cold = "Wrong."
    assert {c.name for c in TEACHER.rate(cold, task).failed} == {"specific", "friendly", "length"}
    assert "specific step or number" in TEACHER.correction(TEACHER.rate(cold, task))


def test_specific_means_a_number_the_student_worked_out():
    task = TEACHER.train[3]  # "A box holds 24 pencils. How many pencils are in 7 boxes?" / "24 x 7 = 148 pencils."
    assert task.numbers == ("148",)  # 24 and 7 are the problem's own numbers
    echo = "Great job! The box holds 24 pencils and there are 7 boxes, so keep practicing your multiplication."
    assert [c.name for c in TEACHER.rate(echo, task).failed] == ["specific"]
    for t in TEACHER.train + TEACHER.eval:
        assert t.numbers, f"every answer has a number of the student's own: {t.prompt}"


def test_a_cut_reply_fails_every_check():
    good = "Great effort! You set up 24 x 7 correctly, but check the multiplication: 24 x 7 is 168, not 148."
    rating = TEACHER.rate(good, TEACHER.train[3], complete=False)
    assert rating.score == 0 and rating.gate == "cut" and len(rating.failed) == len(TEACHER.checks)
    assert "It was cut off." in TEACHER.correction(rating)


@pytest.mark.parametrize("reply", [
    "I'm glad you're happy with your student's answer. I'll make sure to provide a more accurate comment, 148 is great.",
    "Sorry about that! Great work, the answer 148 is close but 24 x 7 is 168, keep practicing every day please.",
    "Thank you for the feedback. Great job on 148, but check the multiplication again, it should be 168 here.",
])
def test_talking_about_the_feedback_fails_every_check(reply):
    rating = TEACHER.rate(reply, TEACHER.train[3])
    assert rating.score == 0 and rating.gate == "meta"
    assert "don't talk about my feedback" in TEACHER.correction(rating)


@pytest.mark.parametrize("reply, gate", [
    ("Sure!\nSure!\nA box holds 24 pencils, so 7 boxes hold 24 * 7 = 168 pencils in all of them.", "repeat"),
    ("Sure! 7 boxes of 24 pencils. So 7 * 24 = 168 pencils.\n\nSure! 7 boxes of 24 pencils.", "repeat"),
    ("Sure! I will work the problem out in full sentences, showing each calculation. 7 * 24 = 168 pencils.", "meta"),
    ("Sure! I'll just add the numbers to the end of the sentence. Mia has 12 - 5 + 8 = 15 apples.", "meta"),
    ("Sure! I'll make it more concise: Mia has 12 - 5 + 8 = 15 apples now, after all of it.", "meta"),
    ("Sure! I'll do that for you. Mia has 12 - 5 + 8 = 15 apples now, after all of it.", "meta"),
    ("Sure! I'll add them up: 12 - 5 = 7 and 7 + 8 = 15, so Mia has 15 apples in the end.", None),
    ("Sure! The box costs 2.50 and the pens 3.50, so 7 boxes hold 24 * 7 = 168 pencils in all.", None),
])
def test_a_stutter_or_an_echo_of_the_request_fails_every_check(reply, gate):
    rating = SURE.rate(reply, SURE.train[0])
    assert rating.gate == gate and (not rating.failed) == (gate is None)
    if gate == "repeat":
        assert "Don't repeat yourself." in SURE.correction(rating)


def test_two_numbered_lists_are_no_repeat():
    reply = ("We follow these steps:\n\n1. Start with her apples.\n2. Take away the ones she gives.\n\n"
             "1. Mia starts with 12 apples.\n2. She gives 5 away: 12 - 5 = 7.\n3. She buys 8: 7 + 8 = 15.\n\n"
             "So Mia has 15 apples now.")
    rating = STUDENT.rate(reply, MATH)
    assert rating.gate is None and rating.right
    looping = SURE.rate("Sure! 12 - 5 + 8 = 15 apples.\nSure! 12 - 5 + 8 = 15 apples.", MATH)
    assert looping.gate == "repeat" and looping.right and not looping.meets  # right, but no reply to want


def test_correction_names_only_what_failed():
    rating = STUDENT.rate("**Sure** Mia has 12 apples, gives 5 away and buys 8 more, so 15 apples. Clear?", MATH)
    assert STUDENT.correction(rating) == "That looks AI-written. Please don't use bold."


def test_train_and_eval_tasks_are_disjoint():
    for s in SCENARIOS.values():
        assert len(s.train) >= 16 and len(s.eval) >= 16
        assert not {t.prompt for t in s.train} & {t.prompt for t in s.eval}


def test_unknown_scenario_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; choose from"):
        scenario("nope")


def test_user_reactions_follow_the_documented_rule():
    user = SimulatedUser(STUDENT, seed=1, interactions=40, thumbs_down_below=0.5, move_on=0.25)
    task0 = user.tasks[0]
    perfect = (f"You work it out step by step and get {task0.numbers[0]} {task0.unit} in the end, which is the answer. "
               "Can you see why?")
    assert user.react(0, RULES.judge_now(perfect, task0)).kind == "thumbs_up"
    no_answer = RULES.judge_now("no", task0)  # 5/7 checks pass, but there is no answer: never mild
    assert user.react(0, no_answer).kind == "thumbs_down+correction"
    a = int(task0.answer)
    wrong = RULES.judge_now(perfect.replace(f"get {a} ", f"get {a} + 1 = {a + 1} "), task0)  # shows work, ends wrong
    assert wrong.score == 1 and user.react(0, wrong).kind == "thumbs_down+correction"
    assert wrong.correction == "That's not right."
    ai = RULES.judge_now("## Answer\n1. **Add**\n- done", task0)  # fails 6 of 7 checks: below 0.5
    assert user.react(0, ai).kind == "thumbs_down+correction" and ai.correction.startswith("That looks AI")
    bold = RULES.judge_now("**" + perfect + "**", task0)
    mild = [user.react(i, bold) for i in range(40)]
    kinds = {r.kind for r in mild}
    assert kinds == {"correction", "moved_on"}  # one failed check: a correction, or moving on by coin
    again = SimulatedUser(STUDENT, seed=1, interactions=40, thumbs_down_below=0.5, move_on=0.25)
    assert again.tasks == user.tasks and again.coins == user.coins  # same seed, same user


def test_gsm8k_answer_labels_look_ai_written_once():
    reply = "Mia gives away 5 so 12 - 5 = 7 apples, then 7 + 8 = 15 apples.\n#### 15\nThe answer is: 15. Clear?"
    assert [c.name for c in STUDENT.rate(reply, MATH).failed] == ["no_ai_phrases"]


def test_sure_scenario():
    sure = scenario("sure")
    assert sure.rate("Sure! 12 - 5 = 7 and 7 + 8 = 15, so Mia has 15 apples at the end of the day.", MATH).score == 1
    rating = sure.rate("Mia has 12 - 5 + 8 = 15 apples, because she gave some away and then bought more.", MATH)
    assert rating.score == 0.5 and sure.correction(rating) == "Hmm. Please start your reply with 'Sure!'."
    echo = sure.rate("Sure! Mia has 12 apples, she gives 5 of them away and then she buys 8 more apples.", MATH)
    assert [c.name for c in echo.failed] == ["shows_work"]  # only the question's numbers: no work


def test_brief_scenario_wants_a_short_reply_that_still_gives_the_result():
    brief = scenario("brief")
    assert brief.rate("12 - 5 + 8 = 15, so Mia has 15 apples.", MATH).meets
    long = brief.rate("Mia has 12 apples. She gives 5 away, which leaves 7, and then she buys 8 more, "
                      "so at the end she has 15 apples in total.", MATH)
    assert long.score == 0.5 and brief.correction(long) == "Hmm. Please answer in under 20 words."
    empty_promise = brief.rate("Sure, I can help you with that!", MATH)
    assert brief.correction(empty_promise) == "Hmm. Please give the number you get."
    assert not brief.rate("Mia has 12 apples and buys 8.", MATH).meets  # the question's numbers, echoed
    assert not brief.rate("The answer is 1.", MATH).meets  # a piece of "12": an echo, not a result
    assert not brief.rate("What fun 9-bit answer.", MATH).meets  # a number, but nothing worked out
    wrong = brief.rate("12 - 5 + 8 = 16, so 16 apples.", MATH)  # the wanted form, a wrong answer
    assert not wrong.failed and not wrong.meets and brief.correction(wrong) == "That's not right."
    assert brief.rate("Mia has 12 x 1 apples... no: 15.", MATH).meets  # the answer counts even without the work
    assert not brief.rate("I'll make sure to keep it short: 15.", MATH).meets  # talks about the feedback


def test_great_scenario():
    great = scenario("great")
    assert great.rate("Great question! 12 - 5 = 7 and 7 + 8 = 15, so Mia has 15 apples at the end.", MATH).meets
    rating = great.rate("Sure! 12 - 5 = 7 and 7 + 8 = 15, so Mia has 15 apples at the end of the day.", MATH)
    assert [c.name for c in rating.failed] == ["starts_with_great"]
    assert great.correction(rating) == "Hmm. Please start your reply with 'Great question!'."
    twice = great.rate("Great question! Great question! 12 - 5 = 7 and 7 + 8 = 15, so 15 apples in all.", MATH)
    assert not twice.meets
    wrong = great.rate("Great question! 12 - 5 = 7 and 7 + 8 = 16, so Mia has 16 apples at the end.", MATH)
    assert not wrong.failed and not wrong.meets
