"""The contract of ``shardzoo.parallelize`` / ``shardzoo.from_pretrained``, checked on drawn cases.

A :class:`Case` is a transformers architecture (Llama, Qwen2, Qwen3, Mistral, GPT-2) with a small
random config, a dtype, a padded batch and a mesh within 8 ranks. The contract (docs/parallelize.md,
"Conformance"): either the parallelized model equals the serial transformers model (loss, gathered
logits on the real tokens, global gradient norm, every weight after one SGD step; fp32 built
in-process and split by ``parallelize``, bf16 saved with ``save_pretrained`` and loaded by
``from_pretrained(dtype=torch.bfloat16)``, each against the serial model of its dtype with the
fp64 model as the exact result), or ``parallelize`` / ``from_pretrained`` raises ValueError before
any weight moves, with a message naming a size of the config or the mesh and a fix; a sequence
length the sp shards do not divide (a size of the batch, not of the model) is refused the same way
by the first forward. Anything else
fails: a wrong result, another exception, a refusal later or without the sizes.

The world size is drawn first, so each example runs on the cached pool of that size
(``run_on_ranks``). Imports hypothesis, so ``shardzoo.testing`` does not import it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import os
import re

import torch
from hypothesis import strategies as st

from support.hf_parallel import _step, assert_step_equal, dp_rows, padded_batch, parallel_step, tiny_causal_lm
from shardzoo.testing.meshes import world_of_kwargs
from shardzoo.testing.pools import cached_mesh, run_on_ranks

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
WINDOWED = ("qwen2", "qwen3", "mistral")  # the architectures with a sliding window
WORLDS = (1, 2, 4, 6, 8)  # 6: tp 3, which divides few sizes
GRIDS = (("1d", 1), ("2d", 1), ("2.5d", 1), ("2.5d", 2), ("3d", 1))  # (tp_mode, tp_depth)
# A refusal's fix: a size that works ("e.g. 4", "head parts that work: [1, 2]", "a multiple of 2")
# or what to change ("use sp=1", "pass a batch of ...").
SUGGESTION = re.compile(r"e\.g\.|that work|multiple of \d|\buse\b|\bpass\b|\bset\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn example: ``config`` holds the config fields (GPT-2's own names for gpt2)."""

    arch: str
    config: tuple  # sorted (field, value) pairs
    dtype: str  # "fp32" or "bf16"
    rows: int
    seq: int
    side: str  # the side the padded tokens are on
    pads: tuple  # padded tokens per row
    mesh: tuple  # sorted ParallelMesh kwargs
    sp_mode: str
    wrap: bool  # through shardzoo.data_parallel
    zero: int
    seed: int

    @property
    def mesh_kwargs(self) -> dict:
        return dict(self.mesh)

    @property
    def world(self) -> int:
        return world_of_kwargs(self.mesh_kwargs)

    def sizes(self) -> set[int]:
        """Every size of the config and the mesh a refusal could name (and their products)."""
        c, m = dict(self.config), self.mesh_kwargs
        values = {v for v in list(c.values()) + list(m.values()) if isinstance(v, int) and not isinstance(v, bool)}
        heads = c.get("num_attention_heads", c.get("n_head"))
        kv, head_dim = c.get("num_key_value_heads", heads), c.get("head_dim")
        if head_dim:
            values |= {heads * head_dim, kv * head_dim}
        return values | {self.rows, self.seq, self.world, round(math.sqrt(m.get("tp", 1) / m.get("tp_depth", 1)))}


def _grids(tp: int) -> list[tuple[str, int]]:
    from shardzoo.comm.tp_grids import tp_grid

    fits = []
    for mode, depth in GRIDS:
        try:
            tp_grid(mode).shape(tp, depth)
            fits.append((mode, depth))
        except ValueError:
            pass
    return fits


