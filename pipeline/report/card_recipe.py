"""A model card's creation and reproduction sections: the `quantize` commands and the params.yaml that built the
variant (the base's conversion, the calibration set, the variant's own settings as its quant.json recorded them),
the versions they ran on, the calibration data in words, the checks after quantizing; then what scores it again
with the published checkpoint (its repository id), the suites, engine and margins the verdict was decided with.

Every setting comes from the verdict (the variant's quant.json as it holds it, its suites' items and margins, the
run's environment), the base's source.json and the calibration summary; the engine's dtype and the suites'
generation settings from params.yaml only where it is the one the verdict was decided under (`run`). Nothing here
reads a file.
"""

from __future__ import annotations

import yaml

from pipeline.methods import mixed
from pipeline.report.card_evaluation import scored_by
from pipeline.report.card_usage import serving_name
from pipeline.report.card_header import data_of
from pipeline.outputs import human_size
from pipeline.report.card_text import (checkpoint_names, code, loads_from, md, method_module, names, pipeline_revision,
                                       source_file)
from pipeline.settings import suites as registry

CALIB_DIR = "calib"  # where the recipe's `quantize calib` writes (its calib.out): the held-out conversations too
RANKING_DIR = "ranking"  # where the recipe's `quantize kl --rank` writes a fix's ranking (sensitivity.json beside kl.json)
RANKING = f"{RANKING_DIR}/sensitivity.json"
QUANT_KEYS = {"kv": "kv_cache", "base": "base_method"}  # a method's setting -> the quant.json key recording it
LEFT_OUT = {"method", "batch_size", "sensitivity"}  # not the variant's recipe: memory only, or a path of the run
BUILD_PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")
BASE_FOR_LM_EVAL = "models/base"  # the base as the creation section's `quantize resave` writes it


def variant_settings(quant: dict) -> dict:
    """The variant's params.yaml entry, from what its quant.json recorded of each of its method's settings."""
    module = method_module(quant)
    if module is None:
        return {"method": quant.get("method")}
    found = {"method": quant["method"]}
    for field in module.Params.model_fields:
        key = QUANT_KEYS.get(field, field)
        if field not in LEFT_OUT and key in quant:
            found[field] = quant[key]
    return found


def _yaml(data: dict) -> list[str]:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip().splitlines()


def _versions(verdict: dict, packages) -> str:
    found = ((verdict.get("environment") or {}).get("packages") or {})
    return ", ".join(f"{name} {found[name]}" for name in packages if found.get(name))


def _model_section(source: dict | None, origin: dict) -> tuple[dict, list[str]]:
    """params.yaml's `model` and the command that fetches the source first (a Hub repository)."""
    found = source_file(source) or "SOURCE"
    fetch = []
    if source and source.get("kind") != "gguf" and origin.get("hub_id"):  # a folder of a Hub repository's files
        found = origin["hub_id"].split("/")[-1]
        fetch = [f"hf download {origin['hub_id']} --local-dir {found}"]
    model = {"source": found}
    if (source or {}).get("dtype"):
        model["dtype"] = source["dtype"]
    return model, fetch


def _calib_section(quant: dict, calib: dict | None) -> dict:
    used = quant.get("calibration") or {}
    section = {"source": source_file({"source": (calib or {}).get("source")}) or "conversations.jsonl",
               "out": CALIB_DIR}
    if used.get("seq_len"):
        section["seq_len"] = used["seq_len"]
    if used.get("blocks"):
        section["num_blocks"] = used["blocks"]
    if calib and calib.get("holdout") is not None:
        section["holdout"] = calib["holdout"]
    if calib and calib.get("redaction") is not None:
        section["redact"] = bool(calib["redaction"])
    return section


def creation_params(name: str, entry: dict, verdict: dict, source: dict | None, origin: dict,
                    calib: dict | None) -> tuple[dict, list[str]]:
    """params.yaml (model, calib, variants) and the commands that build the variant with it."""
    quant = entry.get("quant") or {}
    model, fetch = _model_section(source, origin)
    variants = {}
    commands = [*fetch, "quantize resave", "quantize calib"]
    fix_of = entry.get("fix_of")
    fixed = ((verdict.get("variants") or {}).get(fix_of) or {}).get("quant") if fix_of else None
    variants[name] = variant_settings(quant)
    if fixed:  # the fix: its W4A16 variant first, its groups ranked by the KL each costs, then the variant itself
        variants = {fix_of: variant_settings(fixed), name: {**variants[name], "sensitivity": RANKING}}
        commands += [f"quantize variant {fix_of}", f"quantize kl models/{fix_of} --rank --out {RANKING_DIR}/kl.json"]
    commands.append(f"quantize variant {name}")
    return {"model": model, "calib": _calib_section(quant, calib), "variants": variants}, commands


