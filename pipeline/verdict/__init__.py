"""The verdict: may each quantized variant replace the base? Every rule and statistic behind GO / NO-GO /
INCONCLUSIVE lives in this package; the report stage reads the files and renders what it decides.

    intervals    Tango's paired score interval, the exact McNemar test, the bootstrap, the partial-credit
                 interval, and the decision read off an interval (`decide`); GO, NO_GO, INCONCLUSIVE
    paired       right/wrong and scored suites: the variant against the base on the same items
    perplexity   perplexity suites: the ratio estimator's t interval, paired by document
    judge        the judge's win rate and its decision (UNRELIABLE when it contradicts itself); its figures
                 from judge.jsonl's lines
    drift        KL drift: kl.json's figures from kl.jsonl's per-token values
    speed        serving speed against the base, and what a variant buys in serving
    coverage     what a decision rests on: each suite decided, not counted, not run, not applicable or
                 not configured
    facts        what a decided entry means, derived once (counted, NO-GO on, not settled on, coverage by
                 state, whether it ships): the headline, the first screen, the fix, the gate and the cards read it
    headline     what to ship, in one sentence (a plain GO only), and each variant's label
    recovery     variant / base as model cards state it, per suite and on average
    next_steps   why in a few words, and what to run to settle an open suite (never more items than it has)
    fix          each W4A16 variant beside its fix (V-mixed: its most costly groups in 8 bits), or the offer of one
    figures      one number format per kind of figure, for the sentences and the page
    decision     one variant's decision from all of the above, and the CI gate (`failing`)
"""
