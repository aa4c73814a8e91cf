"""The repository's contracts: import direction, and dvc.yaml <-> params.yaml <-> CLI consistency."""

import ast
import re
from pathlib import Path

import pytest
import yaml

from dominospec.stages import STAGES
from dominospec.config import Params, load_params

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    # layer -> top-level modules it must never import
    "kernels": {"transformers", "lightning", "pytorch_lightning", "mlflow", "dvc", "sglang", "dominospec"},
    "models": {"lightning", "pytorch_lightning", "mlflow", "dvc", "sglang", "pipeline"},
    "src/dominospec": {"pipeline", "common"},  # common: benchmarks/common, the scripts' helpers
}


def imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_import_direction():
    problems = []
    for layer, banned in FORBIDDEN.items():
        for path in (REPO / layer).rglob("*.py"):
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top in banned and not (layer == "kernels" and module.startswith("dominospec.kernels")):
                    problems.append(f"{path.relative_to(REPO)} imports {module}")
                if layer == "models" and module.startswith("dominospec.") and not module.startswith(
                    ("dominospec.kernels", "dominospec.models")
                ):
                    problems.append(f"{path.relative_to(REPO)} imports {module}")
    assert not problems, problems


def library_graph(typing: bool = False):
    """dominospec module -> the dominospec modules it imports at run time (function-level imports
    included; `if TYPE_CHECKING:` blocks too with `typing`: a type-time circle is a circle of concepts)."""
    root = REPO / "src"
    modules = {}
    for path in (root / "dominospec").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = set() if typing else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                                            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dominospec"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_cycles():
    """No circle of imports, those made only for type checking included."""
    graph = library_graph(typing=True)
    cycles = []

    def visit(module, path):
        for dep in graph[module]:
            if dep in path:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    done = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, cycles


SPEC_ENGINE_IMPORTS = 12  # engine modules engine/spec.py may import: it assembles the engine, it is no hub
RUNNER_MODULES = ("runners", "target_kv", "draft_block", "graphs")
ROUND_MODULES = ("round", "proposers", "proposal", "accept")


def engine_modules(names) -> set:
    return {m for m in names if m.startswith("dominospec.engine.")}


def test_spec_imports_few_engine_modules():
    """engine/spec.py assembles the engine from a few parts (the draft path, the runners, the proposer,
    the round), `TYPE_CHECKING` imports included."""
    imported = engine_modules(library_graph(typing=True)["dominospec.engine.spec"])
    assert len(imported) <= SPEC_ENGINE_IMPORTS, sorted(imported)


def test_runners_do_not_reach_into_the_round():
    """A runner runs the verify shape it is given (engine.verify_shape): no runner module imports a
    round module, directly or through another, `TYPE_CHECKING` imports included."""
    graph = library_graph(typing=True)
    problems = []
    for runner in RUNNER_MODULES:
        seen, todo = set(), [f"dominospec.engine.{runner}"]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        problems += [f"{runner} imports {m}" for m in sorted(seen)
                     if m.removeprefix("dominospec.engine.") in ROUND_MODULES]
    assert not problems, problems


def test_layers_point_down():
    """pipeline -> stages (`*.stage`, cli) -> library -> errors / models / kernels, never upwards."""
    graph = library_graph()
    assert graph["dominospec.errors"] == set(), "errors must stay the bottom of the graph"
    problems = []
    for module, deps in graph.items():
        is_stage = module == "dominospec.cli" or module.endswith(".stage")
        for dep in deps:
            if dep == "dominospec.cli" and module != "dominospec.cli":
                problems.append(f"{module} imports the CLI")
            elif dep.endswith(".stage") and not is_stage:
                problems.append(f"library module {module} imports stage {dep}")
    assert not problems, problems


# The library's subpackages (and top-level modules), bottom first: each imports only what sits below it
# (or itself). Stages (`*.stage`, cli) obey it too; `dominospec` itself (the version) is below all.
LAYERS = ["errors", "files", "config", "precision", "presets", "target", "draft", "runtime", "stops", "tracking", "data", "cache", "train", "engine", "regenerate",
          "export", "serve", "eval", "card", "retrain", "stages", "cli"]


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dominospec"


