"""The `quantize` command: its launcher, the typer app, the commands and what they share."""
