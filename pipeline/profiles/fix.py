"""`quantize profile --fix VARIANT`: dvc.yaml edited in place so that `dvc repro` builds, measures and decides the fix
of a W4A16 variant (VARIANT-mixed: pipeline/stages/fix.py), and the offer of that command wherever a verdict marks
such a variant NO-GO without a fix (`quantize profile`, `quantize show-verdict`).

The edit is a careful text edit, every comment and line kept: VARIANT joins the fix stage's one-line list
(`foreach: [rtn-w4a16]`) (and the rank stage's, leaving the kl stage's, where the rank stage does not list it yet:
the fix reads its ranking), VARIANT-mixed joins the kl and evaluate stages' lists and every other list that names
every variant (the GPU profile's warm, judge and bench), and beside each run of deps that names a file of every
variant (the report's quant.json and config.json) VARIANT-mixed's file is added. No stage of VARIANT's own changes
(its ranking is measured whether or not a fix is built), so `dvc repro` then runs the fix's stages and the report.
The new text is parsed again and must equal the old document with exactly those additions, and params.yaml must
accept it (pipeline/settings/checks.py), before it replaces dvc.yaml (one rename).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

from pipeline.errors import UserError
from pipeline.settings import fixes

FLOW = re.compile(r"^(?P<head>\s+foreach:\s*\[)(?P<items>[^\]\n#]*)(?P<tail>\]\s*(#.*)?)$")
# a per-model dep: a file of each model (models/<m>/quant.json) or each model's whole folder (models/<m>)
PER_MODEL_DEP = re.compile(r"^(?P<indent>\s+)- (?P<root>models|results)/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)"
                           r"(?:/(?P<file>[^\s#:]+))?(?P<rest>(?:\s.*)?)$")


def _dep(root: str, model: str, file: str | None) -> str:
    """A per-model dep's path: root/model/file, or root/model for the model's whole folder."""
    return f"{root}/{model}/{file}" if file else f"{root}/{model}"


def _items(text: str) -> list[str]:
    return [item.strip().strip("'\"") for item in text.split(",") if item.strip()]


def _stage_lines(lines: dict[tuple, int], names: list[str], total: int) -> dict[str, tuple[int, int]]:
    """Each stage's lines, 0-based [start, end), from where safe_yaml found its key."""
    starts = sorted((lines[("stages", name)] - 1, name) for name in names if ("stages", name) in lines)
    return {name: (start, starts[i + 1][0] if i + 1 < len(starts) else total) for i, (start, name) in enumerate(starts)}


def _dep_runs(text_lines: list[str], start: int, end: int) -> dict[tuple[str, str | None], list[tuple[int, str]]]:
    """{(root, file): [(line index, model name)]} of the per-model dep lines of one stage (models/<m>/quant.json)."""
    runs: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for i in range(start, end):
        found = PER_MODEL_DEP.match(text_lines[i].rstrip("\n"))
        if found:
            runs.setdefault((found["root"], found["file"]), []).append((i, found["name"]))
    return runs


def _edited(items: list[str], leaves: str | None, joins: str | None, stage: str = "",
            changes: list[str] | None = None) -> list[str]:
    """A stage's list with `leaves` gone and `joins` at its end (once), each change told in `changes`."""
    said = changes if changes is not None else []
    if leaves in items:
        items = [item for item in items if item != leaves]
        said.append(f"stages.{stage}.foreach: - {leaves} (the rank stage measures its KL, with its ranking)")
    if joins and joins not in items:
        items = [*items, joins]
        said.append(f"stages.{stage}.foreach: + {joins}")
    return items