def test_subpackages_import_only_the_layers_below():
    rank = {name: i for i, name in enumerate(LAYERS)}
    rank["dominospec"] = -1
    graph = library_graph()
    unknown = sorted({layer_of(m) for m in graph} - set(rank))
    assert not unknown, f"place {unknown} in LAYERS"
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                    if rank[layer_of(d)] > rank[layer_of(m)])
    assert not upward, upward


def module_file(module: str):
    """dominospec.a.b -> its source file (package dirs per pyproject's package-dir), or None (not ours)."""
    parts = module.split(".")
    if parts[0] != "dominospec":
        return None
    roots = {"models": REPO / "models", "kernels": REPO / "kernels"}
    base = roots[parts[1]] if len(parts) > 1 and parts[1] in roots else None
    path = base.joinpath(*parts[2:]) if base is not None else REPO.joinpath("src", *parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path) -> set:
    """A source file -> the dominospec files its imports load (function-level ones included, and the
    __init__ of every package on the way: importing a.b.c runs a/__init__ and a/b/__init__)."""
    files = set()
    for module in imported_modules(path):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            found = module_file(".".join(parts[:i]))
            if found is not None:
                files.add(found)
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):  # `from dominospec.x import name`: a module, or a name x loads lazily
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dominospec"):
            for alias in node.names:
                target = module_file(f"{node.module}.{alias.name}") or module_file(lazy_exports(node.module).get(alias.name, ""))
                if target is not None:
                    files.add(target)
    return files


