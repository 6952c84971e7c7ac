"""What the planner tells a user about its pick: the peak memory term by term (the terms add
up to the peak shown) and the lines that run it (mesh, model, data parallelism, pipeline
schedule, the torchrun command). Shared by the why line, ``--explain`` and ``--json``."""

from __future__ import annotations

from shardzoo.comm.tp_grids import TP_GRIDS
from shardzoo.planner.hardware import GIB
from shardzoo.planner.schedules import SCHEDULES

# (JSON key, MemoryBreakdown field) in the order of the peak formula (planner/memory.py)
MEMORY_TERMS = (("runtime", "runtime"), ("params", "params"), ("optimizer", "optimizer"), ("buffers", "buffers"),
                ("activations_and_gradients", "dynamic"), ("workspace", "workspace"))


def peak_memory(cand):
    """The MemoryBreakdown of the candidate's stage with the largest peak (the peak shown)."""
    return max(cand.reports, key=lambda r: r.memory.peak).memory


def memory_terms(cand) -> dict[str, int]:
    """Bytes of each term of the candidate's peak, by name; they sum to
    ``cand.peak_bytes_per_rank``."""
    mem = peak_memory(cand)
    return {label: getattr(mem, field) for label, field in MEMORY_TERMS}


def rounded_gib(parts: list[int], digits: int) -> tuple[list[float], float]:
    """``parts`` (bytes) and their sum in GiB rounded to ``digits`` so that the rounded parts add
    up to the rounded sum exactly (largest remainders get the spare units), as printed."""
    scale = 10**digits
    exact = [b / GIB * scale for b in parts]
    floors = [int(x) for x in exact]
    total = round(sum(parts) / GIB * scale)
    spare = total - sum(floors)
    for i in sorted(range(len(parts)), key=lambda i: floors[i] - exact[i])[:max(spare, 0)]:
        floors[i] += 1
    return [f / scale for f in floors], total / scale


def memory_text(cand, digits: int = 2) -> str:
    """``"peak 2.80 GiB = runtime 1.00 + params 0.46 + ..."``: every term of the peak, rounded so
    that the printed terms add up to the printed peak."""
    terms = memory_terms(cand)
    shown, peak = rounded_gib(list(terms.values()), digits)
    text = " + ".join(f"{name.replace('_', ' ')} {v:.{digits}f}" for name, v in zip(terms, shown))
    return f"peak {peak:.{digits}f} GiB = {text}"


def run_lines(plan, cand) -> list[str]:
    """Python lines (per rank) and the launch command that run ``cand``; ``config`` stands for
    the model's config (its config class's ``from_json(DIR)``)."""
    lay, m, zero = cand.layout, cand.micro_batches, cand.zero
    depth = f", tp_depth={lay['tp_depth']}" if TP_GRIDS[lay["tp_mode"]].has_depth else ""
    ep = f", ep={lay['ep']}" if lay.get("ep", 1) > 1 else ""
    mesh = (f"mesh = shardzoo.ParallelMesh(dp={lay['dp']}, pp={lay['pp']}, sp={lay['sp']}, tp={lay['tp']}, "
            f"tp_mode=\"{lay['tp_mode']}\"{depth}{ep})")
    builder = plan.problem.shape.builder
    if builder is None:
        return parallelize_lines(plan, cand, mesh)
    if lay["pp"] > 1 and cand.virtual_stages > 1:
        return family_chunk_lines(plan, cand, mesh)
    extra = ""
    if lay["pp"] > 1:
        extra += ", stage=(mesh.pp_rank, mesh.pp_size)"
    if lay["sp"] > 1 and plan.problem.sp_mode != "ring":
        extra += f", sp_mode=\"{plan.problem.sp_mode}\""
    lines = [mesh, f"model = {builder.__name__}(config, mesh=mesh{extra}, "
                   f"checkpointing={cand.activation_checkpointing})"]
    trained = "model"
    if lay["dp"] * lay["sp"] > 1:  # the wrapper runs forward / backward, the model keeps its loss
        trained = "wrapped"
        lines.append(f"wrapped = shardzoo.data_parallel(model, mesh, zero={zero})")
        lines.append("optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-4)")
    else:
        lines.append("optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)")
    if lay["pp"] > 1:
        lines.append(f"schedule = build_schedule([(mesh.pp_rank, {trained})], mesh, n_microbatches={m}, "
                     f"schedule=\"{cand.schedule}\", loss_fn=model.loss)")
    if plan.problem.e == 2:
        lines.append("with autocast(): ...  # bf16 autocast, fp32 weights (shardzoo.models.training.autocast)")
    lines.append(torchrun_command(plan, lay["dp"] * lay["pp"] * lay["sp"] * lay["tp"]))
    return lines


