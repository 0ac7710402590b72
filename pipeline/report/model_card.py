"""A model card per decided variant (reports/cards/<variant>/README.md, `quantize card`), written from the decision
itself: verdict.json's figures, sentences and serving claims, the variant's recipe (its quant.json, as the verdict
holds it), the calibration set's summary (calib stats.json) and the base's origin (models/base/source.json).

It opens as the published quantized cards do (Red Hat / Neural Magic on the Hub): one sentence saying what the model
is, how it was made and its recovery against the unquantized model, led by its decision when that is not a plain
GO ("NO-GO", "INCONCLUSIVE", "GO, incomplete"; "Timing only" when the base's weights were made up or score at
chance: pipeline/verdict/synthetic.py); then the YAML header the Hub reads, built with huggingface_hub's
ModelCardData (`base_model`, `base_model_relation: quantized`, the base's licence as its source states it, tags,
`model-index` with each counted suite's figure, exactly verdict.json's), a per-suite table (base, variant, change
with its interval, recovery, an Average row), the recipe, the calibration data, where it is served and with what
command (only a run recorded on the GPU machine makes it "shown": pipeline/checkpoints/serving.py), speed and
capacity, and its limitations. Nothing here reads a file: the stages hand it what they read.
"""

from __future__ import annotations

import json

import pipeline.verdict.figures as figures
from pipeline import engines, methods
from pipeline.outputs import human_size
from pipeline.report.deploy import served_by, speed_state
from pipeline.report.render import decided_only
from pipeline.report.screen import matrix_cell, matrix_columns, recovery_note, vision_tower
from pipeline.verdict.coverage import DECIDED
from pipeline.verdict.headline import GO, GO_INCOMPLETE, INCONCLUSIVE, NO_GO, label, phrase, rests

README = "README.md"  # the file a Hub repository shows as its card
TIMING_ONLY = "Timing only"
NOT_STATED = "not stated by the base"
# The shipped suites' data (evals/README.md): (model-index dataset type: the Hub's id where there is one, its name)
SHIPPED_DATA = {
    "quant_gsm8k": ("openai/gsm8k", "GSM8K (test)"),
    "quant_humaneval": ("openai/openai_humaneval", "HumanEval"),
    "quant_long_context": ("quant_long_context", "needle and multi-key retrieval in Alice in Wonderland"),
    "quant_vqa": ("easy-vqa", "easy-VQA (test)"),
    "quant_ppl_chat": ("quant_ppl_chat", "held-out conversations of the calibration source"),
    "quant_ppl_book": ("quant_ppl_book", "Alice in Wonderland, 1,000-character documents"),
    "quant_ppl_gsm8k": ("openai/gsm8k", "GSM8K questions with their reference solutions"),
    "quant_ppl_humaneval": ("openai/openai_humaneval", "HumanEval prompts with their canonical solutions"),
}
JUDGE_DATA = ("quant_judge", "held-out user prompts, judged against the base's answers")
TASK_TYPES = {"quant_vqa": "visual-question-answering"}  # the Hub's task of a shipped suite, where not text-generation


# ---------------------------------------------------------------- text that goes into Markdown

def md(text) -> str:
    """Text from the verdict as Markdown shows it: no HTML (no tag can open), no table break (`|`), on one line."""
    return " ".join(str(text).split()).replace("<", "&lt;").replace("|", "\\|")


def code(text) -> str:
    """A command as an inline code span (a backtick inside is fenced with two)."""
    text = " ".join(str(text).split())
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# ---------------------------------------------------------------- what the card is of

def decided(verdict: dict) -> list[str]:
    """The variants the verdict decided (each with its suites and coverage), in verdict.json's order: each gets a card."""
    return list(decided_only(verdict)["variants"])


def base_name(origin: dict | None, source: dict | None) -> str:
    """The base as the card names it: its Hub repository, else the name its source states, else its source's path."""
    origin = origin or {}
    return origin.get("hub_id") or origin.get("name") or str((source or {}).get("source") or "the base model")


def _method(quant: dict):
    """The variant's method module (pipeline/methods/), None for a name the registry does not hold."""
    name = quant.get("method")
    return methods.method(name) if methods.is_method(name) else None


def tags(quant: dict) -> list[str]:
    """The scheme's tags: the method's (awq / gptq / rtn / mixed and the scheme it writes), a mixed variant's base
    method, compressed-tensors and quantized."""
    modules = [_method(quant), methods.method(quant["base_method"]) if methods.is_method(quant.get("base_method")) else None]
    return list(dict.fromkeys([*(tag for m in modules if m is not None for tag in m.CARD_TAGS), "compressed-tensors",
                               "quantized"]))