def _list_changes(stages: dict, variant: str) -> tuple[dict[str, str], dict[str, str]]:
    """({stage: the name joining its list}, {stage: the name leaving it}) for the fix of `variant`."""
    from pipeline.settings.checks import evaluates_every_suite, ranks, runs_command

    fixed = fixes.fix_name(variant)
    fix_stages = [name for name, stage in stages.items() if runs_command(stage, "fix")]
    if not fix_stages:
        raise UserError("dvc.yaml has no fix stage (`cmd: quantize fix ${item}`) to add the variant to; copy the fix "
                        "stage of pipeline/profiles/cpu-demo/dvc-stages.yaml into it, or `quantize profile cpu-demo` "
                        "(or gpu) to start from a profile's dvc.yaml")
    rank_stages = [name for name, stage in stages.items() if ranks(stage)]
    if not rank_stages:
        raise UserError("dvc.yaml has no rank stage (`cmd: quantize kl models/${item} --rank`) to rank the variant's "
                        "groups, which its fix reads; copy the rank stage of pipeline/profiles/cpu-demo/dvc-stages.yaml "
                        "into it, then run this again; nothing was changed")
    measured = [name for name, stage in stages.items()
                if (runs_command(stage, "kl") and not ranks(stage)) or evaluates_every_suite(stage)]
    evaluated = [m for name in measured if evaluates_every_suite(stages[name]) for m in stages[name]["foreach"]]
    every = set(evaluated) - {"base", fixed}  # the variants (and fixes) the run decides
    grows = {name: fixed for name in measured}
    for name, stage in stages.items():  # another per-model list covering every variant (the GPU's warm, judge, bench)
        listed = stage.get("foreach")
        if name not in grows and name not in fix_stages and name not in rank_stages and isinstance(listed, list) \
                and every and every <= set(listed):
            grows[name] = fixed
    grows.update({name: variant for name in fix_stages})
    shrinks = {}
    if not any(variant in (stages[name].get("foreach") or []) for name in rank_stages):  # ranked from now on
        grows[rank_stages[0]] = variant
        shrinks = {name: variant for name in measured if runs_command(stages[name], "kl")
                   and variant in (stages[name].get("foreach") or [])}
    return grows, shrinks


def plan(text: str, data: dict, lines: dict[tuple, int], variant: str) -> tuple[str, list[str], dict]:
    """The edited text, the changes in words, and the document the edited text must parse to."""
    from pipeline.settings.checks import evaluates_every_suite

    stages = data.get("stages") or {}
    fixed = fixes.fix_name(variant)
    grows, shrinks = _list_changes(stages, variant)
    evaluated = [m for stage in stages.values() if isinstance(stage, dict) and evaluates_every_suite(stage)
                 for m in stage["foreach"]]
    every = set(evaluated) - {"base", fixed}
    text_lines = text.splitlines(keepends=True)
    expected, changes = copy.deepcopy(data), []
    ranges = _stage_lines(lines, list(stages), len(text_lines))
    inserts: dict[int, list[str]] = {}
    for name in sorted(set(grows) | set(shrinks), key=lambda stage: lines.get(("stages", stage), 0)):  # file order
        line = lines.get(("stages", name, "foreach"))
        found = FLOW.match(text_lines[line - 1].rstrip("\n")) if line else None
        if not found:
            raise UserError(f"dvc.yaml:{line or '?'}: stages.{name}.foreach is not a one-line list such as [a, b]; "
                            f"write it as one (its names in full), then run this again; nothing was changed")
        items = _edited(_items(found["items"]), shrinks.get(name), grows.get(name), name, changes)
        if items == _items(found["items"]):
            continue
        newline = text_lines[line - 1][len(text_lines[line - 1].rstrip("\n")):]
        text_lines[line - 1] = f"{found['head']}{', '.join(items)}{found['tail']}{newline}"
        expected["stages"][name]["foreach"] = _edited(list(stages[name]["foreach"]), shrinks.get(name), grows.get(name))
    for name, (start, end) in ranges.items():
        added = []
        for (root, file), run in _dep_runs(text_lines, start, end).items():
            names = {model for _, model in run}
            if fixed in names or not every or not every <= names:
                continue
            dep, last = _dep(root, fixed, file), run[-1]
            inserts.setdefault(last[0], []).append(f"{PER_MODEL_DEP.match(text_lines[last[0]])['indent']}- {dep}\n")
            deps = expected["stages"][name].get("do", expected["stages"][name])["deps"]
            deps.insert(deps.index(_dep(root, last[1], file)) + 1, dep)
            added.append(dep)
        if added:
            changes.append(f"stages.{name} deps: + {', '.join(added)}")
    out = []
    for i, line in enumerate(text_lines):
        out.append(line if i not in inserts or line.endswith("\n") else line + "\n")
        out += inserts.get(i, [])
    return "".join(out), changes, expected


PARAMS_LIST = re.compile(r"^(?P<head>\s+variants:\s*\[)(?P<items>[^\]\n#]*)(?P<tail>\]\s*(#.*)?)$")
PARAMS_BLOCK = re.compile(r"^(?P<indent>\s+)variants:\s*(?P<comment>#.*)?$")  # its items on the lines below


