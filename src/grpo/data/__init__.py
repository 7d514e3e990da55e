"""Problems: their sources, their splits and what an answer to one means.

    sources.py               gsm8k, reasoning-gym, arithmetic, jsonl; splits held out by content; build_prompt()
    arithmetic.py            expressions, their evaluator and the generator of labelled problems
    answers.py               each evaluated answer's failure class and accuracy by operand digits
    split_sizes.py, split_check.py   the rows each source really has; a preset's splits checked against them

May import: grpo.core, grpo.algorithm.
"""
