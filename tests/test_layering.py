"""The parts of qurl_mcore and what each may import: every import of every module (at the top and inside
functions), mapped to its part, stays within `ALLOWED`, and the parts form no cycle. docs/architecture.md shows
the same table (`markdown_table`)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "qurl_mcore"
DOC = Path(__file__).parents[1] / "docs" / "architecture.md"

#: part -> (what it holds, the parts it may import), lowest first. A part is a subpackage of qurl_mcore or one
#: of its top-level modules; imports within a part are free.
ALLOWED: dict[str, tuple[str, frozenset[str]]] = {name: (what, frozenset(deps)) for name, what, deps in (
    ("quant", "numerics shared by trainer and engine (pure torch)", ()),
    ("kernels", "Triton kernels of the quantized numerics (the fused FP4 MoE and linear GEMMs)", ("quant",)),
    ("rl", "policy losses, advantages, mismatch metrics (pure torch)", ()),
    ("tasks", "prompt sets and rewards (pure Python)", ()),
    ("models", "architecture tables, packaged and tiny models, architecture cards", ()),
    ("transfer", "buckets, ports, comm backend, store binding", ()),
    ("parent_death", "programs that end with the process that started them", ()),
    ("checkpoint", "the checkpoint format: files, meta, verify, latest valid", ()),
    ("fakecuda", "the CUDA façade for tracing GPU code on the CPU (tests, `qurl plan --trace`)", ("models",)),
    ("placement", "the Ray bundles of a config and whether a cluster holds them", ("config",)),
    ("heldout", "the held-out prompts a config evaluates on", ("config", "tasks")),
    ("runlock", "a run's lock on its checkpoint and log directories", ("config",)),
    ("provenance", "which code a run ran: its git commit", ()),
    ("patching", "`qurl patch`", ()),
    ("uaq", "UAQ scaling and update capture (pure torch)", ("quant", "models")),
    ("smoothing", "activation smoothing: calibration and the fold into the engine's weights (pure torch)",
     ("models",)),
    ("layerwise", "an HF checkpoint run on the host one decoder layer at a time (transformers)", ()),
    ("precision", "the precision table", ("quant", "models")),
    ("recipe", "a precision, scope and format resolved once into both sides' specs", ("quant", "models", "precision")),
    ("stack", "the Megatron fusions and experts module the installed stack runs", ("recipe",)),
    ("config", "the training YAML schema", ("precision", "rl", "tasks", "recipe", "models", "quant")),
    ("sglang", "the SGLang quantization plugin", ("quant", "kernels", "precision", "models", "transfer",
                                                   "recipe")),
    ("rollout", "the SGLang engine client and the code push's trainer half",
     ("quant", "models", "parent_death", "sglang", "transfer")),
    ("megatron", "Megatron-Core models, weights, training stack", ("quant", "rl", "models", "precision", "uaq",
                                                                  "transfer", "recipe", "stack")),
    ("sizing", "`qurl plan`", ("config", "placement", "precision", "models", "quant")),
    ("preflight", "`qurl train --check`", ("config", "heldout", "placement", "precision", "models", "sizing",
                                           "runlock", "sglang", "smoothing", "tasks", "stack")),
    ("loop", "the RL loop: trainer, engines, driver, evaluation", (
        "checkpoint", "config", "heldout", "layerwise", "megatron", "models", "parent_death", "placement", "precision",
        "preflight", "provenance", "recipe", "rl", "rollout", "runlock", "sglang", "smoothing", "tasks", "transfer",
        "uaq")),
    ("export", "`qurl export`", ("checkpoint", "config", "megatron", "models")),
    ("align", "`qurl align`", ("megatron", "models", "precision", "rl", "rollout", "recipe")),
    ("compare", "`qurl compare`", ("config", "loop", "provenance")),
    ("slurm", "`qurl launch slurm`", ("config", "models", "placement", "preflight")),
    ("quant_report", "`qurl quant-report`", ("quant", "models")),
    ("integrations", "adapters for verl and slime", ("config", "megatron", "patching", "precision", "rl",
                                                     "sglang", "uaq", "recipe")),
    ("plantrace", "`qurl plan --trace`: a trainer rank and an engine's weights traced on fake CUDA", (
        "config", "fakecuda", "loop", "megatron", "models", "precision", "rollout", "sglang", "sizing")),
    ("cli", "the `qurl` command", ("align", "compare", "config", "export", "loop", "megatron", "models", "patching",
                                   "plantrace", "precision", "preflight", "quant_report", "sizing", "slurm")),
    ("__main__", "`python -m qurl_mcore`", ("cli",)),
)}

def part_of(module: str) -> str | None:
    """The part of a dotted module name under qurl_mcore (None for the package itself or a name outside)."""
    names = module.split(".")
    if names[0] != "qurl_mcore" or len(names) < 2:
        return None
    return names[1]


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The absolute module names an import statement of a module in `package` reads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parents = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parents + ([node.module] if node.module else []))
    else:
        base = node.module
    # `from qurl_mcore import checkpoint` names a part; `from .x import y` names a module of one
    return [f"{base}.{alias.name}" for alias in node.names] if base == "qurl_mcore" else [base]


def part_imports(root: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(part, imported part) -> the places ("path:line") of every import between two different parts."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        names = list(rel.with_suffix("").parts)
        package = ".".join(names if names[-1] == "__init__" else names[:-1]).removesuffix(".__init__")
        source = part_of(".".join(n for n in names if n != "__init__"))
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for module in _imported(node, package):
                    target = part_of(module)
                    if target is not None and target != source:
                        edges[(source, target)].append(f"{rel}:{node.lineno}")
    return edges


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (part -> parts) as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:  # on the current path
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def markdown_table() -> str:
    """`ALLOWED` as the Markdown table of docs/architecture.md."""
    lines = ["| part | what it holds | may import |", "|---|---|---|"]
    for name, (what, deps) in ALLOWED.items():
        shown = ", ".join(f"`{d}`" for d in sorted(deps, key=list(ALLOWED).index)) or "no other part"
        lines.append(f"| `{name}` | {what} | {shown} |")
    return "\n".join(lines)


def test_every_part_is_in_the_table():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert parts == set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to ALLOWED; drop {sorted(set(ALLOWED) - parts)}"


def test_the_table_has_no_cycle_and_names_only_parts():
    graph = {name: set(deps) for name, (_, deps) in ALLOWED.items()}
    assert all(deps <= set(ALLOWED) for deps in graph.values())
    assert cycle(graph) is None, f"ALLOWED has a cycle: {' -> '.join(cycle(graph))}"


def test_imports_stay_within_the_table():
    outside = {f"{s} -> {t}": places for (s, t), places in part_imports().items()
               if t not in ALLOWED[s][1]}
    assert not outside, f"imports that ALLOWED does not allow (move the code, or change the table): {outside}"


def test_the_parts_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in part_imports():
        graph[source].add(target)
    assert cycle(graph) is None, f"a cycle between parts: {' -> '.join(cycle(graph))}"


@pytest.mark.parametrize("source, expected", [
    ("from qurl_mcore import checkpoint as ckpt", ["qurl_mcore.checkpoint"]),
    ("from .convert import export_hf_weights", ["qurl_mcore.megatron.convert"]),
    ("from ..config import Config", ["qurl_mcore.config"]),
    ("from . import cpu, session", ["qurl_mcore.sglang"]),
    ("import qurl_mcore.rollout.engine as e", ["qurl_mcore.rollout.engine"]),
])
def test_imports_resolve_to_modules(source, expected):
    package = "qurl_mcore.megatron" if "convert" in source or "config" in source else "qurl_mcore.sglang"
    assert _imported(ast.parse(source).body[0], package) == expected


def test_docs_show_the_table():
    assert markdown_table() in DOC.read_text(), "regenerate docs/architecture.md's table from markdown_table()"
