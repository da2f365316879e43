"""The README and the docs/ pages are executed, so they cannot rot: every ```python block
runs (the pages in order, after the README, in its namespace), and every public name they
mention imports."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name


def test_readme_and_docs_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            exec(compile(block, str(page), "exec"), namespace)  # noqa: S102
            ran += 1
    assert ran >= 3
    assert (tmp_path / "runs" / "regression" / "metrics" / "train.jsonl").exists()
    assert (tmp_path / "runs" / "dpo" / "metrics" / "eval.jsonl").exists()  # preference.md


def names_the_docs_import():
    """(module, name) for every `from pkg... import a, b` of our packages in the docs."""
    found = set()
    pattern = r"from ((?:trainer|units|gangs|data|recipes)[\w.]*) import (?:\(([\w, \n]+)\)|([\w, ]+))"
    for page in PAGES:
        for module, wrapped, names in re.findall(pattern, page.read_text()):
            names = wrapped or names
            found.update((module, n.strip()) for n in names.replace("\n", ",").split(",")
                         if n.strip())
    return sorted(found)


@pytest.mark.parametrize(("module", "name"), names_the_docs_import())
def test_every_name_the_docs_import_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


def test_every_dotted_public_name_the_docs_mention_exists():
    """`gangtrain.models.hf.load_pretrained`, `trainer.early_stoppers.Patience`, ... in backticks
    (`trainer.<key>` where no such module exists is a config key, not a name)."""
    missing = []
    for page in PAGES:
        for dotted in re.findall(r"`((?:trainer|units|gangs)\.[\w.]+)`", page.read_text()):
            parts = dotted.split(".")
            for cut in range(len(parts), 1, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attr in parts[cut:]:
                    obj = getattr(obj, attr, None)
                if obj is None:
                    missing.append(f"{page.name}: {dotted}")
                break
    assert missing == []
