"""A model card per decided variant (reports/cards/<variant>/README.md, `quantize card`), written from the decision
itself: verdict.json's figures and serving records, the variant's recipe (its quant.json, as the verdict holds it),
the calibration set's summary (calib stats.json) and the base's origin (models/base/source.json).

It reads as the published quantized cards do (Red Hat's, TheBloke's), and can be published as it is:

- a variant that is not a plain GO opens with one sentence saying why it should not be published as a replacement
  for the base (NO-GO, INCONCLUSIVE, GO on fewer suites than the base ran; "Timing only" when the base's weights were
  made up or score at chance: pipeline/verdict/synthetic.py), then what the model is and what it recovers against
  exactly the base it was compared with (a base dequantized from a GGUF file is said to be one);
- the YAML header the Hub reads (pipeline/report/card_header.py: model-index, not `.eval_results/`, and why);
- model overview (architecture, what changed, the checkpoint, intended use, licence, the decision); deployment with
  the repository id (vLLM in Python and `vllm serve`, transformers, the GPU memory, speed:
  pipeline/report/card_usage.py); evaluation (which engine scored it at what precision, every suite the base ran,
  accuracy beside perplexity, the decision: pipeline/report/card_evaluation.py); creation and reproduction (the
  params.yaml and `quantize` commands, the versions: pipeline/report/card_recipe.py); limitations.

No path of the machine that ran it, no instruction to the pipeline's operator and no calibration log detail goes on
the card: what the publisher must check before publishing (`publishing_checks`) is printed by `quantize card`.
Nothing here reads a file: the stages hand it what they read.
"""

from __future__ import annotations

from pipeline.report.card_evaluation import (evaluation, recovery_phrase, rests_on, still_nogo, synthetic_why,
                                             unsettled)
from pipeline.report.card_header import card_data
from pipeline.report.card_recipe import creation, reproduction
from pipeline.outputs import human_size
from pipeline.report.card_text import (base_name, md, method_module, names, reference,
                                       reference_is_quantized)
from pipeline.report.card_usage import deployment, vllm_state
from pipeline.report.render import decided_only
from pipeline.report.screen import vision_tower
import pipeline.verdict.figures as figures
from pipeline.verdict.coverage import DECIDED, NOT_APPLICABLE, NOT_CONFIGURED, NOT_COUNTED, NOT_RUN
from pipeline.verdict.headline import GO, GO_INCOMPLETE, INCONCLUSIVE, NO_GO, label

README = "README.md"  # the file a Hub repository shows as its card
TIMING_ONLY = "Timing only"
NOT_STATED = "not stated by the base's source"


def decided(verdict: dict) -> list[str]:
    """The variants the verdict decided (each with its suites and coverage), in verdict.json's order: each gets a card."""
    return list(decided_only(verdict)["variants"])


def run_settings(verdict: dict, params) -> dict | None:
    """What params.yaml says of how the verdict's suites were scored (the engine, its dtype, each suite's task,
    limit, generation length and options), only where it is the params.yaml the verdict was decided under (its
    digest, verdict.json's params_sha256); None otherwise: the card then says what was not recorded."""
    if params is None or params.digest() != verdict.get("params_sha256"):
        return None
    return {"engine": params.engine.name, "dtype": getattr(params.engine, "dtype", None),
            "suites": {name: {"task": s.task, "limit": s.limit, "max_new_tokens": s.max_new_tokens,
                              "options": dict(s.options)} for name, s in params.suites.items()}}


# ---------------------------------------------------------------- the opening

def why_not_publish(entry: dict, verdict: dict, base: str) -> str | None:
    """One sentence: why this variant should not be published as a replacement for the base; None for a plain GO."""
    synthetic = verdict.get("synthetic")
    if synthetic:
        return (f"Do not publish this model: {synthetic.get('short') or 'the base scores mean nothing'}, so none of "
                "its accuracy figures means anything; this card records what was built and how fast it runs.")
    shown = label(entry)
    if shown == GO:
        return None
    replace = f"Do not publish this model as a replacement for {base}"
    if shown == NO_GO:
        worse = still_nogo(entry)
        parts = [f"its {kind} {'drops' if kind == 'accuracy' else 'rises'} by more than the margin on "
                 f"{names(worse[kind])}" for kind in ("accuracy", "perplexity") if worse.get(kind)]
        parts += ["the judge prefers the base's answers"] * bool(worse.get("judge"))
        parts += ["it decodes slower than the base at batch 1"] * bool(worse.get("speed"))
        return f"{replace}: it is NO-GO, " + (names(parts) or "on what it was decided on") + "."
    if shown == INCONCLUSIVE:
        return (f"{replace} yet: it is INCONCLUSIVE, the evidence settles neither way on "
                f"{names(unsettled(entry)) or 'what it was decided on'}.")
    if shown == GO_INCOMPLETE:
        coverage = entry.get("coverage") or {}
        states = coverage.get("suites") or {}
        decided_on = [s for s in coverage.get("base_ran") or [] if (states.get(s) or {}).get("state") == DECIDED]
        missing = {}
        for suite in coverage.get("base_ran") or []:
            state = (states.get(suite) or {}).get("state")
            if state != DECIDED:
                missing.setdefault({NOT_RUN: "not run on it", NOT_COUNTED: "not counted",
                                    NOT_APPLICABLE: "not applicable"}.get(state, str(state)), []).append(suite)
        gaps = "; ".join(f"{names(found)} {'was' if len(found) == 1 else 'were'} {state}"
                         for state, found in missing.items())
        return f"{replace} yet: it is GO on {names(decided_on)} only" + (f"; {gaps}" if gaps else "") + "."
    return f"{replace}: it was not decided GO ({shown})."


