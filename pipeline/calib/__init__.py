"""The calib stage's parts (the stage itself: pipeline/stages/calib.py)."""
