"""The files stages hand each other, one reader and one writer per format: holdout.jsonl (held-out
conversations), calib.jsonl (token blocks), result lines (per-item answers), quant.json (a variant's
record), and the one way a conversation is rendered with a checkpoint's chat template; checked_json
holds the small schema language their readers (and the report's) check JSON with."""