def lazy_exports(package: str) -> dict:
    """A package whose __init__ loads names on first use (a `_EXPORTS = {name: module}` literal, PEP 562
    `__getattr__`) -> that mapping; {} otherwise."""
    init = module_file(package)
    if init is None or init.name != "__init__.py":
        return {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def stage_sources(script: Path, stage: str) -> set:
    """A stage script -> every dominospec source file it loads, transitively (its stage function's
    module, which dominospec.stages imports by name, included)."""
    seen, todo = set(), [script, module_file(STAGES[stage].split(":")[0])]
    while todo:
        path = todo.pop()
        for dep in imported_files(path) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def uncovered_sources(name: str, stage: dict) -> list:
    """A dvc.yaml stage -> the source files its script loads that none of its deps (a file or a folder) covers."""
    script = REPO / stage["cmd"].split()[1]
    deps = [REPO / d.split()[0] for d in stage["deps"] if not d.startswith("${")]
    covered = lambda f: any(f == d or d in f.parents for d in deps)  # noqa: E731
    return sorted(str(f.relative_to(REPO)) for f in stage_sources(script, name) if not covered(f))


def test_every_stage_lists_the_code_it_runs_in_its_deps():
    """A change to any module a stage imports (transitively) must make `dvc repro` re-run it."""
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    missing = {name: uncovered_sources(name, stage) for name, stage in dvc["stages"].items()}
    assert not {name: files for name, files in missing.items() if files}, missing


def test_the_deps_check_sees_a_missing_module(tmp_path):
    """The check can fail: evaluate without its engine folder in deps leaves engine modules uncovered."""
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stage = dict(dvc["stages"]["evaluate"])
    stage["deps"] = [d for d in stage["deps"] if d != "src/dominospec/engine"]
    assert "src/dominospec/engine/spec.py" in uncovered_sources("evaluate", stage)


def test_every_dvc_stage_has_script_params_section_and_cli_command():
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    sections = set(Params.__dataclass_fields__)
    for name, stage in dvc["stages"].items():
        assert stage["cmd"] == f"python pipeline/{name}.py --params params.yaml", name
        assert (REPO / "pipeline" / f"{name}.py").is_file(), name
        assert name in sections, f"stage {name} has no params section"
        assert name in stage["params"], f"stage {name} does not list its own params section"
        assert f"pipeline/{name}.py" in stage["deps"], name
        assert any(d.startswith("src/dominospec/") and not d.endswith("config.py") for d in stage["deps"]), (
            f"stage {name} lists no library code in deps"
        )
        assert name in STAGES, f"stage {name} has no `dominospec {name}` command"


def test_the_draft_directory_is_shared_file_by_file():
    """export writes the contract's files of paths.draft, card its README.md, and every stage reads the files, never
    the directory: DVC refuses overlapping outputs, and a dependency on the directory would follow the card, which
    follows evaluate (a cycle)."""
    from dominospec.export.contract import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    draft = lambda entries: sorted(p for p in (e if isinstance(e, str) else next(iter(e)) for e in entries)  # noqa: E731
                                   if p.startswith("${paths.draft}"))
    files = [f"${{paths.draft}}/{name}" for name in (CONFIG_FILE, WEIGHTS_FILE)]
    assert draft(stages["export"]["outs"]) == files
    assert draft(stages["card"]["outs"]) == [f"${{paths.draft}}/{CARD_FILE}"]
    assert {name: draft(stage.get("outs", [])) for name, stage in stages.items() if name not in ("export", "card")
            and draft(stage.get("outs", []))} == {}
    readers = {name: draft(stage["deps"]) for name, stage in stages.items() if draft(stage["deps"])}
    assert set(readers) >= {"evaluate", "serve_eval", "card"}
    assert all(deps == files for deps in readers.values()), readers


def test_dvc_paths_come_from_params_paths():
    text = (REPO / "dvc.yaml").read_text()
    params = load_params(REPO / "params.yaml")
    for ref in re.findall(r"\$\{paths\.(\w+)\}", text):
        assert hasattr(params.paths, ref), f"dvc.yaml uses unknown paths.{ref}"
    # No artefact path is written out literally in dvc.yaml.
    for value in (v for v in vars(params.paths).values() if "/" in v):
        assert not re.search(rf"(?<![{{.\w]){re.escape(value)}\b", text), f"{value} hard-coded in dvc.yaml"


def test_stage_scripts_are_thin():
    for script in (REPO / "pipeline").glob("*.py"):
        assert len(script.read_text().splitlines()) <= 100, script.name


def test_the_benchmark_helpers_live_outside_the_package():
    """The scripts' helpers are benchmarks/common (one module a concern), not a module of the package; every
    `from common.M import NAME` in benchmarks/ and tests/ names a module there and a name it defines."""
    assert not (REPO / "src" / "dominospec" / "bench.py").exists()
    defined = {}
    for path in (REPO / "benchmarks" / "common").glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        defined[path.stem] = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    problems = []
    for path in [*(REPO / "benchmarks").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("common."):
                module = node.module.split(".", 1)[1]
                missing = [a.name for a in node.names if a.name not in defined.get(module, set())]
                if missing:
                    problems.append(f"{path.relative_to(REPO)}: common.{module} has no {missing}")
    assert not problems, problems


MODE_NAMES = {"ar", "ngram", "dflash", "domino", "dominotree"}
# the modules before the resolve step (engine.decoding): the engine's entry, which calls it (the target's
# preparation for the params, which runs before any engine is built, is runtime.prepare's)
BEFORE_RESOLVE = {"decoding.py", "spec.py"}
# a ratchet: issue 52 aims at 2,800 (3,014 before fields nobody read left, 3,072 before transformers' cache
# helpers went to runtime.kv and the lean forward joined target_kv, 3,174 before the draft's lean backbone went
# to models.lean and the head's graphs onto the one holder, 3,575 before the modules that are not decoding left
# the engine, 3,804 before its line cut, 3,867 before its restructure, 4,112 before its clean-up)
ENGINE_LINE_BUDGET = 3006


def engine_files():
    return sorted((REPO / "src" / "dominospec" / "engine").glob("*.py"))


def test_after_the_resolve_step_nothing_reads_the_mode_or_the_engine_params():
    """engine.decoding turns (mode, params, target, draft) into a Decoding once: no later engine module
    imports EngineParams nor compares anything with a mode's name."""
    problems = []
    for path in engine_files():
        if path.name in BEFORE_RESOLVE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "EngineParams" for a in node.names):
                problems.append(f"{path.name}:{node.lineno} imports EngineParams")
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                consts = {c.value for c in operands if isinstance(c, ast.Constant)}
                consts |= {e.value for c in operands if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                           for e in c.elts if isinstance(e, ast.Constant)}
                if MODE_NAMES & {c for c in consts if isinstance(c, str)}:
                    problems.append(f"{path.name}:{node.lineno} compares with a mode: {ast.unparse(node)}")
    assert not problems, problems


def test_no_class_name_is_defined_twice():
    """One concept, one name: two classes of one name in the library, models or kernels read as one."""
    where: dict = {}
    for root in (REPO / "src" / "dominospec", REPO / "models", REPO / "kernels"):
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_every_runner_has_what_its_protocol_asks():
    """The target and draft runners (engine.runner_types) have every method their Protocol names."""
    import typing

    from dominospec.engine.draft_block import DynamicDraftBlock, LeanDraftBlock, StaticDraftBlock
    from dominospec.engine.runner_types import DraftRunner, TargetRunner
    from dominospec.engine.target_kv import DynamicTargetKV, StaticTargetKV

    def methods(protocol):
        return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}

    assert methods(TargetRunner) == {"reset", "forward", "select", "crop"}
    assert methods(DraftRunner) == {"reset", "extend", "crop", "block"}
    missing = {c.__name__: sorted(m for m in methods(p) if not callable(getattr(c, m, None)))
               for p, runners in ((TargetRunner, (DynamicTargetKV, StaticTargetKV)),
                                  (DraftRunner, (DynamicDraftBlock, StaticDraftBlock, LeanDraftBlock)))
               for c in runners}
    assert all(not m for m in missing.values()), missing
    assert typing.get_type_hints(TargetRunner.forward)["return"] is not None