def scheme_words(quant: dict) -> str:
    """What changed in the weights, in words a reader of the Hub knows: the method's own (its card_words)."""
    module = method_module(quant)
    return module.card_words(quant) if module is not None else str(quant.get("scheme") or "an unrecorded scheme")


def overview_sentence(name: str, entry: dict, verdict: dict, base: str, source: dict | None) -> str:
    """What the model is, how it was made and what it recovers against exactly the base it was compared with."""
    quant = entry.get("quant") or {}
    made = f"{name} is {base} quantized to {quant.get('scheme') or 'an unrecorded scheme'} with llm-compressor"
    if verdict.get("synthetic"):
        return f"{made}; the base's weights were made up by the run, so it was built and timed, not evaluated."
    text = f"{made}; against {reference(source, base)}, it {recovery_phrase(entry)}"
    if label(entry) == GO:
        return f"{text}, and it is GO: {str(entry.get('why') or '').rstrip('.')}."
    return f"{text}."


def overview(name: str, entry: dict, verdict: dict, base: str, source: dict | None, origin: dict) -> list[str]:
    quant = entry.get("quant") or {}
    hub = origin.get("hub_id")
    named = md(base) if source or origin.get("name") else "not recorded (no source.json was read)"
    lines = ["- **Base model**: " + (f"[{md(hub)}](https://huggingface.co/{hub})" if hub else named),
             f"- **Architecture**: {md(quant.get('architecture') or 'not recorded')}, as the base"
             + (f"; {quant['quantized_modules']} linear layers quantized" if quant.get("quantized_modules") else ""),
             f"- **What changed**: {md(scheme_words(quant))}"]
    tower = vision_tower(quant)
    if tower:
        lines.append(f"- **Vision tower**: {md(tower['text'])}")
    size, base_size = quant.get("size_bytes"), quant.get("base_size_bytes")
    checkpoint = md(quant.get("serving_format") or "compressed-tensors")
    if size:
        checkpoint += f", {human_size(size)}" + (f", {figures.share(size / base_size)} of the base's "
                                                   f"{human_size(base_size)}" if base_size else "")
    lines.append(f"- **Checkpoint**: {checkpoint}")
    if not verdict.get("synthetic"):
        lines.append(f"- **Compared with**: {md(reference(source, base))}")
    if verdict.get("synthetic"):
        use = "none: a timing run on made-up weights"
    elif label(entry) == GO:
        use = "what the base model is for, in less GPU memory" + (
            ", served with vLLM" if vllm_state(entry, name)["state"] == "shown" else "")
    else:
        use = "measuring what this quantization does to the base; not yet as its replacement (the first line says why)"
    lines.append(f"- **Intended use**: {use}")
    licence = origin.get("license")
    lines.append(f"- **License**: {md(licence)}, the base's" if licence else
                 f"- **License**: {NOT_STATED}; the base model's own terms apply")
    if not verdict.get("synthetic"):
        lines.append(f"- **Decision**: {md(label(entry))}: {md(rests_on(entry))}")
    return lines


# ---------------------------------------------------------------- limitations

def limitations(name: str, entry: dict, verdict: dict, source: dict | None, base: str) -> list[str]:
    lines = []
    synthetic = verdict.get("synthetic")
    if synthetic:
        lines.append(f"- {TIMING_ONLY.lower()}: {md(synthetic_why(synthetic))}: what this card shows is how the "
                     "checkpoint was built and how fast it runs")
    elif reference_is_quantized(source):
        lines.append(f"- it was compared with {md(reference(source, base))}: every recovery and change is against "
                     "that, and the loss against the original release may differ")
    coverage = (entry.get("coverage") or {}).get("suites") or {}
    by_state: dict[str, list[str]] = {}
    for suite, state in coverage.items():
        by_state.setdefault(state.get("state"), []).append("the judge" if suite == "judge" else suite)
    if by_state.get(NOT_RUN):
        lines.append(f"- {md(names(by_state[NOT_RUN]))} {'was' if len(by_state[NOT_RUN]) == 1 else 'were'} not run "
                     "on this model: nothing here says what it does to them")
    if not synthetic:
        for suite, state in coverage.items():
            if state.get("state") == NOT_COUNTED:
                lines.append(f"- {'the judge' if suite == 'judge' else md(suite)}: shown, not counted: "
                             f"{md(state.get('why') or '')}")
    if by_state.get(NOT_CONFIGURED):
        lines.append(f"- {md(names(by_state[NOT_CONFIGURED]))} {'was' if len(by_state[NOT_CONFIGURED]) == 1 else 'were'}"
                     " not part of this evaluation")
    if not synthetic:
        lines += _few_items(entry)
    if vllm_state(entry, name)["state"] == "not tried":
        lines.append("- no vLLM run of a checkpoint of this architecture and format was recorded: the deployment "
                     "commands are untested")
    unsandboxed = [s for d in (entry.get("suites") or {}).values() for s in d.get("unsandboxed") or []]
    if unsandboxed:
        lines.append(f"- model-written code ran without the sandbox for: {md(names(unsandboxed))}")
    return lines or ["- none recorded"]


