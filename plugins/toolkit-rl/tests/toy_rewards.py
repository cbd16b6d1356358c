"""A reward with spread on an untrained model (a user's ``--reward file.py:function``): completions differ in it."""


def vowels(prompts, completions, completion_ids, **columns):
    return [sum(c in "aeiou" for c in text.lower()) / 4 for text in completions]
