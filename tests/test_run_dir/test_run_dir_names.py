"""The run directory's names are spelled in one module (`trainer/run_dir.py`), and a DCP
checkpoint is read by one function (`trainer.checkpoint.loading.load_dcp`): checked on the
source, strings and calls, not on comments or docstrings."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from trainer.run_dir import RunDir, parse_step_dir, step_dir_name

ROOT = Path(__file__).resolve().parents[2]
RUN_DIR_MODULE = ROOT / "src" / "trainer" / "run_dir.py"
# A run directory's name as a string of its own or as a path's first part, and a step
# directory's name (or a glob of them) being built.
NAMES = re.compile(r"^(checkpoints|models|metrics|config_history|tb|hf|config\.yaml|failures|profile"
                   r"|best_model\.safetensors)(/.*)?$|config_history|^step_\*?$")


def source_files() -> list[Path]:
    files = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))
    return [path for path in files if path != RUN_DIR_MODULE]


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the constant nodes that are docstrings (module, class, function, attribute)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    found.add(id(stmt.value))
    return found


def not_paths(tree: ast.AST) -> set[int]:
    """ids of the constants that name no path: a `Literal[...]`'s choices (a setting's
    `hf` engine) and `__all__`'s names (a module's `metrics` function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id == "Literal":
            found.update(id(c) for c in ast.walk(node.slice) if isinstance(c, ast.Constant))
        if isinstance(node, ast.AnnAssign) and "Literal[" in ast.unparse(node.annotation) \
                and isinstance(node.value, ast.Constant):  # the setting's default choice
            found.add(id(node.value))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            found.update(id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return found


def spelled_names(path: Path) -> list[str]:
    """The run-directory names that string constants in `path` spell (docstrings, setting
    choices and exported names aside)."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree) | not_paths(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip and NAMES.search(node.value)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
        # f"step_{n}": a step directory's name built by hand
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).endswith("step_") and (
                    str(first.value) == "step_" or str(first.value).endswith(" step_")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: f{first.value!r}...")
    return found


def test_only_the_run_dir_module_spells_the_run_directory():
    found = [hit for path in source_files() for hit in spelled_names(path)]
    assert found == [], "\n".join(found)


def test_the_run_dir_module_spells_every_name():
    run = RunDir("out")
    names = {p.relative_to("out").as_posix() for p in (
        run.checkpoints, run.metrics, run.tensorboard, run.hf, run.config_file,
        run.config_history, run.failures, run.profile, run.wandb)}
    assert names == {"checkpoints", "metrics", "tb", "hf", "config.yaml", "config_history",
                     "failures", "profile", "wandb"}
    assert run.step_dir(7) == Path("out/checkpoints/step_7")
    assert step_dir_name(12) == "step_12" and parse_step_dir("step_12") == 12
    for other in ("step_", "step_x", ".tmp_step_3", "step_3a", "last"):
        assert parse_step_dir(other) is None, other


def functions_calling(predicate) -> list[str]:
    """`path:function` of each function in src/ with a call that `predicate` accepts."""
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and predicate(n)]
                if calls:
                    found.append(f"{path.relative_to(ROOT / 'src').as_posix()}:{func.name}")
    return sorted(set(found))


def test_one_function_reads_a_dcp_checkpoint():
    def loads(call: ast.Call) -> bool:
        name = ast.unparse(call.func)
        return (name in ("dcp.load", "torch.distributed.checkpoint.load", "load_state_dict_dcp")
                or name.endswith("state_dict_loader.load")
                or any(kw.arg == "storage_reader" for kw in call.keywords))

    assert functions_calling(loads) == ["trainer/checkpoint/loading.py:load_dcp"]
