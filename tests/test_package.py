"""The package imports without Triton, and the console script answers."""

import subprocess
import sys

import shardzoo


def test_imports_without_triton():
    # A None entry in sys.modules makes `import triton` raise ImportError, as on a machine without it.
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import shardzoo, shardzoo.comm, shardzoo.layers, shardzoo.kernels, shardzoo.testing\n"
        "print('imported', shardzoo.kernels.HAS_TRITON)"
    )
    # timeouts here guard against a hang; they are not speed checks (a loaded machine is slow)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "imported False" in out.stdout


def test_console_script_help_and_info():
    out = subprocess.run([sys.executable, "-m", "shardzoo.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage: shardzoo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "shardzoo.cli", "info"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"shardzoo {shardzoo.__version__}" in out.stdout
