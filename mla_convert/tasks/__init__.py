"""Tasks a converted model is judged on as users judge it: HumanEval (program synthesis), run safely."""