def creation(name: str, entry: dict, verdict: dict, *, source: dict | None, origin: dict,
             calib: dict | None) -> list[str]:
    """The creation section's lines (under its heading)."""
    quant = entry.get("quant") or {}
    env = verdict.get("environment") or {}
    params, commands = creation_params(name, entry, verdict, source, origin, calib)
    made = (f"Made with `quantize` ({pipeline_revision(env)}) "
            f"on {md(_versions(verdict, BUILD_PACKAGES) or 'package versions not recorded')}"
            + (f", on {md(env['machine'])}" if env.get("machine") else "")
            + (f", {md(env['generated'])}" if env.get("generated") else "") + ": this params.yaml, then the commands "
            "below (the variant's folder is models/" + md(name) + ").")
    unknown = ([f"{code('SOURCE')} stands for the checkpoint the base was converted from, which was not recorded "
                "with this card.", ""] if params["model"]["source"] == "SOURCE" else [])
    return [made, "", "```yaml", *_yaml(params), "```", "", "```bash", *commands, "```", "", *unknown,
            *llm_compressor(quant, verdict), *recipe_facts(quant), *calibration(quant, calib)]


RECIPE_FILE = "recipe.yaml"  # what llm-compressor writes beside the weights it saves: the recipe as it ran it


def llm_compressor(quant: dict, verdict: dict) -> list[str]:
    """The recipe as llm-compressor runs it, with llm-compressor alone: its own recipe.yaml, shipped with the
    checkpoint, applied by `oneshot` to the base as converted above, with calibration text of the reader's own where
    the method needs data (the set used here is private)."""
    weights_from = method_module({"method": quant.get("base_method")}) or method_module(quant)
    used = quant.get("calibration") or {}
    needs_data = weights_from is None or weights_from.NEEDS_CALIBRATION
    version = _versions(verdict, ("llmcompressor",))
    arguments = ['model="models/base"', f'recipe="{RECIPE_FILE}"']
    if needs_data:
        arguments += ['dataset=load_dataset("json", data_files="calibration.jsonl", split="train")',
                      f"max_seq_length={used.get('seq_len') or 2048}",
                      f"num_calibration_samples={used.get('blocks') or 512}"]
    arguments.append('output_dir="quantized"')
    head = (f"The recipe as llm-compressor runs it is the checkpoint's own `{RECIPE_FILE}` (llm-compressor writes it "
            "beside the weights). With llm-compressor" + (f" ({md(version)})" if version else "") + " alone, on the base "
            "as converted above" + (", and calibration conversations of your own, a `text` field each (the set used "
            "here is private)" if needs_data else " (no calibration data: the method rounds each weight on its own)")
            + ":")
    return [head, "", "```python", *(["from datasets import load_dataset"] if needs_data else []),
            "from llmcompressor import oneshot", "", "oneshot(" + ", ".join(arguments) + ")", "```", ""]


def applicable_ignores(quant: dict) -> dict[str, str]:
    """The recipe's ignore patterns that apply to this checkpoint, each with why: a vision tower's only where it has
    one, a MoE router's only on a MoE architecture; the output head's without a claim about its size (it may be tied
    to the embedding)."""
    vision = ((quant.get("verify") or {}).get("vision") or {}).get("vision_tensors")
    moe = "moe" in str(quant.get("architecture") or "").lower()
    found = {}
    for pattern, why in (quant.get("ignored") or {}).items():
        if ("visual" in pattern and not vision) or (pattern.endswith("mlp\\.gate$") and not moe):
            continue
        found[pattern] = ("output head: its error goes straight into every logit" if pattern == "lm_head" else why)
    return found