def _made_with(quant: dict) -> str:
    """"FP8 W8A8 (static activations), KV cache FP8 per-head by the fp8 method (llm-compressor)"."""
    return f"{quant.get('scheme') or 'an unrecorded scheme'} by the {quant.get('method') or 'unrecorded'} method (llm-compressor)"


# ---------------------------------------------------------------- the evaluation: model-index and the table

def _suite_data(suite: str, tasks: dict[str, str]) -> tuple[str, str]:
    task = tasks.get(suite) or suite
    return SHIPPED_DATA.get(task, (task, task))


def counted_figures(entry: dict) -> list[dict]:
    """Per counted suite its figures as verdict.json holds them: {suite, kind, metric, value, base, recovery}, the
    right/wrong suites (accuracy), the perplexity suites, then the judge (win rate)."""
    rows = []
    for suite, d in sorted((entry.get("suites") or {}).items()):
        if d.get("counted"):
            rows.append({"suite": suite, "kind": "suite", "metric": "accuracy", "value": d["variant_score"],
                         "base": d["base_score"], "recovery": d.get("recovery")})
    for suite, d in sorted((entry.get("perplexity") or {}).items()):
        if d.get("counted"):
            rows.append({"suite": suite, "kind": "perplexity", "metric": "perplexity", "value": d["variant_ppl"],
                         "base": d["base_ppl"], "recovery": d.get("recovery")})
    judge = entry.get("judge") or {}
    if judge.get("counted"):
        rows.append({"suite": "judge", "kind": "judge", "metric": "win_rate", "value": judge["summary"]["win_rate"],
                     "base": 0.5, "recovery": None})
    return rows


def eval_results(name: str, entry: dict, tasks: dict[str, str]) -> list:
    """huggingface_hub EvalResults: per counted suite its figure and, where defined, its recovery (verdict.json's
    numbers, unrounded)."""
    from huggingface_hub import EvalResult

    results = []
    for row in counted_figures(entry):
        data = JUDGE_DATA if row["kind"] == "judge" else _suite_data(row["suite"], tasks)
        task_type = TASK_TYPES.get(tasks.get(row["suite"]) or row["suite"], "text-generation")
        common = {"task_type": task_type, "task_name": row["suite"], "dataset_type": data[0], "dataset_name": data[1]}
        results.append(EvalResult(**common, metric_type=row["metric"], metric_value=row["value"],
                                  metric_name=f"{row['suite']} {row['metric'].replace('_', ' ')}"))
        if row["recovery"] is not None:
            results.append(EvalResult(**common, metric_type="recovery", metric_value=row["recovery"],
                                      metric_name=f"{row['suite']} recovery (variant / base)"))
    return results


def _shown(kind: str, value) -> str:
    return figures.perplexity(value) if kind == "perplexity" else figures.share(value)


