"""A model card per decided variant (reports/cards/<variant>/README.md, `quantize card`), written from the decision
itself: verdict.json's figures and serving records, the variant's recipe (its quant.json, as the verdict holds it),
the calibration set's summary (calib stats.json) and the base's origin (models/base/source.json).

It reads as the published quantized cards do (Red Hat's, TheBloke's), for the Hub's reader:

- with a repository id (`quantize card --repo-id ORG/NAME`) it is that repository's card: the id is its title, first
  sentence and model-index name, and its snippets load it; without one (the report stage's reports/cards/) it is a
  local record that says so, its snippets loading the checkpoint's folder;
- a variant that is not a plain GO opens with one sentence saying why it is not shown to replace the base (NO-GO,
  INCONCLUSIVE, GO on fewer suites than the base ran; "Timing only" when the base's weights were made up or score at
  chance: pipeline/verdict/synthetic.py); a GO not yet served with the serving engine says that; then what the model
  is, the whole chain its weights were made from (a GGUF file, its type and checksum, dequantized, quantized
  again) and how it compares with exactly the base it was compared with;
- the YAML header the Hub reads (pipeline/report/card_header.py: model-index, not `.eval_results/`, and why);
- model overview (name, architecture, inputs and outputs, what changed, the checkpoint, intended and out-of-scope use,
  licence, who quantized it, date and version, the decision); deployment with the repository id (the registry's
  serving engine in Python and as a server, transformers, the GPU memory, speed, requirements:
  pipeline/report/card_usage.py); evaluation (which engine scored it at what precision, every suite the base ran,
  accuracy beside perplexity, the decision: pipeline/report/card_evaluation.py); creation and reproduction
  (pipeline/report/card_recipe.py); limitations that apply to this model only.

What each decision counted, is NO-GO or not settled on and rests on is pipeline/verdict/facts.py's, as the report's
headline reads it: the card and the headline agree on what to ship. No path of the machine that ran it, no
instruction to the publisher and no calibration log detail goes on the card: what the publisher must check before
publishing (`publishing_checks`) is printed by `quantize card`. Nothing here reads a file.
"""

from __future__ import annotations

import re

from pipeline.report.card_evaluation import (card_label, evaluation, recovery_phrase, rests_on, still_nogo,
                                             synthetic_why, unsettled)
from pipeline.report.card_header import card_data
from pipeline.report.card_recipe import creation, reproduction
from pipeline.outputs import human_size
from pipeline.report.card_text import (base_name, md, method_module, names, reference, source_file, suite_name,
                                       pipeline_revision, reference_is_quantized)
from pipeline.report.card_usage import deployment, requirements, scored_and_served, serving_name, vllm_state
from pipeline.report.render import decided_only
from pipeline.report.screen import vision_tower
import pipeline.verdict.figures as figures
import pipeline.verdict.facts as facts
from pipeline.settings import lm_eval_tasks
from pipeline.settings import suites as registry
from pipeline.verdict.coverage import NOT_APPLICABLE, NOT_CONFIGURED, NOT_COUNTED, NOT_RUN
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

def caveat(name: str, entry: dict, verdict: dict, base: str) -> str | None:
    """One sentence for the Hub's reader, first on the card: why this model is not (yet) shown to replace the base,
    or, for a GO, what its evidence does not cover (not yet served with the serving engine); None for a GO served."""
    synthetic = verdict.get("synthetic")
    if synthetic:
        return (f"Not evaluated: {synthetic.get('short') or 'the base scores mean nothing'}, so none of its accuracy "
                "figures means anything; this card records what was built and how fast it runs.")
    shown = label(entry)
    if shown == GO:
        served = vllm_state(entry, name)
        if served["state"] == "shown":
            return None
        if served["state"] == "refused":
            return (f"GO against {base} on every suite the base ran, not served with {serving_name()}, which refused "
                    "a checkpoint like it; transformers loads it (Deployment).")
        return (f"GO against {base} on every suite the base ran, not yet served with {serving_name()}: no "
                f"{serving_name()} run of a checkpoint like it was recorded (Deployment).")
    if shown == NO_GO:
        worse = still_nogo(entry)
        parts = [f"its {kind} {'drops' if kind == 'accuracy' else 'rises'} by more than the margin on "
                 f"{names(worse[kind])}" for kind in ("accuracy", "perplexity") if worse.get(kind)]
        parts += ["the judge prefers the base's answers"] * bool(worse.get("judge"))
        parts += ["it decodes slower than the base at batch 1"] * bool(worse.get("speed"))
        return f"Not a replacement for {base}: it is NO-GO, " + (names(parts) or "on what it was decided on") + "."
    if shown == INCONCLUSIVE:
        return (f"Not shown to replace {base}: it is INCONCLUSIVE, the evidence settles neither way on "
                f"{names(unsettled(entry)) or 'what it was decided on'}.")
    if shown == GO_INCOMPLETE:
        gaps = "; ".join(f"{names(found)} {'was' if len(found) == 1 else 'were'} "
                         f"{MISSING_WORDS.get(state, str(state))}" for state, found in facts.missing(entry).items())
        return (f"Not yet shown to replace {base}: it is GO on {names(facts.decided_on(entry))} only"
                + (f"; {gaps}" if gaps else "") + ".")
    return f"Not shown to replace {base}: it was not decided GO ({shown})."