# where CUDA graphs are made: engine.graphs captures them, the draft path holds the one `DraftGraphs` of the
# draft's rollout, sampled chain and tree, and each runner module its own forwards' `ShapeGraphs`
GRAPH_MAKERS = {"DraftGraphs": {"draft_path.py"}, "ShapeGraphs": {"graphs.py", "target_kv.py", "draft_block.py"},
                "CUDAGraph": {"graphs.py"}}


def test_the_draft_s_graphs_have_one_holder():
    """No engine module but those of GRAPH_MAKERS builds a graph holder or captures a graph: the head's and the
    tree's graphs are sets of the draft path's one `DraftGraphs`, not holders of their own."""
    problems = []
    for path in engine_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in GRAPH_MAKERS and path.name not in GRAPH_MAKERS[name]:
                    problems.append(f"{path.name}:{node.lineno} makes {name}")
    assert not problems, problems


def test_the_layout_checks_can_fail(tmp_path, monkeypatch):
    """The mode, graph-holder and class-name checks see a module that breaks them."""
    bad = tmp_path / "src" / "dominospec" / "engine"
    bad.mkdir(parents=True)
    (bad / "round.py").write_text("from dominospec.config import EngineParams\nclass Accepted: pass\n"
                                  "def f(d):\n    return d.name == 'domino' or DraftGraphs(1)\n")
    (bad / "accept.py").write_text("class Accepted: pass\n")
    for name in ("models", "kernels"):
        (tmp_path / name).mkdir()
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    for check in (test_after_the_resolve_step_nothing_reads_the_mode_or_the_engine_params,
                  test_the_draft_s_graphs_have_one_holder, test_no_class_name_is_defined_twice):
        with pytest.raises(AssertionError):
            check()


def test_the_engine_keeps_to_its_line_budget():
    lines = sum(len(path.read_text().splitlines()) for path in engine_files())
    assert lines <= ENGINE_LINE_BUDGET, f"the engine has {lines} lines, over {ENGINE_LINE_BUDGET}"


def test_test_modules_have_unique_basenames():
    """tests/ has no __init__.py files: pytest imports each test module by its basename, so two
    files of one name in different folders stop the whole collection."""
    names = [p.name for p in (REPO / "tests").rglob("*.py") if p.name != "conftest.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_the_repository_root_on_the_import_path_does_not_hide_pypi_kernels():
    """`python -m pytest` (or `-c`) in the checkout puts its root on the import path, where kernels/ would hide
    the PyPI package `kernels` that transformers >= 5.25 imports with its modeling code."""
    import importlib.metadata
    import subprocess
    import sys

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no PyPI package `kernels` installed: nothing to hide")
    probe = ("import transformers.modeling_utils, kernels, dominospec.kernels as ours; "
             "print(kernels.__file__); print(ours.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    theirs, ours = out.stdout.split()
    assert "site-packages" in theirs and Path(ours) == REPO / "kernels" / "__init__.py"
