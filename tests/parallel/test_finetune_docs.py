"""docs/parallelize.md, "Fine-tuning a transformers checkpoint", runs as written: its
``shardzoo.launch`` calls under ``__main__`` run on the test pool (``ParallelMesh`` served from
the pool's mesh cache, as tests/test_readme.py does), the ``shardzoo convert`` it names runs
through the CLI, and its closing claim holds: ``AutoModelForCausalLM`` loads the converted
directory and generates the tokens the split model generated. The model is a tiny Llama
saved with ``save_pretrained``."""

import ast
import pathlib
import re

import pytest

import shardzoo
from shardzoo.testing import cached_mesh, run_on_ranks

pytest.importorskip("transformers", reason="the section fine-tunes a transformers model")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "parallelize.md"
HEADING = "## Fine-tuning a transformers checkpoint"


def section_code() -> str:
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert len(blocks) == 1, f"expected one python block in {HEADING!r}, got {len(blocks)}"
    return blocks[0]


def launch_calls(code: str) -> list[tuple[str, int, list]]:
    """(function name, nprocs, literal args) of each ``shardzoo.launch`` call, in order."""
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "launch":
            fn, nprocs, *args = node.args
            calls.append((node.lineno, fn.id, ast.literal_eval(nprocs), [ast.literal_eval(a) for a in args]))
    return [c[1:] for c in sorted(calls)]


class _Shardzoo:
    """``shardzoo`` as the block sees it on the pool: meshes from the rank's cache."""

    def __getattr__(self, name):
        return getattr(shardzoo, name)

    def ParallelMesh(self, **layout):  # noqa: N802  (stands for the class)
        return cached_mesh(**layout)


def namespace(code: str) -> dict:
    ns = {"__name__": "docs_snippet"}  # defines everything, skips the __main__ block
    exec(compile(code, str(DOC), "exec"), ns)
    ns["shardzoo"] = _Shardzoo()
    return ns


def run_block_function(code: str, fn: str, *args):
    return namespace(code)[fn](*args)


def test_fine_tuning_section_runs(tmp_path):
    from shardzoo.cli import main
    from support.finetune import save_tiny_llama

    code = section_code()
    path = lambda name: str(tmp_path / name)  # noqa: E731  (the block's relative paths, under tmp_path)
    calls = launch_calls(code)
    assert [fn for fn, _, _ in calls] == ["train", "resume"]
    model_dir = calls[0][2][0]
    save_tiny_llama(path(model_dir))
    results = [run_on_ranks(run_block_function, nprocs, code, fn, *map(path, args)) for fn, nprocs, args in calls]
    tokens = results[1][0]
    assert all(r == tokens for r in results[1]), "the ranks generated different tokens"
    convert = re.search(r"# then: shardzoo (convert \S+ \S+)", code)[1].split()
    assert main([convert[0], path(convert[1]), path(convert[2]), "--no-progress"]) == 0
    evaluate = re.search(r'assert evaluate\("([^"]+)"\) == tokens', code)[1]
    assert evaluate == convert[2]
    assert namespace(code)["evaluate"](path(evaluate)) == tokens
    base = namespace(code)["evaluate"](path(model_dir))
    assert base != tokens, "fine-tuning changed no generated token: the check would not see a wrong conversion"
