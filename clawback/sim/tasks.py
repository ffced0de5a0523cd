"""Tasks written for the simulator: short math word problems and short student answers.

Each list is split once into train (what the simulated user asks while the policy learns) and
held-out eval (what the score is measured on; never asked during training).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str  # the correct result, as digits
    unit: str  # the word a reply should name its result in


@dataclass(frozen=True)
class StudentAnswer:
    problem: MathProblem
    answer: str  # what the student wrote (some are wrong on purpose)


def _p(question: str, answer: str, unit: str) -> MathProblem:
    return MathProblem(question, answer, unit)


PROBLEMS: tuple[MathProblem, ...] = (
    _p("Mia has 12 apples. She gives 5 to her brother and buys 8 more. How many apples does she have now?", "15", "apples"),
    _p("A bus carries 45 people. At the first stop 12 get off and 7 get on. How many people are on the bus?", "40", "people"),
    _p("Tom reads 15 pages a day. How many pages does he read in 6 days?", "90", "pages"),
    _p("A box holds 24 pencils. How many pencils are in 7 boxes?", "168", "pencils"),
    _p("Sara saves 8 dollars every week. How many weeks does she need to save 96 dollars?", "12", "weeks"),
    _p("A rope is 50 meters long. It is cut into 5 equal pieces. How long is each piece?", "10", "meters"),
    _p("A farmer has 36 cows and buys 14 more, then sells 20. How many cows are left?", "30", "cows"),
    _p("A train travels 60 kilometers per hour. How far does it go in 4 hours?", "240", "kilometers"),
    _p("Ben has 3 bags with 16 marbles each. He loses 9 marbles. How many marbles does he have?", "39", "marbles"),
    _p("A pizza is cut into 8 slices. How many slices are there in 9 pizzas?", "72", "slices"),
    _p("A class has 28 students. They sit in groups of 4. How many groups are there?", "7", "groups"),
    _p("Lisa bakes 5 trays of cookies with 12 cookies on each tray. She eats 6. How many cookies are left?", "54", "cookies"),
    _p("A shirt costs 25 dollars. How much do 4 shirts cost?", "100", "dollars"),
    _p("A tank holds 200 liters of water. 75 liters are used. How many liters are left?", "125", "liters"),
    _p("A garden has 6 rows of 9 tomato plants. How many tomato plants are there?", "54", "plants"),
    _p("Jack runs 3 kilometers every morning. How far does he run in 2 weeks?", "42", "kilometers"),
    _p("A school orders 150 books and gives them equally to 6 classes. How many books does each class get?", "25", "books"),
    _p("Emma had 80 stickers. She gave away a quarter of them. How many stickers does she have now?", "60", "stickers"),
    _p("A movie lasts 2 hours and 15 minutes. How many minutes is that?", "135", "minutes"),
    _p("A shop sells 34 ice creams in the morning and 48 in the afternoon. How many ice creams did it sell?", "82", "ice creams"),
    _p("A car uses 6 liters of fuel per 100 kilometers. How much fuel does it use for 300 kilometers?", "18", "liters"),
    _p("There are 5 shelves with 18 toys each. 23 toys are sold. How many toys are left?", "67", "toys"),
    _p("A baker uses 3 eggs for each cake. How many eggs does he need for 14 cakes?", "42", "eggs"),
    _p("Noah earns 12 dollars an hour. How much does he earn in 7 hours?", "84", "dollars"),
    _p("A library has 320 books. It lends out 85 and gets 40 back. How many books are in the library?", "275", "books"),
    _p("A bike wheel turns 30 times a minute. How many turns does it make in 9 minutes?", "270", "turns"),
    _p("A jar has 72 candies shared equally among 8 children. How many candies does each child get?", "9", "candies"),
    _p("A field is 40 meters long and 25 meters wide. What is its area?", "1000", "square meters"),
    _p("Anna walks 1200 steps to school and back home each day. How many steps does she walk in 5 days?", "6000", "steps"),
    _p("A bottle holds 750 milliliters. How many milliliters are in 4 bottles?", "3000", "milliliters"),
    _p("A farmer plants 7 rows of 13 corn plants. How many corn plants are there?", "91", "plants"),
    _p("Kim has 45 dollars and spends 17 dollars on a book. How much money does she have left?", "28", "dollars"),
    _p("A pool is filled at 9 liters per minute. How many liters are in it after 20 minutes?", "180", "liters"),
    _p("There are 96 chairs set out in 8 equal rows. How many chairs are in each row?", "12", "chairs"),
    _p("A hen lays 5 eggs a week. How many eggs do 11 hens lay in a week?", "55", "eggs"),
    _p("Leo had 140 cards. He gave 35 to his friend and got 18 from his sister. How many cards does he have?", "123", "cards"),
    _p("A rectangle is 14 centimeters long and 6 centimeters wide. What is its perimeter?", "40", "centimeters"),
    _p("A bakery sells muffins in boxes of 6. How many boxes are needed for 78 muffins?", "13", "boxes"),
    _p("A plane flies 850 kilometers an hour. How far does it fly in 3 hours?", "2550", "kilometers"),
    _p("Zoe practices piano 25 minutes a day. How many minutes does she practice in 12 days?", "300", "minutes"),
    _p("A team scored 18 points in the first half and 27 in the second. How many points did it score?", "45", "points"),
    _p("A packet has 36 crayons. 4 children share it equally. How many crayons does each child get?", "9", "crayons"),
    _p("A car park has 12 rows of 15 spaces. 49 spaces are taken. How many spaces are free?", "131", "spaces"),
    _p("A book has 264 pages. Max has read 119 pages. How many pages are left?", "145", "pages"),
    _p("Each bag of rice weighs 5 kilograms. How much do 17 bags weigh?", "85", "kilograms"),
    _p("A school bus makes 4 trips a day with 38 children each trip. How many children ride in a day?", "152", "children"),
    _p("A gardener has 100 seeds and plants 8 in each pot. How many full pots can she plant?", "12", "pots"),
    _p("Ella buys 3 notebooks at 4 dollars each and a pen for 2 dollars. How much does she spend?", "14", "dollars"),
    _p("A clock ticks 60 times a minute. How many times does it tick in 15 minutes?", "900", "ticks"),
    _p("A shop had 230 balloons, sold 145 and then got 60 more. How many balloons does it have?", "145", "balloons"),
)

# Student answers: the problem plus what a student handed in (right and wrong ones).
STUDENT_ANSWERS: tuple[StudentAnswer, ...] = (
    StudentAnswer(PROBLEMS[0], "12 - 5 = 7, then 7 + 8 = 15. She has 15 apples."),
    StudentAnswer(PROBLEMS[1], "45 - 12 = 33 and 33 + 7 = 40. There are 40 people."),
    StudentAnswer(PROBLEMS[2], "15 + 6 = 21 pages."),
    StudentAnswer(PROBLEMS[3], "24 x 7 = 148 pencils."),
    StudentAnswer(PROBLEMS[4], "96 / 8 = 12 weeks."),
    StudentAnswer(PROBLEMS[5], "50 x 5 = 250 meters."),
    StudentAnswer(PROBLEMS[6], "36 + 14 = 50, 50 - 20 = 30 cows."),
    StudentAnswer(PROBLEMS[7], "60 x 4 = 240 km."),
    StudentAnswer(PROBLEMS[8], "16 x 3 = 48, 48 - 9 = 39 marbles."),
    StudentAnswer(PROBLEMS[9], "8 + 9 = 17 slices."),
    StudentAnswer(PROBLEMS[10], "28 / 4 = 7 groups."),
    StudentAnswer(PROBLEMS[11], "5 x 12 = 60, 60 - 6 = 56 cookies."),
    StudentAnswer(PROBLEMS[12], "25 x 4 = 100 dollars."),
    StudentAnswer(PROBLEMS[13], "200 - 75 = 135 liters."),
    StudentAnswer(PROBLEMS[14], "6 x 9 = 54 plants."),
    StudentAnswer(PROBLEMS[15], "3 x 7 = 21 km."),
    StudentAnswer(PROBLEMS[16], "150 / 6 = 25 books."),
    StudentAnswer(PROBLEMS[17], "80 / 4 = 20 stickers."),
    StudentAnswer(PROBLEMS[18], "2 x 60 = 120, 120 + 15 = 135 minutes."),
    StudentAnswer(PROBLEMS[19], "34 + 48 = 72 ice creams."),
    StudentAnswer(PROBLEMS[20], "300 / 100 = 3, 3 x 6 = 18 liters."),
    StudentAnswer(PROBLEMS[21], "5 x 18 = 90, 90 - 23 = 67 toys."),
    StudentAnswer(PROBLEMS[22], "3 + 14 = 17 eggs."),
    StudentAnswer(PROBLEMS[23], "12 x 7 = 84 dollars."),
    StudentAnswer(PROBLEMS[24], "320 - 85 = 235, 235 + 40 = 275 books."),
    StudentAnswer(PROBLEMS[25], "30 x 9 = 360 turns."),
    StudentAnswer(PROBLEMS[26], "72 / 8 = 9 candies."),
    StudentAnswer(PROBLEMS[27], "40 + 25 = 65 square meters."),
    StudentAnswer(PROBLEMS[28], "1200 x 5 = 6000 steps."),
    StudentAnswer(PROBLEMS[29], "750 x 4 = 2800 milliliters."),
    StudentAnswer(PROBLEMS[30], "7 x 13 = 91 plants."),
    StudentAnswer(PROBLEMS[31], "45 - 17 = 32 dollars."),
    StudentAnswer(PROBLEMS[32], "9 x 20 = 180 liters."),
    StudentAnswer(PROBLEMS[33], "96 - 8 = 88 chairs."),
    StudentAnswer(PROBLEMS[34], "5 x 11 = 55 eggs."),
    StudentAnswer(PROBLEMS[35], "140 - 35 = 105, 105 + 18 = 123 cards."),
    StudentAnswer(PROBLEMS[36], "14 x 6 = 84 centimeters."),
    StudentAnswer(PROBLEMS[37], "78 / 6 = 13 boxes."),
    StudentAnswer(PROBLEMS[38], "850 x 3 = 2550 km."),
    StudentAnswer(PROBLEMS[39], "25 x 12 = 250 minutes."),
    StudentAnswer(PROBLEMS[40], "18 + 27 = 45 points."),
    StudentAnswer(PROBLEMS[41], "36 / 4 = 9 crayons."),
    StudentAnswer(PROBLEMS[42], "12 x 15 = 180, 180 - 49 = 131 spaces."),
    StudentAnswer(PROBLEMS[43], "264 - 119 = 155 pages."),
    StudentAnswer(PROBLEMS[44], "5 x 17 = 85 kilograms."),
    StudentAnswer(PROBLEMS[45], "4 + 38 = 42 children."),
    StudentAnswer(PROBLEMS[46], "100 / 8 = 12, with 4 seeds left over, so 12 pots."),
    StudentAnswer(PROBLEMS[47], "3 x 4 = 12, 12 + 2 = 14 dollars."),
)

# How many of each list are held out for evaluation (the last ones; the rest are train tasks).
EVAL_PROBLEMS = 16
EVAL_ANSWERS = 16
