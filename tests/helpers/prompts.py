"""The reference prompts the engine tests generate from: short, varied (prose, code, lists, other
languages, markup), one greedy continuation each."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Write a haiku about the sea.",
    "1, 1, 2, 3, 5, 8,",
    "Le chat est",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n",
    "In 1969, astronauts",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process by which",
    "My favourite fruit is",
    "<html>\n  <body>\n",
    "The quick brown fox",
    "List three prime numbers:",
]
