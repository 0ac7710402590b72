"""The CSS class of each decision label (its colour on the page, in the template's stylesheet)."""

DECISION_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive", "UNINFORMATIVE": "uninformative",
                  "UNRELIABLE": "uninformative"}

# a GO that rests on fewer suites than the base ran: its own colour, never a plain GO's (pipeline/verdict/headline.py)
LABEL_CLASS = {"GO, incomplete": "go-incomplete"}
