"""The run folder's names and patterns are spelled once (`lmppo.run.layout`), and its patterns match the names its
helpers make; no module of src/ spells them again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from lmppo.run import layout

RUN = Path(layout.__file__).parent
SRC = RUN.parent
FILE_NAMES = {
    layout.CONFIG, layout.METRICS, layout.SAMPLES, layout.SUMMARY, layout.MANIFEST, layout.STATE, layout.TRAINED,
    layout.OPTIMIZER, layout.LOCK, layout.OWNED,
}  # fmt: skip
"""Names that mean the run folder's file wherever they are a string of their own."""
FOLDER_WORDS = {layout.FINAL, layout.CHECKPOINTS, layout.TENSORBOARD, *layout.FINAL_FOLDERS}
"""Words that are also something else (the `tensorboard` tracker and package, `value.init_from: policy`, a heading):
a layout name where they are a path part (`os.path.join(..., "final")`, `Path(...) / "final"`)."""


def test_names_and_patterns_agree():
    name = layout.checkpoint_name(4)
    assert name == "iter-00000004" and layout.CHECKPOINT_NAME.match(name).group(1) == "00000004"
    assert layout.CHECKPOINT_TEMPORARY.match(layout.checkpoint_temporary(name))
    assert layout.is_checkpoint_leftover(layout.checkpoint_temporary(name))
    for made in (
        name,
        layout.checkpoint_temporary(name),
        layout.set_aside_name(name, "a1b2c3"),
        f".{name}.old-1a2b3c4d",
    ):
        assert layout.CHECKPOINT_ENTRY.match(made), made
    for foreign in ("notes", "iter-4.bak", "my-iter-00000004", "corrupt-notes"):
        assert not layout.CHECKPOINT_ENTRY.match(foreign) and not layout.is_checkpoint_leftover(foreign)
    assert layout.rng_files(1) == ("rng-rank1.safetensors", "rng-rank1.json")
    assert set(layout.FINAL_FOLDERS) == {layout.POLICY, layout.POLICY_MERGED, layout.VALUE, layout.REWARD_MODEL}
    assert set(layout.REQUIRED_FILES) == {layout.STATE, layout.TRAINED, layout.OPTIMIZER}
    assert set(layout.LINKABLE_FOLDERS) <= set(layout.ARTIFACTS)


def _spellings(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """String constants that are a layout name (a path part, a pattern), not prose that mentions one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in names or re.search(r"^\^?\\?\.?(iter-|rng-rank|corrupt-)|iter-\\d", text):
                found.append((node.lineno, text))
    return found


def test_no_other_run_module_spells_the_layout():
    """Among the modules of lmppo.run, only layout.py has a layout name as a string of its own (a file name, the
    checkpoint pattern); the others import it."""
    names = {
        layout.CONFIG, layout.METRICS, layout.SAMPLES, layout.SUMMARY, layout.TENSORBOARD, layout.FINAL,
        layout.CHECKPOINTS, layout.MANIFEST, layout.STATE, layout.TRAINED, layout.OPTIMIZER, layout.LOCK, layout.OWNED,
    }  # fmt: skip
    repeats = [
        f"{path.name}:{line}: {text!r}"
        for path in sorted(RUN.glob("*.py"))
        if path.name != "layout.py"
        for line, text in _spellings(ast.parse(path.read_text()), names)
    ]
    assert not repeats, "run modules spelling a layout name again (use lmppo.run.layout):\n" + "\n".join(repeats)


def test_the_check_finds_a_repeat():
    tree = ast.parse(
        'A = "manifest.json"\nB = re.compile(r"^iter-\\d+$")\nC = f"rng-rank{r}.json"\nD = "the run (config.yaml)"'
    )
    assert [line for line, _ in _spellings(tree, {"manifest.json"})] == [1, 2, 3]


def _path_parts(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """String constants in `names` that are a path part: an argument of `os.path.join` or `Path`, or an operand of
    `/`."""
    found = []
    for node in ast.walk(tree):
        parts: list[ast.expr] = []
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.path.join", "path.join", "Path"):
            parts = list(node.args)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.left, node.right]
        found += [(p.lineno, p.value) for p in parts if isinstance(p, ast.Constant) and p.value in names]
    return found


def test_no_module_of_src_spells_the_layout():
    """Outside lmppo.run too (evaluation, apps, trl, training), the run folder's file names, patterns and folder
    names come from `lmppo.run.layout`."""
    repeats = [
        f"{path.relative_to(SRC)}:{line}: {text!r}"
        for path in sorted(SRC.rglob("*.py"))
        if path != Path(layout.__file__)
        for line, text in _spellings(ast.parse(path.read_text()), FILE_NAMES)
        + _path_parts(ast.parse(path.read_text()), FOLDER_WORDS)
    ]
    assert not repeats, "modules spelling a run-folder name again (use lmppo.run.layout):\n" + "\n".join(repeats)


def test_the_src_check_finds_a_path_part_and_spares_other_meanings():
    tree = ast.parse(
        'a = os.path.join(out, "final", "policy")\nb = Path(run) / "tensorboard"\nc = ("tensorboard", "Tracker")\n'
        'd = init == "policy"\ne = {"checkpoints": "a heading"}\nf = os.path.join(run, "config.yaml")'
    )
    assert _path_parts(tree, FOLDER_WORDS) == [(1, "final"), (1, "policy"), (2, "tensorboard")]
    assert [line for line, _ in _spellings(tree, FILE_NAMES)] == [6]
