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
assert shardzoo.plan("gpt2", 8, 80, 8, 128, top=1)  # the planner and the family presets
try:
    shardzoo.plan("llama3-8b", 8, 80, 8, 128)
except ValueError as err:
    print(err)
"""

# transformers installed but not imported: telling a plain module from a transformers model
# (parallelize asks under sp) must not import it, which would add tens of MiB to every rank.
PLAIN_MODULE_ONLY = """
import sys
import torch
from shardzoo.parallel.hf_model import is_transformers_model

assert not is_transformers_model(torch.nn.Linear(2, 2))
assert "transformers" not in sys.modules, "is_transformers_model imported transformers"
"""


def test_package_imports_and_runs_without_triton_or_transformers():
    """Triton and transformers are optional: without them the package imports, the kernels run
    their torch references (and say how to get Triton), and the planner plans shardzoo's own
    families (a transformers preset says how to get transformers). One process for both: each
    check spawns a fresh interpreter that imports torch."""
    # timeouts here guard against a hang; they are not speed checks (a loaded machine is slow)
    out = subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "llama3-8b is a transformers model, and transformers is not installed; pip install transformers" in out.stdout
    out = subprocess.run([sys.executable, "-c", PLAIN_MODULE_ONLY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_console_program_help_and_info(capsys):
    out = subprocess.run([sys.executable, "-m", "shardzoo.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage: shardzoo" in out.stdout
    from shardzoo.cli import main

    assert main(["info"]) == 0  # the same entry point, in this process: no second torch import
    assert f"shardzoo {shardzoo.__version__}" in capsys.readouterr().out


def test_training_helpers_are_reachable_from_the_top_level():
    """The names the README and the planner's run lines give (``shardzoo.models.training.autocast``,
    ``clip_grad_norm_``) resolve after a plain ``import shardzoo``, in a fresh interpreter."""
    code = ("import shardzoo\n"
            "from shardzoo.models import training\n"
            "assert shardzoo.models.training is training\n"
            "assert shardzoo.clip_grad_norm_ is training.clip_grad_norm_\n"
            "assert shardzoo.autocast is training.autocast\n"
            "assert {'clip_grad_norm_', 'autocast'} <= set(shardzoo.__all__)\n")
    # the attribute must exist before anything imports the submodule: check it first
    out = subprocess.run([sys.executable, "-c", "import shardzoo\nshardzoo.models.training\n" + code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
