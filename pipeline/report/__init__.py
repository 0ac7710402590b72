"""The report stage's parts (the stage itself: pipeline/stages/report.py)."""