MISSING_WORDS = {NOT_RUN: "not run on it", NOT_COUNTED: "not counted", NOT_APPLICABLE: "not applicable"}
GGUF_TYPE = re.compile(r"[.-](I?Q\d(?:_[0-9A-Z]+)*|F16|BF16|F32)\.gguf$", re.I)  # llama.cpp's file naming


def scheme_words(quant: dict) -> str:
    """What changed in the weights, in words a reader of the Hub knows: the method's own (its card_words)."""
    module = method_module(quant)
    return module.card_words(quant) if module is not None else str(quant.get("scheme") or "an unrecorded scheme")


def made_from(source: dict | None, base: str) -> str:
    """The chain the weights come from: "the GGUF file X.Q4_1.gguf of base (Q4_1, a 4-bit llama.cpp format, by its
    file name; sha256 ...), dequantized to float16, then quantized again"."""
    if not source:
        return f"{base} (how its weights were read was not recorded)"
    found, dtype = source_file(source), source.get("dtype") or "its dtype"
    if source.get("kind") == "gguf":
        kind = source.get("file_type") or (GGUF_TYPE.search(found or "") or [None, None])[1]
        facts_ = [f"{kind}, by its {'GGUF metadata' if source.get('file_type') else 'file name'}" if kind else None,
                  f"sha256 {source['sha256']}" if source.get("sha256") else "its checksum not recorded"]
        return (f"the GGUF file {found} of {base} ({'; '.join(f for f in facts_ if f)}), dequantized to {dtype}, then "
                "quantized again: a re-quantization of weights the GGUF file already held quantized")
    if source.get("kind") == "chatglm":
        return f"{base}, converted from its ChatGLM remote code to GlmForCausalLM in {dtype}"
    return f"{base} in {dtype}"


def overview_sentence(shown: str, entry: dict, verdict: dict, base: str, source: dict | None) -> str:
    """What the model is, what its weights were made from and how it compares with exactly the base it was compared
    with."""
    quant = entry.get("quant") or {}
    made = (f"{shown} is {base} quantized to {quant.get('scheme') or 'an unrecorded scheme'} with llm-compressor, "
            f"made from {made_from(source, base)}")
    if verdict.get("synthetic"):
        return f"{made}; the base's weights were made up by the run, so it was built and timed, not evaluated."
    text = f"{made}. Against {reference(source, base)}, {recovery_phrase(entry)}"
    if label(entry) == GO:
        return f"{text}, and it is GO: {str(entry.get('why') or '').rstrip('.')}."
    return f"{text}."


def overview(name: str, entry: dict, verdict: dict, base: str, source: dict | None, origin: dict,
             repo_id: str | None) -> list[str]:
    quant = entry.get("quant") or {}
    hub = origin.get("hub_id")
    env = verdict.get("environment") or {}
    named = md(base) if source or origin.get("name") else "not recorded (no source.json was read)"
    vision = vision_tower(quant)
    lines = [f"- **Model**: {md(repo_id or name)}" + ("" if repo_id else " (a local record: no Hub repository)"),
             "- **Base model**: " + (f"[{md(hub)}](https://huggingface.co/{hub})" if hub else named),
             f"- **Architecture**: {md(quant.get('architecture') or 'not recorded')}, as the base"
             + (f"; {quant['quantized_modules']} linear layers quantized" if quant.get("quantized_modules") else ""),
             f"- **Inputs and outputs**: {'text and images in' if vision else 'text in'}, text out, in the base's "
             "chat template (shipped unchanged with the checkpoint)",
             f"- **What changed**: {md(scheme_words(quant))}"]
    if vision:
        lines.append(f"- **Vision tower**: {md(vision['text'])}")
    size, base_size = quant.get("size_bytes"), quant.get("base_size_bytes")
    checkpoint = md(quant.get("serving_format") or "compressed-tensors")
    if size:
        checkpoint += f", {human_size(size)}" + (f", {figures.share(size / base_size)} of the base's "
                                                   f"{human_size(base_size)}" if base_size else "")
    lines.append(f"- **Checkpoint**: {checkpoint}")
    if not verdict.get("synthetic"):
        lines.append(f"- **Compared with**: {md(reference(source, base))}")
    base_card = f"[its card](https://huggingface.co/{hub})" if hub else "its card"
    if verdict.get("synthetic"):
        use = "none: a timing run on made-up weights"
    elif label(entry) == GO:
        state = vllm_state(entry, name)["state"]
        use = (f"the base model's, as {base_card} states them, in less GPU memory" + (
            f", served with {serving_name()}" if state == "shown" else f"; not served with {serving_name()}, which "
            "refused it" if state == "refused" else f"; not yet served with {serving_name()}"))
    else:
        use = "measuring what this quantization does to the base; not as its replacement (the first line says why)"
    lines.append(f"- **Intended use**: {use}")
    lines.append(f"- **Out-of-scope use**: the base model's, as {base_card} states them; and anything the base was "
                 "not evaluated for here")
    licence = origin.get("license")
    lines.append(f"- **License**: {md(licence)}, the base's" if licence else
                 f"- **License**: {NOT_STATED}; the base model's own terms apply")
    if repo_id:
        lines.append(f"- **Quantized by**: {md(repo_id.split('/')[0])}")
    if env.get("generated") or env.get("git_revision"):
        lines.append(f"- **Date and version**: {md(env.get('generated') or 'date not recorded')}; "
                     f"{pipeline_revision(env)}")
    if not verdict.get("synthetic"):
        lines.append(f"- **Decision**: {md(card_label(entry))}: {md(rests_on(entry))}")
    return lines