def recipe_facts(quant: dict) -> list[str]:
    """What the recipe kept out, the groups a mixed variant keeps in 8 bits, the checks after quantizing."""
    lines = []
    module = method_module(quant)
    if module is not None:
        lines.append(f"- method: {md(quant['method'])}: {md(module.SUMMARY)}")
    for pattern, why in applicable_ignores(quant).items():
        lines.append(f"- kept in full precision: {code(pattern)} ({md(why)})")
    if quant.get("groups_in_8_bits") is not None:
        kept = [checkpoint_names(g["name"]) for g in quant.get("groups") or [] if g.get("scheme") == mixed.HIGH_SCHEME]
        lines.append(f"- kept in 8 bits (W8A16): {quant['groups_in_8_bits']} of {quant.get('groups_total')} groups, "
                     "those whose int4 error cost the W4A16 variant most KL from the base: " + md(", ".join(kept)))
    verify = quant.get("verify") or {}
    plan = verify.get("plan") or {}
    checks = [f"{plan.get('quantized')} of {plan.get('planned')} planned linear layers quantized" if plan else
              f"{quant.get('quantized_modules')} linear layers quantized",
              "reloads and generates" if verify.get("reloads") else "reload not checked"]
    if (verify.get("layer_error") or {}).get("max") is not None:
        checks.append(f"largest relative layer error {verify['layer_error']['max']:.4f} "
                      f"({verify['layer_error'].get('worst_layer')})")
    lines.append(f"- checked after quantizing: {md('; '.join(checks))}")
    if quant.get("size_bytes"):
        lines.append(f"- size: {human_size(quant['size_bytes'])}")
    return lines


REDACTED = {"email": "e-mail addresses", "phone": "phone numbers", "card": "card numbers", "iban": "IBANs",
            "ip": "IP addresses"}  # pipeline/calib/redact.py's kinds, in words (which kinds, never how many)


def calibration(quant: dict, calib: dict | None) -> list[str]:
    """The calibration data in words: how many tokens of which conversations, what kinds of personal data were
    redacted, what was held out. A method whose weights no data shapes (RTN, and a mixed variant on RTN) says so."""
    weights_from = method_module({"method": quant.get("base_method")}) or method_module(quant)
    used = quant.get("calibration") or {}
    blocks = f"{used.get('blocks')} blocks of {used.get('seq_len')} tokens"
    lines = []
    if weights_from is not None and not weights_from.NEEDS_CALIBRATION:
        lines.append(f"- calibration: none: the {weights_from.NAME} method rounds each weight on its own, so no data "
                     f"shaped them ({blocks} were read only to check the checkpoint)")
    elif not calib:
        lines.append(f"- calibration: {blocks}; where they came from was not recorded with this card")
    else:
        kinds = [REDACTED.get(kind, kind) for kind in calib.get("redactions") or {}]
        redacted = (f", {names(kinds) if kinds else 'personal data'} redacted" if calib.get("redaction") else "")
        checksum = f", sha256 {used['sha256']}" if used.get("sha256") else ""
        lines.append(f"- calibration: {blocks} from {calib.get('calib_conversations')} conversations of the "
                     f"publisher's own logs{redacted}; {calib.get('holdout')} more conversations held out, never "
                     f"calibrated on. The set is private, not published with the model (its blocks{checksum})")
        if held := images_held(calib, used):
            lines.append(f"- {held}")
    if quant.get("groups_in_8_bits") is not None:
        lines.append("- the groups kept in 8 bits were ranked by the KL from the base each costs, on the held-out "
                     "conversations")
    return lines


def images_held(calib: dict, used: dict) -> str | None:
    """What the calibration build held of images, in words (stats.json; quant.json's calibration says which the
    variant calibrated on): conversations, images and their tokens, or the images a text-only base dropped."""
    if calib.get("images_dropped"):
        return (f"calibration images: {calib['images_dropped']} dropped, the base has no vision tower; it calibrated "
                "on the conversations' text")
    if not calib.get("images"):
        return None
    samples = (f"{calib.get('image_samples', 0)} of them taken as samples ({calib.get('image_sample_images', 0)} "
               f"images, {calib.get('image_sample_tokens', 0):,} tokens with each image as its image tokens)")
    how = ("calibrated on with the text blocks" if used.get("image_samples") else
           "not calibrated on: the quantize stage calibrated on the text blocks only")
    return (f"calibration images: {calib.get('image_conversations')} conversations held {calib['images']} images, kept "
            f"as their pixels alone (no metadata, no file names); {samples}, {how}")


