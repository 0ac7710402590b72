"""The Hub's rules for a model card's metadata, as a reader of the Hub checks them (issue 68 item 8), each from where
the Hub states it, so a test can hold every card of both examples to them without a network:

- the licence identifiers: hub-docs docs/hub/repositories-licenses.md ("A full list of the available licenses"),
  its region of identifiers as of commit 008d54d; `other` needs `license_name` (and a link or LICENSE file);
- `base_model`: Hub repository ids (huggingface_hub's validate_repo_id, with their owner); `base_model_relation`:
  one of adapter, merge, quantized, finetune (the Hub's model tree; published quantized cards, GGUF quantizations of a
  model included, declare `base_model: <the original>` with `quantized`), and only beside a `base_model`;
- `model-index`: what hub-docs modelcard.md requires of each result (task type, dataset type and name, metric type
  and a numeric value), parsed by huggingface_hub's own model_index_to_eval_results; its name a repository id;
- the other keys: ModelCardData's own fields (and base_model_relation, which it passes through) only.
"""

from __future__ import annotations

import numbers

LICENSES = {
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1",
    "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "lppl-1.3c", "ms-pl",
    "mpl-2.0", "odc-by", "odbl", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib", "pddl",
    "lgpl-lr", "deepfloyd-if-license", "llama2", "gemma", "unknown", "other"}
RELATIONS = {"adapter", "merge", "quantized", "finetune"}
PIPELINE_TAGS = {"text-generation", "image-text-to-text"}  # the two this project's checkpoints are


def _repo_id_problem(value, key: str) -> str | None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except (HFValidationError, TypeError) as exc:
        return f"{key}: {value!r} is no Hub repository id ({exc})"
    return None if str(value).count("/") == 1 else f"{key}: {value!r} names no owner (ORG/NAME)"


def problems(card, *, hub: bool) -> list[str]:
    """Every way the card's metadata breaks the Hub's rules (`hub`: a card for a Hub repository, whose model-index
    name must be a repository id)."""
    from huggingface_hub import ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    data, found = card.data.to_dict(), []
    import inspect

    known = set(inspect.signature(ModelCardData.__init__).parameters) - {"self", "kwargs", "eval_results",
                                                                          "ignore_metadata_errors"}
    known |= {"model-index", "base_model_relation"}
    found += [f"{key}: not a model card field" for key in data if key not in known]
    licence = data.get("license")
    if licence is not None and licence not in LICENSES:
        found.append(f"license: {licence!r} is not one of the Hub's identifiers")
    if licence == "other" and not data.get("license_name"):
        found.append("license: other needs license_name")
    base = data.get("base_model")
    for one in ([base] if isinstance(base, str) else base or []):
        found += [p for p in [_repo_id_problem(one, "base_model")] if p]
    relation = data.get("base_model_relation")
    if relation is not None and (relation not in RELATIONS or not base):
        found.append(f"base_model_relation: {relation!r} (one of {sorted(RELATIONS)}, beside a base_model)")
    if data.get("library_name") != "transformers":
        found.append(f"library_name: {data.get('library_name')!r}, not transformers")
    if data.get("pipeline_tag") not in PIPELINE_TAGS:
        found.append(f"pipeline_tag: {data.get('pipeline_tag')!r}")
    if not all(isinstance(tag, str) and tag for tag in data.get("tags") or []):
        found.append("tags: each a non-empty string")
    index = data.get("model-index")
    if index is not None:
        name, results = model_index_to_eval_results(index)
        if hub:
            found += [p for p in [_repo_id_problem(name, "model-index name")] if p]
        for r in results:
            if not (r.task_type and r.dataset_type and r.dataset_name and r.metric_type):
                found.append(f"model-index: {r.task_name}: a task type, dataset type and name and metric type each")
            if not isinstance(r.metric_value, numbers.Real) or isinstance(r.metric_value, bool):
                found.append(f"model-index: {r.task_name} {r.metric_type}: {r.metric_value!r} is not a number")
    return found