# ---------------------------------------------------------------- limitations

def limitations(name: str, entry: dict, verdict: dict, source: dict | None, base: str, run: dict | None,
                tasks: dict[str, str] | None = None) -> list[str]:
    """What this model's evidence does not cover, only what applies to it (`tasks`: {suite: task} of params.yaml)."""
    lines = []
    synthetic = verdict.get("synthetic")
    if synthetic:
        lines.append(f"- {TIMING_ONLY.lower()}: {md(synthetic_why(synthetic))}: what this card shows is how the "
                     "checkpoint was built and how fast it runs")
    elif reference_is_quantized(source):
        lines.append(f"- it was compared with {md(reference(source, base))}: every change is against that, and the "
                     "loss against the original release may differ")
    states = facts.by_state(entry)
    vision = bool(vision_tower(entry.get("quant") or {}))
    for state, words in ((NOT_RUN, "not run on this model: nothing here says what it does to them"),
                         (NOT_CONFIGURED, "not part of this evaluation")):
        found = [suite_name(s) for s in states.get(state) or [] if vision or not needs_images(s, tasks or {})]
        if found:
            lines.append(f"- {md(names(found))} {'was' if len(found) == 1 else 'were'} {words}")
    if not synthetic:
        lines += [f"- {md(suite_name(suite))} is shown for information, not counted: {md(why)}"
                  for suite, why in facts.not_counted(entry).items()]
        lines += _few_items(entry)
    if vllm_state(entry, name)["state"] == "not tried":
        lines.append(f"- not yet served with {serving_name()}: no {serving_name()} run of a checkpoint of this "
                     "architecture and format was recorded, so the deployment commands are untested")
    differs = scored_and_served(name, entry, verdict, source, run)
    if differs:
        lines.append(f"- {md(differs)}")
    unsandboxed = [s for d in (entry.get("suites") or {}).values() for s in d.get("unsandboxed") or []]
    if unsandboxed:
        lines.append(f"- model-written code ran without the sandbox for: {md(names(unsandboxed))}")
    return lines or ["- none recorded"]


def needs_images(suite: str, tasks: dict[str, str]) -> bool:
    """Whether a suite asks about images (its YAML's metadata.suite.needs, or a plain lm-eval task's doc_to_image):
    never a limitation of a text model. Found by the task params.yaml runs it with (`tasks`), else, a suite the
    product ships that params.yaml does not name, by its declared name."""
    declared = lm_eval_tasks.suite_quietly(tasks[suite]) if suite in tasks else registry.named(suite)
    return bool(declared and "images" in declared.needs)