def parallelize_lines(plan, cand, mesh: str) -> list[str]:
    """The lines of a model priced by its modules: built by transformers (or one's own code),
    split (and with pp > 1 cut into stages) by ``shardzoo.parallelize``, trained through its
    ``labels=`` loss or, with pp > 1, ``shardzoo.pipeline``'s step."""
    lay, shape = cand.layout, plan.problem.shape
    extra = f", sp_mode=\"{plan.problem.sp_mode}\"" if lay["sp"] > 1 and plan.problem.sp_mode != "ring" else ""
    given = ", plan=plan" if shape.walk.given_plan else ""
    build = ("model = AutoModelForCausalLM.from_config(config)  # or .from_pretrained(DIR)"
             if shape.walk.transformers else f"model = {type(shape.walk.model).__name__}(...)  # the model priced")
    if lay["pp"] > 1:  # the stages parallelize cuts by default, written out
        v = getattr(cand, "virtual_stages", 1)
        base, left = divmod(shape.layers, lay["pp"] * v)
        counts = [base + (s < left) for s in range(lay["pp"] * v)]
        placed = ", placement=\"v\"" if cand.schedule in V_PLACED else ""
        extra = f", stages={counts}" + (f", virtual_stages={v}{placed}" if v > 1 else "") + extra
    lines = [mesh, build, f"model = shardzoo.parallelize(model, mesh{given}{extra}, "
                          f"checkpointing={cand.activation_checkpointing})"]
    trained = _optimizer_lines(lines, cand, "model", f"shardzoo.data_parallel(model, mesh, zero={cand.zero})",
                               "model.parameters()")
    call = f"{trained}(input_ids=ids, labels=ids).loss" if shape.walk.transformers else \
        f"shardzoo.lm_loss(model, {trained}(ids), ids)"
    if lay["pp"] > 1:
        schedule = SCHEDULES[cand.schedule][0]  # shardzoo.pipeline's name
        lines.append(f"pipe = shardzoo.pipeline({trained}, mesh, n_microbatches={cand.micro_batches}, "
                     f"schedule=\"{schedule}\")")
        call = "pipe.step(input_ids=ids, labels=ids)"
    lines.append(f"loss = {call}  # ids: this dp replica's [rows, seq] tokens, whole on every tp / sp rank")
    return lines + _launch_lines(plan, lay)


def _optimizer_lines(lines: list[str], cand, models: str, wrap: str, params: str) -> str:
    """Append the data_parallel line (dp x sp > 1: ``wrapped = <wrap>``) and the optimizer's;
    return the name the step trains: ``wrapped``, or ``models`` (whose parameters: ``params``)."""
    lay = cand.layout
    if lay["dp"] * lay["sp"] == 1:
        lines.append(f"optimizer = torch.optim.AdamW({params}, lr=1e-4)")
        return models
    lines.append(f"wrapped = {wrap}")
    lines.append("optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-4)")
    return "wrapped"


def _launch_lines(plan, lay: dict) -> list[str]:
    """The autocast hint (bf16) and the torchrun command of the layout."""
    out = ["with autocast(): ...  # bf16 autocast, fp32 weights (shardzoo.models.training.autocast)"] \
        if plan.problem.e == 2 else []
    return out + [torchrun_command(plan, lay["dp"] * lay["pp"] * lay["sp"] * lay["tp"])]


V_PLACED = ("zbv", "dualpipev")  # two stages per rank in a V: pp_rank and 2 pp - 1 - pp_rank


def family_chunk_lines(plan, cand, mesh: str) -> list[str]:
    """The lines of a family's pipeline of several stages per rank (docs/models.md): this rank's
    stages built one by one, each through ``data_parallel``, run by ``shardzoo.pipeline``."""
    lay, builder, v = cand.layout, plan.problem.shape.builder, cand.virtual_stages
    n = f"{v} * mesh.pp_size"
    stages = (f"[(mesh.pp_rank, {n}), ({n} - 1 - mesh.pp_rank, {n})]" if cand.schedule in V_PLACED
              else f"[(mesh.pp_rank + i * mesh.pp_size, {n}) for i in range({v})]")
    extra = f", sp_mode=\"{plan.problem.sp_mode}\"" if lay["sp"] > 1 and plan.problem.sp_mode != "ring" else ""
    lines = [mesh, f"stages = {stages}",
             f"models = [{builder.__name__}(config, mesh=mesh, stage=stage{extra}, "
             f"checkpointing={cand.activation_checkpointing}) for stage in stages]"]
    trained = _optimizer_lines(lines, cand, "models",
                               f"[shardzoo.data_parallel(m, mesh, zero={cand.zero}) for m in models]",
                               "[p for m in models for p in m.parameters()]")
    lines.append(f"pipe = shardzoo.pipeline({trained}, mesh, n_microbatches={cand.micro_batches}, "
                 f"schedule=\"{SCHEDULES[cand.schedule][0]}\")")
    lines.append("loss = pipe.step(input_ids=ids, labels=ids)  # ids: this dp replica's [rows, seq] tokens")
    lines += _launch_lines(plan, lay)
    return lines


def torchrun_command(plan, world: int) -> str:
    """The launch command of ``world`` ranks on the plan's hardware (nodes of its size)."""
    per_node = plan.hardware.devices_per_node
    if plan.hardware.host.local_only or world <= per_node:
        return f"torchrun --nproc-per-node {world} train.py"
    nodes = -(-world // per_node)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:29500 train.py  # on each of the {nodes} nodes")


def pick_json(plan) -> dict | None:
    """``--json``'s ``pick``: the first candidate's memory terms (bytes, summing to its peak)
    and the lines that run it; None when nothing fits."""
    if not plan.fits:
        return None
    cand = plan[0]
    return {"peak_bytes_per_rank": cand.peak_bytes_per_rank, "memory_terms": memory_terms(cand),
            "run": run_lines(plan, cand)}