def evaluation_table(entry: dict) -> list[str]:
    """The per-suite table as the published cards give it: base, this model, the change with its interval, recovery,
    the decision; then the Average row over the counted accuracy suites (or why there is none)."""
    cells = {(kind, suite): matrix_cell(entry, kind, suite) for kind, suite in matrix_columns({"variants": {"v": entry}})}
    lines = ["| suite | measure | base | this model | change [95% interval] | recovery | decision |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in counted_figures(entry):
        cell = cells.get((row["kind"], row["suite"])) or {}
        measure = {"suite": "accuracy", "perplexity": "perplexity (lower is better)", "judge": "win rate against the base"}[row["kind"]]
        lines.append(f"| {md(row['suite'])} | {measure} | {_shown(row['kind'], row['base'])} | "
                     f"{_shown(row['kind'], row['value'])} | {md(cell.get('change', ''))} {md(cell.get('interval', ''))} | "
                     f"{figures.share(row['recovery'])} | {md(cell.get('decision', ''))} |")
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = ", ".join(recovery.get("suites") or [])
        lines.append(f"| **Average** | accuracy ({md(over)}) | {figures.share(recovery.get('base_mean'))} | "
                     f"{figures.share(recovery.get('variant_mean'))} | | **{figures.share(recovery['accuracy'])}** | |")
    else:
        note = recovery_note(entry)
        lines.append(f"| **Average** | accuracy | – | – | | {md(note['text'])}: {md(note['note'])} | |")
    return lines


def recovery_phrase(entry: dict) -> str:
    """"recovers 98.2% of the base's accuracy on average over 3 suites (math, code, vqa)", or, without an accuracy average,
    what the perplexity suites recover, with why there is no average."""
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = recovery.get("suites") or []
        return (f"recovers {figures.share(recovery['accuracy'])} of the base's accuracy on average over {len(over)} "
                f"suite{'s' if len(over) != 1 else ''} ({', '.join(over)})")
    per_suite = [d["recovery"] for d in (entry.get("perplexity") or {}).values()
                 if d.get("counted") and d.get("recovery") is not None]
    none = recovery_note(entry)["note"]
    if not per_suite:
        return f"has no recovery figure ({none})"
    low, high = min(per_suite), max(per_suite)
    spread = figures.share(low) if low == high else f"{figures.share(low)} to {figures.share(high)}"
    return (f"recovers {spread} of the base's perplexity score (base / variant perplexity) on {len(per_suite)} perplexity "
            f"suite{'s' if len(per_suite) != 1 else ''}, with no accuracy average ({none})")


# ---------------------------------------------------------------- the sentence the card opens with

def first_sentence(name: str, entry: dict, verdict: dict, base: str) -> str:
    """What the model is, how it was made and what it recovers, led by its decision unless a plain GO; "Timing only"
    when the base's accuracy figures mean nothing."""
    synthetic = verdict.get("synthetic")
    made = f"{name} is {base} quantized to {_made_with(entry.get('quant') or {})}"
    if synthetic:
        return (f"{TIMING_ONLY}, not for publishing: {made}, and {synthetic.get('short') or synthetic.get('why')}, so "
                "its accuracy figures mean nothing; this card records what was built and how fast it runs.")
    shown, why = label(entry), str(entry.get("why") or "").rstrip(".")
    against = f"against the unquantized model it {recovery_phrase(entry)}"
    if shown == GO:
        return f"{made}; {against}, and it is GO: {why}."
    if shown == GO_INCOMPLETE:
        return f"{GO_INCOMPLETE}: {made}; {against}, and it is {phrase(entry)}: a decision on less than the base ran."
    if shown == NO_GO:
        return f"NO-GO, not a replacement for {base}: {made}; {against}: {why}."
    if shown == INCONCLUSIVE:
        return f"INCONCLUSIVE, not yet shown to replace {base}: {made}; {against}: {why}."
    return f"{shown}: {made}; {against}; {why}."


# ---------------------------------------------------------------- the sections below the table

def _decision(entry: dict) -> list[str]:
    lines = [f"**{md(label(entry))}** {md(rests(entry))}: {md(entry.get('why') or '')}.", ""]
    sentences = [d.get("sentence") for part in ("suites", "perplexity") for d in (entry.get(part) or {}).values()
                 if d.get("counted")] + ([(entry.get("judge") or {}).get("sentence")] if (entry.get("judge") or {}).get("counted") else [])
    lines += [f"- {md(s)}" for s in sentences if s]
    fix, fix_of = entry.get("fix") or {}, entry.get("fix_of")
    if fix.get("line"):
        lines += ["", f"Its fix ({md(fix.get('variant'))}): {md(fix['line'])}"]
    if fix_of:
        lines += ["", f"It is the fix of {md(fix_of)}, a NO-GO W4A16 variant: its costliest groups kept in 8 bits."]
    steps = [s.get("text") for s in entry.get("next_steps") or [] if s.get("text")]
    if steps:
        lines += ["", "What would settle or complete it:", "", *(f"- {md(s)}" for s in steps)]
    return lines


def _recipe(quant: dict, name: str) -> list[str]:
    module = _method(quant)
    fields = [key for key in (module.Params.model_fields if module else ()) if key != "method" and key in quant]
    settings = [f"{key} {json.dumps(quant[key]) if isinstance(quant[key], bool) else quant[key]}" for key in fields]
    lines = [f"- method: **{md(quant.get('method') or 'not recorded')}**" + (f": {md(module.SUMMARY)}" if module else ""),
             f"- scheme: {md(quant.get('scheme') or 'not recorded')}; checkpoint format: "
             f"{md(quant.get('serving_format') or (module.SERVING_FORMAT if module else 'not recorded'))}"]
    if settings:
        lines.append(f"- settings: {md(', '.join(settings))}")
    if quant.get("groups_in_8_bits") is not None:
        kept = [g["name"] for g in quant.get("groups") or [] if g.get("scheme") == "W8A16"]
        lines.append(f"- kept in 8 bits (W8A16): {quant['groups_in_8_bits']} of {quant.get('groups_total')} groups, the "
                     f"ones that cost the W4A16 variant most KL ({md(quant.get('sensitivity') or 'its ranking')}), "
                     f"{quant.get('bits_per_weight')} bits per weight: {md(', '.join(kept))}")
    for pattern, why in (quant.get("ignored") or {}).items():
        lines.append(f"- kept in full precision: {code(pattern)}: {md(why)}")
    vision = (quant.get("verify") or {}).get("vision")
    if isinstance(vision, dict):
        tower = vision_tower(quant)
        lines.append(f"- {md(tower['text'])}" if tower else "- vision tower: none (a text-only model)")
    verify = quant.get("verify") or {}
    plan = verify.get("plan") or {}
    checks = [f"{plan.get('quantized')} of {plan.get('planned')} planned modules quantized" if plan else
              f"{quant.get('quantized_modules')} modules quantized",
              "reloads and generates" if verify.get("reloads") else "reload not checked"]
    if (verify.get("layer_error") or {}).get("max") is not None:
        checks.append(f"largest relative layer error {verify['layer_error']['max']:.4f} ({verify['layer_error'].get('worst_layer')})")
    lines.append(f"- checked after quantizing: {md('; '.join(checks))}")
    size, base_size = quant.get("size_bytes"), quant.get("base_size_bytes")
    if size:
        lines.append(f"- size: {human_size(size)}" + (f", {figures.share(size / base_size)} of the base's {human_size(base_size)}"
                                                       if base_size else ""))
    return lines


def _calibration(quant: dict, calib: dict | None) -> list[str]:
    module = _method(quant)
    used = quant.get("calibration") or {}
    lines = []
    if module is not None and not module.NEEDS_CALIBRATION:
        lines.append(f"- {md(quant.get('method'))} does not calibrate: these tokens did not shape its weights (the "
                     "stage reads them to check the checkpoint)")
    lines.append(f"- blocks: {used.get('blocks')} x {used.get('seq_len')} tokens from {md(used.get('source') or 'not recorded')}")
    if not calib:
        return lines + ["- source file, records kept and redactions: not recorded (no calibration summary, stats.json, "
                        "was read)"]
    dropped = ", ".join(f"{why} {n}" for why, n in (calib.get("dropped") or {}).items()) or "none"
    redactions = ", ".join(f"{kind} {n}" for kind, n in (calib.get("redactions") or {}).items()) or "none found"
    lines += [f"- source: {md(calib.get('source'))}: {calib.get('records_in')} records read, {calib.get('records_kept')} "
              f"kept (dropped: {md(dropped)})",
              "- redaction: " + (f"on ({md(redactions)})" if calib.get("redaction") else "off: the text was used as it was"),
              f"- held out: {calib.get('holdout')} conversations, never calibrated on (ppl-chat, the KL and the judge "
              f"score them); {calib.get('calib_conversations')} conversations calibrate"]
    if calib.get("blocks") != used.get("blocks") or calib.get("seq_len") != used.get("seq_len"):
        lines.append(f"- this summary describes {calib.get('blocks')} x {calib.get('seq_len')} blocks, not the ones the "
                     "variant was built from: calibration ran again since; rerun the variant and the report")
    return lines


def _serving(name: str, entry: dict) -> list[str]:
    serving = entry.get("serving") or {}
    lines = []
    for row in served_by(serving, name):
        engine, command = row["engine"], (serving.get(row["engine"]) or {}).get("command")
        shown = engines.shown_as(engine)
        if row["state"] == "shown":  # the run's own words: "shown on the GPU machine (vllm 0.24.0, date): ...; evidence: ..."
            lines.append(f"- **{shown}**: {md(row['detail'])}" + (f"; served with: {code(command.replace('DIR', f'models/{name}'))}"
                                                                  if command else ""))
        elif row["state"] == "refused":
            lines.append(f"- **{shown}**: refused: {md(row['detail'])}")
        else:
            try_, _, also = (command.replace("DIR", f"models/{name}") if command else row["detail"]).partition(" (or ")
            lines.append(f"- **{shown}**: not shown: no run of a checkpoint like this one was recorded on the GPU "
                         f"machine; the command to try: {code(try_)}" + (f" (or {md(also)}" if also else ""))
    hf = serving.get("hf") or {}
    if hf.get("serves"):
        lines.append(f"- **transformers**: {md(hf.get('how') or 'loads in-process')}")
    return lines or ["- where it is served: not recorded"]


def _speed(name: str, entry: dict, verdict: dict, speed_engine: str | None) -> list[str]:
    state = speed_state(name, entry, verdict.get("speed") or {}, speed_engine, human_size)
    text = "not measured" if state["state"] == "not tried" else state["text"]
    lines = [f"- speed: {md(text)}" + (f" ({md('; '.join(state['more']))})" if state["more"] else "")]
    if state["commands"]:
        lines.append(f"- to measure it: {', '.join(code(c) for c in ['quantize bench models/base', *state['commands']])}")
    row = (verdict.get("speed") or {}).get(name) or {}
    loads = row.get("loads") or []  # a bench with images: every figure names its load
    for load in loads or ([{"label": None, "tokens_per_s": row["tokens_per_s"]}] if row.get("tokens_per_s") else []):
        which = f" ({md(load['label'])})" if load["label"] else ""
        lines.append(f"- output tokens/s by requests in flight{which}: "
                     + ", ".join(f"{c}: {figures.rate(v)}" for c, v in load["tokens_per_s"].items()))
    if row:
        lines.append(f"- measured with {md(row.get('engine'))} {md(row.get('engine_version') or '')} on {md(row.get('device'))}, "
                     f"{md(row.get('date') or '')}, {row.get('input_len')} tokens in, {row.get('output_len')} out"
                     + "".join(f"; {md(load['label'])}: {_images_sent(load)}" for load in loads if load["images_per_request"]))
    kl = entry.get("kl")
    if kl:
        lines.append(f"- drift from the base: KL {figures.kl(kl['kl_mean'])} nats per token (p99 {figures.kl(kl.get('kl_p99'))}), "
                     f"top-1 agreement {figures.share(kl['top1_agreement'])}, on {kl.get('tokens')} tokens of "
                     f"{kl.get('sequences')} held-out conversations")
    return lines


def _images_sent(load: dict) -> str:
    """"the same text with 1 image of 1024 x 1024 pixels (1,369 tokens each, by the model's image processor), 1,525 KV
    tokens a request"."""
    size = load.get("image_size")
    shown = f" of {size[0]} x {size[1]} pixels" if isinstance(size, list) and len(size) == 2 else ""
    tokens = load.get("image_tokens_per_image")
    each = f" ({tokens:,} tokens each, by the model's image processor)" if isinstance(tokens, int) else (
        f" ({tokens} tokens each on average, by the model's image processor)" if tokens is not None else "")
    kv = load.get("kv_tokens_per_request")
    return (f"the same text with {load['images_per_request']} image{'s' if load['images_per_request'] != 1 else ''}"
            f"{shown}{each}" + (f", {kv:,} KV tokens a request" if kv is not None else ""))


def _limitations(entry: dict, verdict: dict, source: dict | None, base: str) -> list[str]:
    lines = []
    if verdict.get("synthetic"):
        lines.append(f"- {TIMING_ONLY.lower()}: {md(verdict['synthetic'].get('why'))}")
    coverage = (entry.get("coverage") or {}).get("suites") or {}
    for suite, c in coverage.items():
        if c.get("state") != DECIDED:
            lines.append(f"- {md(suite)}: {md(c.get('label') or c.get('state'))}" + (f": {md(c['why'])}" if c.get("why") else ""))
    if source:
        what = {"gguf": "converted from a GGUF file (its quantized weights dequantized)",
                "chatglm": "converted from ChatGLM remote code to GlmForCausalLM"}.get(source.get("kind"), "resaved")
        lines.append(f"- the base it is compared with is {md(base)} as `quantize resave` wrote it: {what}, "
                     f"{md(source.get('dtype'))}, from {md(source.get('source'))}")
    margins = sorted({f"{s}: {figures.relative(d['margin']) if part == 'perplexity' else figures.points(-d['margin']) + ' points'}"
                      for part in ("suites", "perplexity") for s, d in (entry.get(part) or {}).items() if d.get("counted")})
    if margins:
        lines.append(f"- GO means the interval of the change lies within the margin ({md('; '.join(margins))}) on few "
                     "items; a smaller loss than that cannot be told apart from none")
    unsandboxed = [s for d in (entry.get("suites") or {}).values() for s in d.get("unsandboxed") or []]
    if unsandboxed:
        lines.append(f"- model-written code ran without the sandbox for: {md(', '.join(map(str, unsandboxed)))}")
    return lines


def _provenance(entry: dict, verdict: dict) -> list[str]:
    env = verdict.get("environment") or {}
    packages = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items() if v)
    recovery = (entry.get("recovery") or {}).get("method")
    when, revision = env.get("generated") or "date not recorded", env.get("git_revision") or "not recorded"
    line = (f"Written by `quantize` from the decision itself (reports/verdict.json, {md(when)}; git revision "
            f"{md(revision)}, params.yaml digest {md(verdict.get('params_sha256') or 'not recorded')}): every figure above "
            "is the verdict's." + (f" Recovery: {md(recovery)}." if recovery else ""))
    return [line, "", f"Machine: {md(env.get('machine') or 'not recorded')}; {md(packages)}."]


