"""params.yaml: its typed sections, their messages and the checks across sections."""
