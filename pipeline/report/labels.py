"""The CSS class of each decision label (its colour on the page, in the template's stylesheet)."""

DECISION_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive", "UNINFORMATIVE": "uninformative",
                  "UNRELIABLE": "uninformative"}
