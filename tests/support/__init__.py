"""The suite's scenarios: tiny models, their serial twins and the checks the tests run on the
worker pools (ZeRO and checkpoint stacks, transformers twins, a model of one's own, fuzz cases).

Only the tests import these modules. ``tests/`` is on ``sys.path`` (pytest puts the root
conftest's folder there), so a test imports ``from support.user_model import ...``, and the
spawned ranks of ``shardzoo.testing.run_on_ranks``, which start with the parent's ``sys.path``,
unpickle functions of these modules by the same name. What a user needs to test their own
parallel code (pools, asserts, meshes, dtypes) stays in ``shardzoo.testing``.
"""