def plan_params(text: str, lines: dict[tuple, int], path: Path, variants: list[str]) -> str:
    """params.yaml's text with `fix.variants` set to `variants`, written as a one-line list (its comment kept)."""
    line = lines.get(("fix", "variants"))
    text_lines = text.splitlines(keepends=True)
    if not line:
        raise UserError(f"{path}: fix.variants is missing; write `variants: []` under `fix:` (the fixes the run "
                        "builds), then run this again; nothing was changed")
    here = text_lines[line - 1].rstrip("\n")
    newline = text_lines[line - 1][len(here):]
    if found := PARAMS_LIST.match(here):
        text_lines[line - 1] = f"{found['head']}{', '.join(variants)}{found['tail']}{newline}"
        return "".join(text_lines)
    found = PARAMS_BLOCK.match(here)
    end = line
    while found and end < len(text_lines) and re.match(r"^\s*- \S", text_lines[end]):
        end += 1
    if not found:
        raise UserError(f"{path}:{line}: fix.variants is neither a one-line list such as [a, b] nor a list of `- a` "
                        "lines; write it as one, then run this again; nothing was changed")
    comment = f"  {found['comment']}" if found["comment"] else ""
    text_lines[line - 1:end] = [f"{found['indent']}variants: [{', '.join(variants)}]{comment}{newline}"]
    return "".join(text_lines)


def plan_removal(text: str, data: dict, lines: dict[tuple, int], variant: str) -> tuple[str, list[str], dict]:
    """The inverse of `plan`: VARIANT leaves the fix stages' lists, VARIANT-mixed every list and every dep line (its
    ranking stays: the rank stage measures it fix or no fix)."""
    from pipeline.settings.checks import runs_command

    stages = data.get("stages") or {}
    fixed = fixes.fix_name(variant)
    text_lines = text.splitlines(keepends=True)
    expected, changes, dropped = copy.deepcopy(data), [], set()
    for name, stage in stages.items():
        listed = stage.get("foreach") if isinstance(stage, dict) else None
        leaves = variant if runs_command(stage, "fix") else fixed
        if not isinstance(listed, list) or leaves not in listed:
            continue
        line = lines.get(("stages", name, "foreach"))
        found = FLOW.match(text_lines[line - 1].rstrip("\n")) if line else None
        if not found:
            raise UserError(f"dvc.yaml:{line or '?'}: stages.{name}.foreach is not a one-line list such as [a, b]; "
                            f"write it as one (its names in full), then run this again; nothing was changed")
        items = [item for item in _items(found["items"]) if item != leaves]
        newline = text_lines[line - 1][len(text_lines[line - 1].rstrip("\n")):]
        text_lines[line - 1] = f"{found['head']}{', '.join(items)}{found['tail']}{newline}"
        expected["stages"][name]["foreach"] = [item for item in listed if item != leaves]
        changes.append(f"stages.{name}.foreach: - {leaves}")
    for name, (start, end) in _stage_lines(lines, list(stages), len(text_lines)).items():
        for (root, file), run in _dep_runs(text_lines, start, end).items():
            for index, model in run:
                if model == fixed:
                    dropped.add(index)
                    expected["stages"][name].get("do", expected["stages"][name])["deps"].remove(_dep(root, fixed, file))
                    changes.append(f"stages.{name} deps: - {_dep(root, fixed, file)}")
    return "".join(line for i, line in enumerate(text_lines) if i not in dropped), changes, expected


def add_fix(root: Path, variant: str, params_file: Path | None = None) -> list[str]:
    """Edits root/dvc.yaml (and params.yaml's fix.variants) to run the fix of `variant`; returns the changes in words
    ([] when it runs already)."""
    return _edit(root, variant, params_file, remove=False)


def remove_fix(root: Path, variant: str, params_file: Path | None = None) -> list[str]:
    """`quantize profile --unfix VARIANT`: the fix of `variant` out of dvc.yaml and params.yaml's fix.variants (its
    files stay where they are; the report names and ignores them); returns the changes in words."""
    return _edit(root, variant, params_file, remove=True)