def _few_items(entry: dict) -> list[str]:
    counted = [(s, d, part) for part in ("suites", "perplexity") for s, d in sorted((entry.get(part) or {}).items())
               if d.get("counted")]
    if not counted:
        return []
    sizes = sorted({d.get("n") for _, d, _ in counted if d.get("n")})
    margins = "; ".join(f"{s}: {figures.relative(d['margin']) if part == 'perplexity' else figures.points(-d['margin']) + ' points'}"
                        for s, d, part in counted)
    spread = (f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}") if sizes else "few"
    lines = [f"- each suite scored {spread} items: GO means the interval of the change lies within the margin "
             f"({md(margins)}); a loss smaller than that cannot be told apart from none"]
    for step in entry.get("next_steps") or []:
        if step.get("counted", True) and step.get("now") and step.get("needed"):
            lines.append(f"- {md(step['suite'])}: {step['now']} {md(step.get('unit') or 'items')} did not settle it; "
                         f"about {step['needed']} would")
    return lines


# ---------------------------------------------------------------- what the publisher checks

def publishing_checks(name: str, verdict: dict, source: dict | None, repo_id: str | None) -> list[str]:
    """What the publisher should know before uploading the card (printed by `quantize card`, not on the card)."""
    entry = verdict["variants"][name]
    origin = (source or {}).get("origin") or {}
    checks = []
    if verdict.get("synthetic"):
        checks.append("timing only: the base's accuracy figures mean nothing; do not publish it")
    elif label(entry) != GO:
        checks.append(f"{label(entry)}: the card opens by saying why it should not replace the base")
    if not origin.get("license"):
        checks.append("the base's source states no licence: add `license:` to the header once you know its terms")
    if not origin.get("hub_id"):
        checks.append("the base's source names no Hub repository: add `base_model: ORG/NAME` to the header")
    if not repo_id:
        checks.append(f"no --repo-id: the usage snippets load your-org/{name}; pass --repo-id ORG/NAME")
    return checks


# ---------------------------------------------------------------- the card

def model_card(name: str, verdict: dict, *, source: dict | None = None, calib: dict | None = None,
               tasks: dict[str, str] | None = None, speed_engine: str | None = None, repo_id: str | None = None,
               run: dict | None = None):
    """The variant's card (huggingface_hub.ModelCard: `.content` is the README.md text). `source`: models/base's
    source.json (with its `origin`), `calib`: calib stats.json, `tasks`: {suite: lm-eval task} of params.yaml,
    `repo_id`: the Hub repository the card is published in (else the snippets name your-org/<variant>), `run`:
    run_settings of the params.yaml the verdict was decided under."""
    from huggingface_hub import ModelCard

    entry, tasks = verdict["variants"][name], tasks or {}
    origin = (source or {}).get("origin") or {}
    base = base_name(origin, source)
    quant = entry.get("quant") or {}
    vision = bool(((quant.get("verify") or {}).get("vision") or {}).get("vision_tensors"))
    shown = repo_id or name
    title = f"{TIMING_ONLY}: {shown}" if verdict.get("synthetic") else shown
    warning = why_not_publish(entry, verdict, base)
    body = [f"# {md(title)}", "", *([f"**{md(warning)}**", ""] if warning else []),
            md(overview_sentence(name, entry, verdict, base, source)), "",
            "## Model overview", "", *overview(name, entry, verdict, base, source, origin), "",
            "## Deployment", "", *deployment(name, entry, verdict, repo_id=repo_id, source=source, vision=vision,
                                             speed_engine=speed_engine), "",
            "## Evaluation", "", *evaluation(name, entry, verdict, tasks=tasks, source=source, run=run), "",
            "## Creation", "", *creation(name, entry, verdict, source=source, origin=origin, calib=calib), ""]
    if not verdict.get("synthetic"):
        body += ["## Reproduction", "", *reproduction(name, entry, verdict, tasks=tasks, repo_id=repo_id, run=run), ""]
    body += ["## Limitations", "", *limitations(name, entry, verdict, source, base)]
    data = card_data(name, entry, verdict, origin, tasks, repo_id)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


def model_cards(verdict: dict, **facts) -> dict[str, str]:
    """{variant: README.md text} for every variant the verdict decided (`facts`: model_card's)."""
    return {name: model_card(name, verdict, **facts).content for name in decided(verdict)}
