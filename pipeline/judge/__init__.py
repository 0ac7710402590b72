"""The judge stage's parts (the stage itself: pipeline/stages/judge.py)."""