def _few_items(entry: dict) -> list[str]:
    counted = [(s, d, kind) for kind in (facts.ACCURACY, facts.PERPLEXITY)
               for s, _, d in sorted(facts.counted_entries(entry, kind))]
    if not counted:
        return []
    sizes = sorted({d.get("n") for _, d, _ in counted if d.get("n")})
    margins = "; ".join(f"{s}: {figures.relative(d['margin']) if kind == facts.PERPLEXITY else figures.points(-d['margin']) + ' points'}"
                        for s, d, kind in counted)
    spread = (f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}") if sizes else "few"
    lines = [f"- each suite scored {spread} items: GO means the interval of the change lies within the margin "
             f"({md(margins)}); a loss smaller than that cannot be told apart from none"]
    for step in entry.get("next_steps") or []:
        if not step.get("counted", True) or not step.get("now"):
            continue
        unit = md(step.get("unit") or "items")
        if facts.unreachable(step) or (step.get("available") and not step.get("needed")):
            lines.append(f"- {md(step['suite'])}: {step['now']} {unit} did not settle it, and it cannot be settled on "
                         f"this suite ({step['available']} {unit})")
        elif step.get("needed") and step.get("available"):
            lines.append(f"- {md(step['suite'])}: {step['now']} {unit} did not settle it; about {step['needed']} of "
                         f"its {step['available']} would")
        elif step.get("needed"):  # a verdict that did not record the suite's size: no count that may exceed it
            lines.append(f"- {md(step['suite'])}: {step['now']} {unit} did not settle it")
    return lines


# ---------------------------------------------------------------- what the publisher checks

def publishing_checks(name: str, verdict: dict, source: dict | None, repo_id: str | None) -> list[str]:
    """What the publisher should know before uploading the card (printed by `quantize card`, not on the card)."""
    entry = verdict["variants"][name]
    origin = (source or {}).get("origin") or {}
    checks = []
    if verdict.get("synthetic"):
        checks.append("timing only: the base's accuracy figures mean nothing; do not publish it")
    elif not facts.ships(entry):
        checks.append(f"{label(entry)}: not one to ship; the card opens by saying why it does not replace the base")
    if not origin.get("license"):
        checks.append("the base's source states no licence: add `license:` to the header once you know its terms")
    if not origin.get("hub_id"):
        checks.append("the base's source names no Hub repository: add `base_model: ORG/NAME` to the header")
    if not repo_id:
        checks.append(f"no --repo-id: written as a local record (snippets load models/{name}), not a Hub card; pass "
                      "--repo-id ORG/NAME for the card of a Hub repository")
    return checks


# ---------------------------------------------------------------- the card

def model_card(name: str, verdict: dict, *, source: dict | None = None, calib: dict | None = None,
               tasks: dict[str, str] | None = None, speed_engine: str | None = None, repo_id: str | None = None,
               run: dict | None = None):
    """The variant's card (huggingface_hub.ModelCard: `.content` is the README.md text). `source`: models/base's
    source.json (with its `origin`), `calib`: calib stats.json, `tasks`: {suite: lm-eval task} of params.yaml,
    `repo_id`: the Hub repository the card is published in (its title, first sentence and model-index name; without
    one the card is a local record, its snippets loading models/<variant>), `run`: run_settings of the params.yaml the
    verdict was decided under."""
    from huggingface_hub import ModelCard

    entry, tasks = verdict["variants"][name], tasks or {}
    origin = (source or {}).get("origin") or {}
    base = base_name(origin, source)
    quant = entry.get("quant") or {}
    vision = bool(((quant.get("verify") or {}).get("vision") or {}).get("vision_tensors"))
    shown = repo_id or name
    title = shown if repo_id else f"{name} (local record)"
    title = f"{TIMING_ONLY}: {title}" if verdict.get("synthetic") else title
    warning = caveat(name, entry, verdict, base)
    local = ([f"*A local record of {md(name)}, not a Hub card: it names no Hub repository, and its snippets load the "
              f"checkpoint's folder, models/{md(name)}.*", ""] if not repo_id else [])
    body = [f"# {md(title)}", "", *local, *([f"**{md(warning)}**", ""] if warning else []),
            md(overview_sentence(shown, entry, verdict, base, source)), "",
            "## Model overview", "", *overview(name, entry, verdict, base, source, origin, repo_id), "",
            "## Deployment", "", *deployment(name, entry, verdict, repo_id=repo_id, source=source, vision=vision,
                                             speed_engine=speed_engine), "",
            "### Requirements", "", *requirements(name, entry, verdict), "",
            "## Evaluation", "", *evaluation(name, entry, verdict, tasks=tasks, source=source, run=run), "",
            "## Creation", "", *creation(name, entry, verdict, source=source, origin=origin, calib=calib), ""]
    if not verdict.get("synthetic"):
        body += ["## Reproduction", "", *reproduction(name, entry, verdict, tasks=tasks, repo_id=repo_id, run=run), ""]
    body += ["## Limitations", "", *limitations(name, entry, verdict, source, base, run, tasks)]
    data = card_data(name, entry, verdict, origin, tasks, repo_id)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


def model_cards(verdict: dict, **facts_) -> dict[str, str]:
    """{variant: README.md text} for every variant the verdict decided (`facts_`: model_card's)."""
    return {name: model_card(name, verdict, **facts_).content for name in decided(verdict)}
