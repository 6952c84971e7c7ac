"""The package works without its optional dependencies, and the console program answers."""

import subprocess
import sys

import shardzoo

# A None entry in sys.modules makes an import raise ImportError, as on a machine without it.
WITHOUT_OPTIONAL = """
import sys
for name in ("triton", "triton.language", "transformers"):
    sys.modules[name] = None
import torch
import shardzoo, shardzoo.comm, shardzoo.layers, shardzoo.models, shardzoo.planner, shardzoo.testing
import shardzoo.kernels as K

assert not K.HAS_TRITON
q = torch.randn(1, 1, 4, 16)
out, lse = K.attention_block_forward(q, q, q)
K.fused_layer_norm(torch.randn(2, 8)); K.bias_gelu(torch.randn(2, 8))
K.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]))
try:
    K.attention_block_forward(q, q, q, backend="triton")
except ValueError as e:
    assert "needs the triton package" in str(e), e
else:
    raise SystemExit("no error for backend='triton' without triton")
assert shardzoo.plan("gpt2", 2, 80, 8, 128, top=1)  # the planner and the family presets
try:
    shardzoo.plan("llama3-8b", 8, 80, 8, 128)
except ValueError as err:
    print(err)
"""

# A fresh interpreter with everything installed, as a user's first ``import shardzoo``:
# * telling a plain module from a transformers model (parallelize asks under sp) must not import
#   transformers, which would add tens of MiB to every rank;
# * the names the README and the planner's run lines give (``shardzoo.models.training.autocast``,
#   ``clip_grad_norm_``) resolve after a plain ``import shardzoo`` (the attribute must exist
#   before anything imports the submodule: checked first);
# * ``python -m shardzoo.cli --help`` answers (runpy runs the module as ``-m`` does).
FRESH_INTERPRETER = """
import runpy, sys
import torch
import shardzoo
shardzoo.models.training
from shardzoo.parallel.hf_model import is_transformers_model

assert not is_transformers_model(torch.nn.Linear(2, 2))
assert "transformers" not in sys.modules, "is_transformers_model imported transformers"
from shardzoo.models import training
assert shardzoo.models.training is training
assert shardzoo.clip_grad_norm_ is training.clip_grad_norm_
assert shardzoo.autocast is training.autocast
assert {"clip_grad_norm_", "autocast"} <= set(shardzoo.__all__)
sys.argv = ["shardzoo", "--help"]
try:
    runpy.run_module("shardzoo.cli", run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
"""


def test_package_imports_and_runs_without_triton_or_transformers():
    """Triton and transformers are optional: without them the package imports, the kernels run
    their torch references (and say how to get Triton), and the planner plans shardzoo's own
    families (a transformers preset says how to get transformers)."""
    # timeouts here guard against a hang; they are not speed checks (a loaded machine is slow)
    out = subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "llama3-8b is a transformers model, and transformers is not installed; pip install transformers" in out.stdout


def test_a_fresh_interpreter_imports_no_transformers_reaches_the_helpers_and_runs_the_cli(capsys):
    """FRESH_INTERPRETER's checks, in one interpreter (each costs a torch import); then the
    console program's ``info`` in this process."""
    out = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: shardzoo" in out.stdout, out.stdout[-2000:]
    from shardzoo.cli import main

    assert main(["info"]) == 0
    assert f"shardzoo {shardzoo.__version__}" in capsys.readouterr().out