def _before_publishing(entry: dict, verdict: dict, origin: dict) -> list[str]:
    checks = []
    if verdict.get("synthetic"):
        checks.append("do not publish: the base's accuracy figures mean nothing (timing only)")
    elif label(entry) != GO:
        checks.append(f"it is {label(entry)}: publish it as what it is, not as a replacement for the base")
    if not origin.get("license"):
        checks.append(f"license: {NOT_STATED}; check the base's terms and add `license:` to the header before publishing")
    if not origin.get("hub_id"):
        checks.append("base_model: the base's source names no Hub repository; add `base_model: ORG/NAME` to the header")
    return [f"> **Before publishing**: {md('; '.join(checks))}.", ""] if checks else []


# ---------------------------------------------------------------- the card

def card_data(name: str, entry: dict, verdict: dict, origin: dict, tasks: dict[str, str]):
    """The YAML header the Hub reads (huggingface_hub.ModelCardData)."""
    from huggingface_hub import ModelCardData

    quant = entry.get("quant") or {}
    vision = ((quant.get("verify") or {}).get("vision") or {}).get("vision_tensors")
    fields = {"base_model": origin.get("hub_id"), "base_model_relation": "quantized" if origin.get("hub_id") else None,
              "license": origin.get("license"), "license_name": origin.get("license_name"),
              "license_link": origin.get("license_link"), "library_name": "transformers",
              "pipeline_tag": "image-text-to-text" if vision else "text-generation", "tags": tags(quant),
              "model_name": name}
    if not verdict.get("synthetic"):  # made-up weights: their figures go on no leaderboard
        fields["eval_results"] = eval_results(name, entry, tasks) or None
    return ModelCardData(**{key: value for key, value in fields.items() if value is not None})


