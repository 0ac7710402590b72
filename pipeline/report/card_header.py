"""A model card's YAML header, the metadata the Hub reads (huggingface_hub's ModelCardData): `base_model` with
`base_model_relation: quantized`, the base's licence as its source states it, `library_name`, `pipeline_tag`, tags,
and the evaluation results.

Where the results go. The Hub's documentation (docs/hub/model-cards.md, "Evaluation Results"; the spec in
hub-docs' modelcard.md) still parses `model-index` from the README's front matter and shows it on the model page;
its newer `.eval_results/*.yaml` files (docs/hub/eval-results.md; huggingface_hub's EvalResultEntry) are scores on a
registered *benchmark* dataset (one with an eval.yaml naming the task, its config and split and the harness that
scores it), aggregated into that benchmark's leaderboard. These figures are paired comparisons against the base on
this project's own tasks (evals/: a GSM8K or HumanEval subset with its own prompt and scoring, the publisher's
held-out conversations, Alice in Wonderland), often on a few dozen items: a leaderboard would rank them beside full
runs of the benchmark's own harness. So they go in `model-index`, each dataset with its Hub id, config and split
where it has one and the number of items scored in its name, and no `.eval_results/` file is written.

Each counted suite's figure (accuracy, perplexity, the judge's win rate) is verdict.json's number, unrounded; an
accuracy suite adds its recovery (this model's accuracy over the base's, metric type `recovery`), a perplexity
suite its relative rise against the base (metric type `perplexity_change`, named with its 95% interval and the
margin it was judged against): never a recovery, which would read as a lower perplexity. The model-index's name
is the Hub repository id (a local record's: the variant's name). A run on made-up weights (verdict.json's
`synthetic`) puts no figure in the header.
"""

from __future__ import annotations

from pipeline.report.card_text import method_module
from pipeline.settings import lm_eval_tasks
from pipeline.settings import suites as registry
import pipeline.verdict.facts as facts
from pipeline.verdict.figures import relative

JUDGE_DATA = ("quant_judge", "held-out prompts of the publisher's own logs, judged against the base's answers", None,
              None)
RECOVERY_NAMES = {"accuracy": "this model's accuracy / the base's"}


def data_of(suite: str, tasks: dict[str, str]) -> tuple[str, str, str | None, str | None]:
    """The data a suite scores, as its YAML declares it (metadata.suite.card: pipeline/settings/suites.py) or a plain
    lm-eval task's YAML says it (its dataset_path: pipeline/settings/lm_eval_tasks.py): (dataset type, name, config,
    split); a task no YAML names, by its name."""
    task = tasks.get(suite) or suite
    card = getattr(lm_eval_tasks.suite_quietly(task), "card", None)
    return (card.dataset, card.describes, card.config, card.split) if card else (task, task, None, None)


def task_type(suite: str, tasks: dict[str, str]) -> str:
    """The Hub's task of what a suite scores (metadata.suite.card.task_type; text-generation by default)."""
    card = getattr(lm_eval_tasks.suite_quietly(tasks.get(suite) or suite), "card", None)
    return card.task_type if card else registry.DEFAULT_TASK_TYPE


def tags(quant: dict) -> list[str]:
    """The scheme's tags: the method's (awq / gptq / rtn / mixed and the scheme it writes), a mixed variant's base
    method, compressed-tensors and quantized."""
    from pipeline import methods

    base = methods.method(quant["base_method"]) if methods.is_method(quant.get("base_method")) else None
    modules = [method_module(quant), base]
    return list(dict.fromkeys([*(tag for m in modules if m is not None for tag in m.CARD_TAGS), "compressed-tensors",
                               "quantized"]))


def counted_figures(entry: dict) -> list[dict]:
    """Per counted suite its figures as verdict.json holds them: {suite, kind, metric, value, recovery, n}, the
    right/wrong suites (accuracy), the perplexity suites, then the judge (win rate)."""
    rows = []
    for suite, _, d in sorted(facts.counted_entries(entry, facts.ACCURACY)):
        rows.append({"suite": suite, "kind": "accuracy", "metric": "accuracy", "value": d["variant_score"],
                     "recovery": d.get("recovery"), "n": d.get("n")})
    for suite, _, d in sorted(facts.counted_entries(entry, facts.PERPLEXITY)):
        rows.append({"suite": suite, "kind": "perplexity", "metric": "perplexity", "value": d["variant_ppl"],
                     "recovery": None, "n": d.get("n"), "change": d.get("change"), "ci_low": d.get("ci_low"),
                     "ci_high": d.get("ci_high"), "margin": d.get("margin")})
    for suite, _, judge in facts.counted_entries(entry, facts.JUDGE):
        rows.append({"suite": suite, "kind": "judge", "metric": "win_rate", "value": judge["summary"]["win_rate"],
                     "recovery": None, "n": judge["summary"].get("n")})
    return rows


UNITS = {"accuracy": "items", "perplexity": "documents", "judge": "pairs"}


def eval_results(entry: dict, tasks: dict[str, str]) -> list:
    """huggingface_hub EvalResults: per counted suite its figure and, where defined, its recovery (verdict.json's
    numbers, unrounded), each dataset with its config and split and the items scored in its name."""
    from huggingface_hub import EvalResult

    results = []
    for row in counted_figures(entry):
        kind, suite = row["kind"], row["suite"]
        dataset, name, config, split = JUDGE_DATA if kind == "judge" else data_of(suite, tasks)
        scored = f" ({row['n']} {UNITS[kind]} scored)" if row["n"] else ""
        common = {"task_type": task_type(suite, tasks), "task_name": suite,
                  "dataset_type": dataset, "dataset_name": name + scored, "dataset_config": config,
                  "dataset_split": split}
        results.append(EvalResult(**common, metric_type=row["metric"], metric_value=row["value"],
                                  metric_name=f"{suite} {row['metric'].replace('_', ' ')}"))
        if row["recovery"] is not None:
            results.append(EvalResult(**common, metric_type="recovery", metric_value=row["recovery"],
                                      metric_name=f"{suite} recovery ({RECOVERY_NAMES[kind]})"))
        if row.get("change") is not None:
            results.append(EvalResult(**common, metric_type="perplexity_change", metric_value=row["change"],
                                      metric_name=f"{suite} perplexity change against the base (95% interval "
                                                  f"{relative(row['ci_low'])} to {relative(row['ci_high'])}; margin "
                                                  f"{relative(row['margin'])})"))
    return results


def card_data(name: str, entry: dict, verdict: dict, origin: dict, tasks: dict[str, str], repo_id: str | None):
    """The YAML header the Hub reads (huggingface_hub.ModelCardData)."""
    from huggingface_hub import ModelCardData

    quant = entry.get("quant") or {}
    vision = ((quant.get("verify") or {}).get("vision") or {}).get("vision_tensors")
    fields = {"base_model": origin.get("hub_id"), "base_model_relation": "quantized" if origin.get("hub_id") else None,
              "license": origin.get("license"), "license_name": origin.get("license_name"),
              "license_link": origin.get("license_link"), "library_name": "transformers",
              "pipeline_tag": "image-text-to-text" if vision else "text-generation", "tags": tags(quant),
              "model_name": repo_id or name}
    if not verdict.get("synthetic"):  # made-up weights: their figures go on no model page
        fields["eval_results"] = eval_results(entry, tasks) or None
    return ModelCardData(**{key: value for key, value in fields.items() if value is not None})