@st.composite
def cases(draw) -> Case:
    """A :class:`Case`: the world size first, then a mesh of it, a model, a dtype and a batch."""
    world = draw(st.sampled_from(WORLDS))
    sp = draw(st.sampled_from([s for s in (1, 2) if world % s == 0]))
    dp = draw(st.sampled_from([d for d in (1, 2) if world // sp % d == 0]))
    tp = world // (sp * dp)
    mode, depth = draw(st.sampled_from(_grids(tp)))
    mesh = dict(tp=tp, sp=sp, dp=dp, tp_mode=mode, **({"tp_depth": depth} if depth > 1 else {}))

    arch = draw(st.sampled_from(ARCHS))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    head_dim = draw(st.sampled_from([d for d in (4, 8, 16) if heads * d <= 64]))
    inter = draw(st.sampled_from([16, 37, 48, 64, 96]))
    vocab = draw(st.sampled_from([64, 96, 99, 101, 128]))
    tied = draw(st.booleans())
    layers = draw(st.sampled_from([1, 2]))
    if arch == "gpt2":
        config = dict(n_embd=heads * head_dim, n_head=heads, n_inner=inter, vocab_size=vocab, n_layer=layers,
                      tie_word_embeddings=tied)
    else:
        hidden = draw(st.sampled_from([h for h in (16, 24, 30, 32, 48, 64) if h % heads == 0]))  # transformers' rule
        config = dict(hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
                      head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, num_hidden_layers=layers,
                      tie_word_embeddings=tied)
    if arch in WINDOWED:
        window = draw(st.one_of(st.none(), st.integers(2, 16)))
        config["sliding_window"] = window
        if arch != "mistral":
            config.update(use_sliding_window=window is not None, max_window_layers=0)

    rows = draw(st.integers(dp, 4))
    seq = draw(st.integers(4, 16))
    if sp > 1 and draw(st.integers(0, 3)):  # mostly a length the sp shards divide; the rest is refused at the forward
        seq = -(-seq // (2 * sp)) * 2 * sp
    # every row keeps 2 real tokens, so one target: a batch of none has no loss (0 / 0)
    pads = tuple(draw(st.lists(st.sampled_from([p for p in (0, 0, 1, 3, seq - 2) if p <= seq - 2]),
                               min_size=rows, max_size=rows)))
    return Case(arch=arch, config=tuple(sorted(config.items())), dtype=draw(st.sampled_from(["fp32", "bf16"])),
                rows=rows, seq=seq, side=draw(st.sampled_from(["right", "left"])), pads=pads,
                mesh=tuple(sorted(mesh.items())), sp_mode=draw(st.sampled_from(["ring", "ulysses"])) if sp > 1 else "ring",
                wrap=True if dp > 1 else draw(st.booleans()), zero=draw(st.sampled_from([0, 1, 2, 3])),
                seed=draw(st.integers(0, 2**16)))


def build_model(case: Case):
    """The case's serial fp32 model, its norm weights drawn away from 1 (a norm's scale matters)."""
    model = tiny_causal_lm(case.arch, case.seed, **dict(case.config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or ".ln_" in name):
                p.uniform_(0.5, 1.5)
    return model


def check_refusal(message: str, case: Case) -> None:
    """A refusal names a size of the config or the mesh, and a size or a change that works."""
    numbers = {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.]\d)", message)}
    named = numbers & case.sizes()
    assert named and SUGGESTION.search(message), \
        f"a refusal must name a size of the config / mesh {sorted(case.sizes())} and a fix; got: {message}"


def check_case(case: Case, directory: str | None) -> str:
    """On every rank: the contract for ``case`` (see the module docstring). ``directory``: the
    saved serial model, for bf16. Returns "equal" or "refused: <message>"."""
    import transformers

    import shardzoo

    batch = padded_batch(case.seed, case.rows, case.seq, dict(case.config)["vocab_size"], case.pads, case.side)
    mesh = cached_mesh(**case.mesh_kwargs)
    if case.dtype == "fp32":
        serial = build_model(case)
        exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
        before = {k: v.clone() for k, v in parallel.state_dict().items()}
        try:
            shardzoo.parallelize(parallel, mesh, sp_mode=case.sp_mode)
        except ValueError as err:
            after = parallel.state_dict()
            assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before), \
                f"parallelize refused ({err}) after changing the model's weights"
            check_refusal(str(err), case)
            return f"refused: {err}"
    else:
        load = transformers.AutoModelForCausalLM.from_pretrained
        serial = load(directory, dtype=torch.bfloat16).train()
        exact = load(directory, dtype=torch.float64).train()
        try:
            parallel = shardzoo.from_pretrained(directory, mesh, dtype=torch.bfloat16, sp_mode=case.sp_mode).train()
        except ValueError as err:
            check_refusal(str(err), case)
            return f"refused: {err}"
    out_s, out_x = _step(serial, batch), _step(exact, batch)
    try:
        result = parallel_step(parallel, mesh, batch, zero=case.zero, wrap=case.wrap)
    except ValueError as err:  # only the batch's own sizes may be refused this late, at the first forward
        assert str(case.seq) in re.findall(r"\d+", str(err)), f"refused at the forward without naming the batch: {err}"
        check_refusal(str(err), case)
        return f"refused at the forward: {err}"
    assert_step_equal(case.arch, result, (serial, out_s), (exact, out_x), dp_rows(case.rows, mesh), batch[1].bool())
    return "equal"


def _digest(directory: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def run_case(case: Case, tmpdir: str) -> str:
    """Check ``case`` on the cached pool of its world size; bf16 cases save the serial model to
    ``tmpdir`` first (and check a refusal left it as it was). Returns the outcome, the same on
    every rank."""
    directory = None
    if case.dtype == "bf16":
        directory = os.path.join(tmpdir, "model")
        build_model(case).save_pretrained(directory)
        saved = _digest(directory)
    outcomes = run_on_ranks(check_case, case.world, case, directory)
    assert len(set(outcomes)) == 1, f"the ranks disagree: {outcomes}"
    if directory is not None:
        assert _digest(directory) == saved, "from_pretrained changed the directory it read"
    return outcomes[0]
