"""One module per stage of dvc.yaml: what the stage reads, runs and writes, and its result."""