def _edit(root: Path, variant: str, params_file: Path | None, remove: bool) -> list[str]:
    import yaml

    from pipeline import safe_yaml
    from pipeline.settings import params as params_mod
    from pipeline.settings.checks import check_against_dvc

    params_path = params_file or root / "params.yaml"
    params = params_mod.load(params_path)  # checks today's dvc.yaml too
    fixes.variant_settings(params, variant)  # a W4A16 variant of params.yaml
    raw, params_lines = safe_yaml.load(params_path, "a params.yaml")
    if "fix" not in (raw or {}):
        raise UserError(f"{params_path}: no `fix:` section, which the fix stage's params name (DVC reads it); add "
                        "`fix: {max_bits: 4.5, variants: []}` (the budget in mean bits per weight, the fixes the run "
                        "builds), then run this again; nothing was changed")
    path = root / "dvc.yaml"
    data, lines = safe_yaml.load(path, "a dvc.yaml")
    text = path.read_text(encoding="utf-8")
    new, changes, expected = (plan_removal if remove else plan)(text, data, lines, variant)
    named = [v for v in params.fix.variants if v != variant] + ([] if remove else [variant])
    params_text = params_path.read_text(encoding="utf-8")
    new_params = plan_params(params_text, params_lines, params_path, named) if named != params.fix.variants else params_text
    if new_params != params_text:
        changes.append(f"params.yaml fix.variants: {'-' if remove else '+'} {variant}")
    if not changes:
        return []
    if yaml.safe_load(new) != expected:
        raise UserError(f"{path}: the edit would change more than the fix's lists and deps (an unusual layout); "
                        f"{'take' if remove else 'add'} {variant} {'out of' if remove else 'to'} the fix stage's "
                        f"foreach and params.yaml fix.variants, and {fixes.fix_name(variant)} "
                        f"{'out of' if remove else 'to'} the kl and evaluate stages' lists and the report's deps "
                        "yourself; nothing was changed")
    updated = params.model_copy(update={"fix": params.fix.model_copy(update={"variants": named})})
    tmp, params_tmp = path.with_name(f".dvc.yaml.fix-{os.getpid()}.tmp"), params_path.with_name(
        f".params.yaml.fix-{os.getpid()}.tmp")
    try:
        tmp.write_text(new, encoding="utf-8")
        params_tmp.write_text(new_params, encoding="utf-8")
        check_against_dvc(updated, tmp)  # the lists agree with params.yaml, as every command will check
        tmp.replace(path)
        params_tmp.replace(params_path)
    except OSError as exc:
        from pipeline.errors import write_refused

        if refused := write_refused(exc, path, "the file", len(new.encode()) + len(new_params.encode()), needed=True):
            raise refused from None  # the temp files go (below): dvc.yaml and params.yaml as they were
        raise
    finally:
        tmp.unlink(missing_ok=True)
        params_tmp.unlink(missing_ok=True)
    return changes


def told(variant: str, changes: list[str], removed: bool = False) -> str:
    """What `quantize profile --fix` (or `--unfix`) says of one variant's edit."""
    if not changes:
        return (f"unfix {variant}: dvc.yaml builds no fix of it; nothing changed" if removed else
                f"fix {variant}: dvc.yaml builds and decides it already; nothing changed")
    if removed:
        return (f"unfix {variant}: dvc.yaml and params.yaml edited (comments kept): {'; '.join(changes)}\n  then: "
                f"`dvc repro` (the report, without {fixes.fix_name(variant)}; its files stay in models/ and results/)")
    return (f"fix {variant}: dvc.yaml and params.yaml edited (comments kept): {'; '.join(changes)}\n  then: "
            f"`dvc repro` (quantize fix {variant}, then kl, eval and the report for {fixes.fix_name(variant)})")


def fix_items(root: Path) -> list[str] | None:
    """The variants dvc.yaml's fix stages list; None when dvc.yaml does not read."""
    from pipeline import safe_yaml
    from pipeline.settings.checks import fix_items as listed

    try:
        data, _ = safe_yaml.load(root / "dvc.yaml", "a dvc.yaml")
    except (UserError, OSError):
        return None
    stages = data.get("stages") if isinstance(data, dict) else None
    return listed(stages) if isinstance(stages, dict) else None


def offers(verdict: dict, items: list[str] | None) -> list[str]:
    """For each variant the verdict marks NO-GO whose fix is offered (a W4A16 variant without one): the command
    that adds its fix to dvc.yaml, or, when dvc.yaml has it already, `dvc repro`."""
    found = []
    for name, entry in (verdict.get("variants") or {}).items():
        fix = entry.get("fix") if isinstance(entry, dict) else None
        if not isinstance(fix, dict) or fix.get("state") != "not built":
            continue
        if items is not None and name in items:
            found.append(f"{name} is NO-GO; dvc.yaml's fix stage lists it: `dvc repro` builds and decides "
                         f"{fixes.fix_name(name)}")
        else:
            found.append(f"{name} is NO-GO and dvc.yaml has no fix stage for it: `quantize profile --fix {name}` adds "
                         f"one (its most costly groups kept in 8 bits), then `dvc repro` builds and decides "
                         f"{fixes.fix_name(name)}")
    return found


def offers_in(root: Path, verdict_path: Path | None = None) -> list[str]:
    """`offers` for the project at root, from its reports/verdict.json (none when there is none or it does not read)."""
    path = verdict_path or root / "reports" / "verdict.json"
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return offers(verdict, fix_items(root)) if isinstance(verdict, dict) else []
