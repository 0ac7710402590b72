"""params.yaml: its typed sections, their messages and the checks across sections; the suite registry (what each suite
folder of evals/ declares, which `suites.<name>.task` names)."""
