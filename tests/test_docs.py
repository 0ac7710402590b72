"""The README stays short and its links land; the docs site's generated pages cover what the code declares.

(`make docs`, run by `make test`, builds the whole site with --strict: every link and anchor inside docs/ is checked
there.)"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_LIMIT = 12 * 1024

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            found.add(github_anchor(match.group(1)))
    return found


def test_readme_is_at_most_12_kb():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size:,} bytes, over {README_LIMIT:,}: move detail into docs/"


def test_readme_relative_links_resolve():
    problems = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (README.parent / path).resolve()
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading with anchor #{anchor} in {path}")
    assert not problems, "README.md links that do not resolve:\n" + "\n".join(problems)


def test_generated_references_cover_the_code():
    sys.path.insert(0, str(REPO / "tools"))
    import gen_docs

    from pipeline import methods
    from pipeline.settings import params

    page = gen_docs.params_page()
    for name, field in params.Params.model_fields.items():
        for _, section in gen_docs._sections_in(field.annotation):
            for field_name in section.model_fields:
                assert f"| `{field_name}` |" in page, f"{name}.{field_name} missing from the params reference"
    for section in methods.sections():
        assert f"`{section.__module__}.{section.__qualname__}`" in page
    serving = gen_docs.serving_page()
    from pipeline.checkpoints.serving import SHOWN

    assert all(run.evidence.replace("|", "\\|") in serving for run in SHOWN)
    tables = gen_docs.result_tables()
    for path in (REPO / "benchmarks" / "results").glob("*.md"):
        assert f'--8<-- "benchmarks/results/{path.name}"' in tables[f"results/tables/{path.stem}.md"]


def test_the_docs_show_the_example_model_card_header_and_body():
    """reference/model-card.md: the committed example's card of the variant its verdict ships first, its YAML header
    in a block and its body (headings one level down, under the page's own title), as Python-Markdown renders it."""
    import json

    import markdown

    sys.path.insert(0, str(REPO / "tools"))
    import gen_docs

    variant = json.loads((REPO / "reports" / "example" / "verdict.json").read_text())["decisions"][0]["variant"]
    page = gen_docs.pages()["reference/model-card.md"]
    card = (REPO / "reports" / "example" / "cards" / variant / "README.md").read_text()
    assert f"reports/example/cards/{variant}/README.md" in page and "base_model_relation: quantized" in page
    assert f"\n## {card.split(chr(10) + '# ', 1)[1].splitlines()[0]}\n" in page  # the card's title, one level down
    assert page.count("\n# ") == 1 and "\n### Evaluation\n" in page
    html = markdown.markdown(page, extensions=["tables", "fenced_code"])
    assert html.count("<table>") == 1 and "<td><strong>Average</strong></td>" in html