def model_card(name: str, verdict: dict, *, source: dict | None = None, calib: dict | None = None,
               tasks: dict[str, str] | None = None, speed_engine: str | None = None):
    """The variant's card (huggingface_hub.ModelCard: `.content` is the README.md text). `source`: models/base's
    source.json (with its `origin`), `calib`: calib stats.json, `tasks`: {suite: lm-eval task} of params.yaml."""
    from huggingface_hub import ModelCard

    entry = verdict["variants"][name]
    origin = (source or {}).get("origin") or {}
    base = base_name(origin, source)
    quant = entry.get("quant") or {}
    title = f"{TIMING_ONLY}: {name}" if verdict.get("synthetic") else f"{name}: {base}, {quant.get('scheme') or 'quantized'}"
    licence = ([] if origin.get("license") else [f"License: {NOT_STATED}; check before publishing.", ""])
    body = [f"# {md(title)}", "", md(first_sentence(name, entry, verdict, base)), "",
            *_before_publishing(entry, verdict, origin), *licence,
            "## Evaluation", "", *evaluation_table(entry), "",
            "## Decision", "", *_decision(entry), "",
            "## How it was made", "", *_recipe(quant, name), "",
            "## Calibration data", "", *_calibration(quant, calib), "",
            "## Serving", "", *_serving(name, entry), "",
            "## Speed and capacity", "", *_speed(name, entry, verdict, speed_engine), "",
            "## Limitations", "", *(_limitations(entry, verdict, source, base) or ["- none recorded"]), "",
            "## Provenance", "", *_provenance(entry, verdict)]
    data = card_data(name, entry, verdict, origin, tasks or {})
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


def model_cards(verdict: dict, **facts) -> dict[str, str]:
    """{variant: README.md text} for every variant the verdict decided (`facts`: model_card's)."""
    return {name: model_card(name, verdict, **facts).content for name in decided(verdict)}