# ---------------------------------------------------------------- scoring it again

def reproduction_params(name: str, entry: dict, verdict: dict, tasks: dict[str, str], run: dict | None) -> dict:
    """params.yaml's engine, suites and verdict margins the verdict was decided with (the generation settings and
    the engine's dtype only where `run`, the params.yaml of that run, has them)."""
    suites, margins = {}, {}
    run_suites = (run or {}).get("suites") or {}
    for part in ("suites", "perplexity"):
        for suite, d in (entry.get(part) or {}).items():
            setting = {"task": tasks.get(suite) or data_of(suite, tasks)[0], "limit": d.get("n")}
            known = run_suites.get(suite) or {}
            setting.update({k: v for k, v in known.items() if k in ("task", "limit")
                            or (k == "max_new_tokens" and part == "suites")})
            declared = registry.find(setting["task"])  # a suite that scores the held-out conversations `quantize calib` writes
            if known.get("options", {}).get("data") or (declared is not None and declared.held_out):
                setting["options"] = {"data": f"{CALIB_DIR}/holdout.jsonl"}
            suites[suite] = setting
            if d.get("margin") is not None:
                margins[suite] = d["margin"]
    scored = scored_by(name, verdict)  # as the evaluation section says it
    engine = {"name": (run or {}).get("engine") or scored[0]} if (run or {}).get("engine") or scored else {}
    if (run or {}).get("dtype"):
        engine["dtype"] = run["dtype"]
    confidence = next((d.get("confidence") for part in ("suites", "perplexity")
                       for d in (entry.get(part) or {}).values() if d.get("confidence")), None)
    verdict_section = {"margins": {"suites": margins}}
    if confidence:
        verdict_section = {"confidence": confidence, **verdict_section}
    return {**({"engine": engine} if engine else {}), "suites": suites, "verdict": verdict_section}


def reproduction(name: str, entry: dict, verdict: dict, *, tasks: dict[str, str], repo_id: str | None,
                 run: dict | None) -> list[str]:
    """The reproduction section's lines (under its heading): the public suites only (a suite of the publisher's own
    held-out data is named as private and left out of every command)."""
    repo = loads_from(name, repo_id)
    env = verdict.get("environment") or {}
    params = reproduction_params(name, entry, verdict, tasks, run)
    held_out = [s for s, d in params["suites"].items() if d.get("options")]
    for suite in held_out:
        del params["suites"][suite]
        params["verdict"]["margins"]["suites"].pop(suite, None)
    public = params["suites"]
    lm_eval = _versions(verdict, ("lm-eval",))
    lines = []
    if public:
        tasks_run = ",".join(d["task"] for d in public.values())
        lines += [f"The public suites are lm-eval tasks of the evals/ folder of {pipeline_revision(env)}"
                  f"{', run by ' + md(lm_eval) if lm_eval else ''}: `lm_eval` scores the published checkpoint on them "
                  f"with {serving_name()}, and the base the same way for the paired comparison (models/base: the "
                  "base as the creation section's `quantize resave` converts it, the very model it was compared "
                  "with):", "",
                  "```bash", *[f"lm_eval --model vllm --model_args pretrained={model} --include_path evals "
                               f"--tasks {tasks_run} --apply_chat_template --log_samples --output_path lm_eval/{out}"
                               for model, out in ((repo, name), (BASE_FOR_LM_EVAL, "base"))], "```", "",
                  "The decision above compares the two item by item: glm-quant-pipeline's `quantize report` does it "
                  "from these suites, engine and margins added to the creation section's params.yaml:", "",
                  "```yaml", *_yaml(params), "```", "",
                  "```bash", *([f"hf download {repo} --local-dir models/{name}"] if repo_id else []),
                  "quantize resave", "quantize eval models/base", f"quantize eval models/{name}", "quantize report",
                  "```"]
    if held_out:
        lines += ([""] if lines else []) + [
            f"{md(names(held_out))} score{'s' if len(held_out) == 1 else ''} held-out conversations of the publisher's "
            "own logs, which are private: not published with the model, so left out of these commands."]
    return lines or ["No public suite was counted: nothing here can be scored again from public data."]
