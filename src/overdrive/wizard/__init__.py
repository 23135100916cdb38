"""`overdrive config`: the interactive questions (questions.py) and the files they become (files.py)."""
