"""The structure DESIGN.md asks for, checked on the source: no import cycle among our
modules, imports between packages and between trainer's parts only point downwards (the
model families above the trainer, the application shell above both), `trainer.trainer` is
imported only by the package face, the config and the CLI, and `src/trainer` stays the loop
and its services."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gangs", "gangtrain", "units", "trainer", "recipes")
# The one-release shims of the old top-level names (`gangs.moved`): not code of ours.
SHIMS = ("data", "models", "layers", "parallel")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for base in (root / "src", root):
        for package in PACKAGES:
            for path in (base / package).rglob("*.py") if (base / package).is_dir() else []:
                parts = list(path.relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                files[".".join(parts)] = path
    return files


def imports_of(path: Path, modules: set[str], package: str) -> set[str]:
    """Our modules that `path` imports, at import time or inside its functions (not under
    TYPE_CHECKING); `from pkg import name` counts as `pkg.name` when that is a module."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + [node.module])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


# Imports inside a function that point upwards or close a cycle, each kept for its reason.
# Nothing else may: a function-level import is an import.
ALLOWED_LATE_IMPORTS = {
    ("gangs.moved", "*"): "the one-release aliases import the new home of a moved name by "
                          "its string, when asked for (importlib, not an import statement)",
}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    modules = set(files)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {dep for dep in imports_of(path, modules, package) - {name}
                       if (name, dep) not in ALLOWED_LATE_IMPORTS
                       and (name, "*") not in ALLOWED_LATE_IMPORTS}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def walk(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                walk(nxt, trail + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    # A package face importing its own submodules is not a cycle of code.
    return [c for c in cycles if not any(len(a) < len(b) and b.startswith(a + ".")
                                         for a, b in zip(c, c[1:]))]


def recipe_crossings(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {dep}" for module, deps in graph.items()
                  if module.startswith("recipes.") for dep in deps
                  if dep.startswith("recipes.") and dep.split(".")[1] != module.split(".")[1])


def test_no_import_cycle_among_our_modules():
    assert import_cycles(import_graph()) == []


def _plant(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(root)


def test_a_cycle_closed_inside_a_function_is_found(tmp_path):
    graph = _plant(tmp_path, {
        "src/gangtrain/__init__.py": "", "src/gangtrain/a.py": "import gangtrain.b\n",
        "src/gangtrain/b.py": "def later():\n    from gangtrain import a\n    return a\n"})
    assert import_cycles(graph) == [["gangtrain.a", "gangtrain.b", "gangtrain.a"]]


def test_a_recipe_importing_another_inside_a_function_is_found(tmp_path):
    graph = _plant(tmp_path, {
        "recipes/__init__.py": "", "recipes/one/__init__.py": "", "recipes/two/__init__.py": "",
        "recipes/one/recipe.py": "def main():\n    from recipes.two.recipe import cli\n",
        "recipes/two/recipe.py": "def cli():\n    pass\n"})
    assert recipe_crossings(graph) == ["recipes.one.recipe -> recipes.two.recipe"]


def test_only_the_face_the_config_and_the_cli_import_the_trainer_module():
    importers = {name for name, deps in import_graph().items() if "trainer.trainer" in deps}
    assert importers <= {"trainer", "gangtrain.app.config.trainer_config",
                         "gangtrain.app.cli"}, importers


# The parts of `trainer`, lowest first, and what each may import besides itself, `units` and
# `gangs`. "loop" is the top: the modules directly under src/trainer/ (the loop, its result,
# validation, settings, early stoppers, HF interop); "face" is the package `__init__` and the
# command line, which may import everything.
PART_IMPORTS = {
    "errors": set(),
    "checkpoint": {"errors"},
    "lifecycle": {"errors", "checkpoint"},
    "state": {"errors", "checkpoint", "lifecycle"},
    "step": {"errors", "checkpoint", "lifecycle", "state"},
    "observe": {"errors", "checkpoint", "lifecycle", "state", "step"},
    "loop": {"errors", "checkpoint", "lifecycle", "state", "step", "observe"},
}
# The run directory's names (trainer/run_dir.py) are a part below all others: every part may
# spell a path through them, and they import nothing of ours.
PART_IMPORTS = {"run_dir": set()} | {part: deps | {"run_dir"} for part, deps in PART_IMPORTS.items()}
PART_IMPORTS["face"] = set(PART_IMPORTS)
# What each package may import, lowest first: arrows point down to gangs. The model families
# sit above the trainer (they hand it their files and specs); the application shell above
# both; the recipes on top.
LOW = {"gangs": set(), "gangtrain.io": set(), "gangtrain.layers": {"gangs"},
       "gangtrain.parallel": {"gangs", "gangtrain.layers"},
       "gangtrain.data": {"gangs"},
       "gangtrain.rl": {"gangs", "gangtrain.layers", "gangtrain.data"},
       "units": {"gangs", "gangtrain.layers", "gangtrain.data", "gangtrain.rl"},
       "trainer": {"units", "gangs", "gangtrain.parallel", "gangtrain.layers", "gangtrain.data",
                   "gangtrain.rl", "gangtrain.io"}}
PACKAGE_IMPORTS = {**LOW, "gangtrain": set(),
                   "gangtrain.models": {*LOW} - {"gangtrain.models"},
                   "gangtrain.app": {*LOW, "gangtrain.models"},
                   "gangtrain.tiny": {*LOW},
                   "gangtrain.posttrain": {*LOW, "gangtrain.models", "gangtrain.app"},
                   "recipes": {*LOW, "gangtrain.models", "gangtrain.app", "gangtrain.posttrain",
                               "gangtrain.tiny"}}


def package_of(module: str) -> str:
    """The package of `module` for the layering: a top-level name, or gangtrain's part."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "gangtrain" and len(parts) > 1 else parts[0]


def part_of(module: str) -> str:
    """The part of `trainer` that `module` (a dotted name under trainer) belongs to."""
    parts = module.split(".")
    if module == "trainer":
        return "face"
    if parts[1] in PART_IMPORTS and len(parts) > 2 or parts[1] in ("checkpoint", "errors", "run_dir"):
        return parts[1]
    return "loop"


def test_imports_point_downwards_between_the_parts_of_trainer():
    upward = []
    for module, deps in import_graph().items():
        package = package_of(module)
        for dep in deps:
            dep_package = package_of(dep)
            if dep_package != package:
                if dep_package not in PACKAGE_IMPORTS[package]:
                    upward.append(f"{module} -> {dep}")
                continue
            # errors and the switch of torch shortcuts import nothing of ours: any part may.
            if package != "trainer" or dep in ("trainer.errors", "trainer.torch_shortcuts"):
                continue
            mine, theirs = part_of(module), part_of(dep)
            if theirs != mine and theirs not in PART_IMPORTS[mine]:
                upward.append(f"{module} ({mine}) -> {dep} ({theirs})")
    assert upward == [], "\n".join(sorted(upward))


def test_recipes_never_import_each_other():
    assert recipe_crossings(import_graph()) == []


def test_each_part_of_trainer_says_what_lives_there_and_what_it_may_import():
    for part in ("step", "state", "observe", "lifecycle", "checkpoint"):
        doc = ast.get_docstring(ast.parse((ROOT / "src" / "trainer" / part / "__init__.py")
                                          .read_text()))
        assert doc and "imports only" in doc.lower(), part


def test_help_trainer_explains_every_argument():
    import inspect
    import pydoc

    from gangtrain.app import TrainerConfig
    from trainer import Trainer
    from trainer.settings import TrainerSettings

    text = pydoc.render_doc(Trainer, renderer=pydoc.plaintext)
    names = [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]
    assert set(TrainerSettings.model_fields) <= set(names)  # every setting is a keyword
    for name in names:
        assert f"{name}:" in text or f"{name} (default" in text, name
    # One definition: the config has every setting, with the same default.
    for name, field in TrainerSettings.model_fields.items():
        assert TrainerConfig.model_fields[name].default == field.default, name
        assert field.description and field.description in text, name  # explained in help()


def test_the_trainer_signature_spells_out_every_setting_as_defined():
    """`Trainer.__init__` writes each setting as a keyword for editors and type checkers; the
    definition is `TrainerSettings`: the same names, in its order, types and defaults."""
    import inspect

    from trainer import Trainer
    from trainer.settings import TrainerSettings

    params = inspect.signature(Trainer, eval_str=True).parameters
    fields = TrainerSettings.model_fields
    keywords = [name for name, p in params.items() if name in fields]
    assert keywords == list(fields)
    for name, field in fields.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == field.default, name
        assert params[name].annotation == field.annotation, name
    # Nothing else but the Trainer's objects and the catch of a misspelt setting.
    others = [name for name in params if name not in fields]
    assert others[-1] == "unknown" and params["unknown"].kind is inspect.Parameter.VAR_KEYWORD


def test_the_trainer_page_lists_every_setting():
    from trainer.settings import TrainerSettings

    readme = (ROOT / "docs" / "trainer.md").read_text()
    for name in TrainerSettings.model_fields:
        assert f"| `{name}` |" in readme, name


# Model families and the attribute names of their modules: knowledge that lives in a family's
# spec (`models/`, `recipes/lm/spec.py`), never in the generic layers.
FAMILY_WORDS = ("llama", "mistral", "mixtral", "gemma", "qwen", "gpt2", "gpt_neox", "neox",
                "phi3", "olmo", "deepseek")
MODEL_ATTRIBUTES = ("embed_tokens", "embed_in", "embed_out", "lm_head", "rotary_emb",
                    "tok_embeddings", "pos_embeddings", "wte", "wpe", "q_proj", "k_proj",
                    "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn",
                    "input_layernorm", "final_layer_norm", "base_model_prefix")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (free text, not code)."""
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for statement in body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                        and isinstance(statement.value.value, str):
                    ids.add(id(statement.value))
    return ids


def family_knowledge(path: Path) -> list[str]:
    """Where the code of `path` (names, attributes, string constants; not docstrings or
    comments) names a model family or a model attribute."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            words = [node.name]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            words = [node.value]
        else:
            continue
        for word in words:
            lower = word.lower()
            hits = [w for w in FAMILY_WORDS if w in lower]
            hits += [w for w in MODEL_ATTRIBUTES if w in lower.replace(".", " ").replace(
                "'", " ").split() or lower == w]
            if hits:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hits[0]}")
    return found


def test_the_generic_layers_name_no_model_family_and_no_model_attribute():
    files = [path for package in ("gangtrain/parallel", "trainer")
             for path in (ROOT / "src" / package).rglob("*.py")]
    found = [hit for path in sorted(files) for hit in family_knowledge(path)]
    assert found == [], "\n".join(found)


def test_the_trainer_is_the_loop_and_its_services():
    """`src/trainer` imports no model family, nothing of `gangtrain.models` or the app shell
    (those sit above it), and stays near 10k lines: a sign to split, not a goal."""
    graph = import_graph()
    above = [f"{module} -> {dep}" for module, deps in graph.items()
             if package_of(module) == "trainer" for dep in deps
             if package_of(dep) in ("gangtrain.models", "gangtrain.app", "recipes")]
    assert above == [], above
    lines = sum(len(path.read_text().splitlines())
                for path in (ROOT / "src" / "trainer").rglob("*.py"))
    assert lines < 10_050, lines


def test_one_namespace_of_our_own_is_installed():
    """Besides the layout's gangs, units, trainer and recipes, only `gangtrain` (and the
    one-release shims of the old names) is a top-level package; no module of ours imports
    a shim."""
    tops = {path.name for path in (ROOT / "src").iterdir()
            if (path / "__init__.py").is_file()}
    assert tops == {"gangs", "units", "trainer", "gangtrain", *SHIMS}, tops
    for shim in SHIMS:
        assert [p.name for p in (ROOT / "src" / shim).iterdir()
                if p.suffix == ".py"] == ["__init__.py"], shim
    shim_users = []
    for name, path in module_files().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom)
                       and not node.level else [])
            shim_users += [f"{name}: {t}" for t in targets if t.split(".")[0] in SHIMS]
    assert shim_users == [], shim_users
