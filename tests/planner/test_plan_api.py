"""``shardzoo plan`` / ``shardzoo.plan``: the JSON shape and sorting of the contract, exit codes,
pruning reasons and --explain, bad input, placement, hardware presets and the calibration cache."""

import json
import os

import pytest

import shardzoo
from shardzoo.cli import main
from shardzoo.comm.tp_grids import TP_GRIDS
from shardzoo.planner import calibration
from shardzoo.planner.api import CANDIDATE_KEYS
from shardzoo.planner.host_cpu import TimeSharedCpu
from shardzoo.planner.presets import HARDWARE, family_presets, load_model
from shardzoo.planner.time import axis_strides, link

ARGS = ["plan", "gpt2", "--world", "8", "--device-memory-gib", "80", "--global-batch", "16", "--seq", "128",
        "--hardware", "a100"]


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_the_contract_keys_and_order(capsys):
    code, out, _ = run(capsys, ARGS + ["--json"])
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"hardware", "candidates", "pick"} and data["hardware"]["name"] == "a100"
    cands = data["candidates"]
    assert cands and all(tuple(c) == CANDIDATE_KEYS for c in cands)
    assert all(set(c["layout"]) == {"dp", "pp", "sp", "tp", "tp_mode", "tp_depth"} for c in cands)
    assert all(c["layout"]["dp"] * c["layout"]["pp"] * c["layout"]["sp"] * c["layout"]["tp"] == 8 for c in cands)
    fits = [c for c in cands if c["fits"]]
    assert cands[: len(fits)] == fits  # fitting first ...
    assert [c["step_seconds"] for c in fits] == sorted(c["step_seconds"] for c in fits)  # ... by step time
    rest = cands[len(fits):]
    assert [c["peak_bytes_per_rank"] for c in rest] == sorted(c["peak_bytes_per_rank"] for c in rest)
    assert {c["layout"]["tp_mode"] for c in cands} == {"1d", "2d", "2.5d", "3d"}
    assert {c["zero"] for c in cands} == {0, 1, 2, 3} and {c["activation_checkpointing"] for c in cands} == {0, 1}


def test_api_returns_the_same_candidates_as_objects(capsys):
    _, out, _ = run(capsys, ARGS + ["--json", "--top", "5"])
    planned = shardzoo.plan("gpt2", 8, 80, 16, 128, hardware="a100", top=5)
    assert [c.to_json() for c in planned] == json.loads(out)["candidates"]
    assert planned.to_json()["hardware"] == HARDWARE["a100"].to_json()


def test_table_names_why_the_first_wins(capsys):
    code, out, _ = run(capsys, ARGS + ["--top", "3"])
    run_lines = out.split("run #1")[1].splitlines()[1:]
    assert code == 0 and "why #1: fastest candidate" in out
    assert len(out.splitlines()) == 1 + 1 + 3 + 1 + 1 + len(run_lines) and run_lines[0].strip().startswith("mesh = ")


def test_nothing_fits_exits_1_naming_the_smallest_peak(capsys):
    planned = shardzoo.plan("gpt2-xl", 4, 0.5, 8, 1024, hardware="a100")
    smallest = min(planned, key=lambda c: c.peak_bytes_per_rank)
    code, _, err = run(capsys, ["plan", "gpt2-xl", "--world", "4", "--device-memory-gib", "0.5", "--global-batch",
                                "8", "--seq", "1024", "--hardware", "a100"])
    assert code == 1 and "nothing fits in 0.5 GiB" in err
    assert f"{smallest.peak_bytes_per_rank / 2**30:.2f} GiB, needed by {smallest.describe()}" in err


def test_pruned_layouts_say_why(capsys):
    planned = shardzoo.plan("gpt2-xl", 8, 80, 16, 128, hardware="a100")  # 25 heads
    assert all(c.layout["tp"] in (1,) or c.layout["tp_mode"] != "1d" for c in planned)
    assert any("splits the heads in 2 parts" in p.reason and "its 25 heads" in p.reason for p in planned.pruned)
    code, out, _ = run(capsys, ["plan", "gpt2-xl", "--world", "8", "--device-memory-gib", "80", "--global-batch",
                                "16", "--seq", "128", "--hardware", "a100", "--explain", "dp=4,pp=1,sp=1,tp=2"])
    assert code == 0 and "not legal" in out and "splits the heads in 2 parts" in out and "its 25 heads" in out
    code, out, _ = run(capsys, ARGS + ["--explain", "dp=2,pp=1,sp=1,tp=4,tp_mode=2d"])
    assert code == 0 and "8 candidates" in out and "tp_col" in out and "peak" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "no-such-model", "--world", "8", "--device-memory-gib", "8", "--global-batch", "8", "--seq", "8"],
     "unknown model 'no-such-model'"),
    (ARGS[:-2] + ["--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["plan", "gpt2", "--world", "8", "--device-memory-gib", "8", "--global-batch", "8", "--seq", "4096"],
     "exceeds gpt2's 1024 positions"),
    (ARGS + ["--nodes", "3"], "--nodes 3 must divide the world size 8"),
    (ARGS + ["--explain", "dp=two"], "dp='two' must be a positive integer"),
    (ARGS + ["--top", "0"], "--top 0 must be at least 1"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, argv)
    assert code == 2 and message in err


def test_placement_costs_groups_across_nodes_at_the_inter_node_link():
    a100 = HARDWARE["a100"]
    strides = axis_strides(dp=2, pp=1, sp=1, tp=16, tp_mode="1d", tp_depth=1)
    assert link(("tp",), strides, a100) == (a100.inter_bandwidth, a100.inter_latency)  # 16 ranks > 8 per node
    strides = axis_strides(dp=4, pp=1, sp=2, tp=4, tp_mode="1d", tp_depth=1)
    assert link(("tp",), strides, a100)[0] == link(("sp",), strides, a100)[0] == a100.intra_bandwidth
    assert link(("dp", "sp"), strides, a100)[0] == a100.inter_bandwidth
    fast = shardzoo.plan("gpt2", 16, 80, 16, 128, hardware="a100", tp_modes=("1d",))
    slow = shardzoo.plan("gpt2", 16, 80, 16, 128, hardware="a100", tp_modes=("1d",), devices_per_node=1)
    assert slow[0].step_seconds > fast[0].step_seconds


def test_every_preset_plans_and_gpt3_has_its_published_size():
    for name in family_presets():
        shape = load_model(name)
        assert shardzoo.plan(name, 8, 1e4, 8, min(128, shape.max_seq), hardware="h200", top=1), name
    serial = shardzoo.plan("gpt3-175b", 1, 1e6, 1, 2048, hardware="a100", zero_stages=(0,), checkpointing=(False,))
    assert abs(serial[0].param_bytes_per_rank / 4 / 175e9 - 1) < 0.01  # Brown et al. 2020: 175B parameters


def test_a_hugging_face_directory_is_read_for_its_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64,
                                                       "n_head": 4, "vocab_size": 100}))
    assert load_model(str(tmp_path)).family == "gpt2"
    assert shardzoo.plan(str(tmp_path), 4, 8, 8, 64, hardware="a100", top=1)[0].fits
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="model_type='no-such-model'.*families.*transformers"):
        load_model(str(tmp_path))


def test_calibration_cache_is_reused_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDZOO_CACHE_DIR", str(tmp_path))
    host = TimeSharedCpu(cores=2, shared_latency_2x=1e-3, shared_latency_4x=3e-3)
    stored = HARDWARE["a100"].to_json() | {"name": "calibrate", "backend": "gloo", "host": host.to_json()}
    path = calibration.cache_path()
    with open(path, "w") as f:
        json.dump({"version": calibration.CACHE_VERSION, "hardware": stored}, f)
    read = calibration.calibrate()  # read, not measured
    assert read.to_json() == stored and read.host == host
    stored["intra_bandwidth"] = -1
    with open(path, "w") as f:
        json.dump({"version": calibration.CACHE_VERSION, "hardware": stored}, f)
    with pytest.raises(ValueError, match=f"{os.path.basename(path)}: intra_bandwidth=-1 must be a positive"):
        calibration.calibrate()
    stored["intra_bandwidth"], stored["host"]["cores"] = 1e9, 0
    with open(path, "w") as f:
        json.dump({"version": calibration.CACHE_VERSION, "hardware": stored}, f)
    with pytest.raises(ValueError, match="cores=0 must be a positive integer"):
        calibration.calibrate()
    stored["host"]["cores"], stored["host"]["module_call_seconds"] = 2, -1e-4  # a measured figure: 0 or positive
    with open(path, "w") as f:
        json.dump({"version": calibration.CACHE_VERSION, "hardware": stored}, f)
    with pytest.raises(ValueError, match="module_call_seconds=-0.0001 must be a positive finite number"):
        calibration.calibrate()
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        calibration.calibrate()


def test_a_version_6_calibration_cache_is_read_as_device_and_host(tmp_path, monkeypatch):
    """Version 6 caches held the time-shared host's fields beside the device's: the same
    measurements, split into the Hardware and its TimeSharedCpu, with gloo's collectives."""
    monkeypatch.setenv("SHARDZOO_CACHE_DIR", str(tmp_path))
    flat = HARDWARE["a100"].to_json() | {"name": "calibrate", "cores_per_node": 2, "shared_latency_2x": 1e-3,
                                          "shared_latency_4x": 3e-3, "large_elementwise_bandwidth": 5e9}
    del flat["backend"], flat["host"]
    with open(calibration.cache_path(), "w") as f:
        json.dump({"version": 6, "hardware": flat}, f)
    hw = calibration.calibrate()
    assert hw.backend == "gloo" and hw.intra_bandwidth == flat["intra_bandwidth"]
    assert hw.host == TimeSharedCpu(cores=2, shared_latency_2x=1e-3, shared_latency_4x=3e-3,
                                    large_elementwise_bandwidth=5e9)


@pytest.mark.parametrize("mode, tp, depth", [("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_each_layout_states_what_its_blocks_cost(mode, tp, depth):
    """The planner prices a layout through its layout class, without building it: a linear
    layer's weight is split over the tp ranks (2.5D keeps a copy per depth slice) and its
    forward and backward send over the layout's own mesh axes."""
    from shardzoo.planner.block_costs import costs_of

    costs = costs_of(mode, tp, depth)
    piece = costs.linear(64, 128, 32 * tp, 4, bias=False)
    assert piece.params == 64 * 128 * depth // tp
    axes = {a for call in piece.calls for a in call.axes}
    assert axes and axes <= set(TP_GRIDS[mode].sub_axes)


@pytest.mark.parametrize("cores", [0, 2], ids=["accelerators", "time-shared-cpu"])
def test_the_why_line_splits_the_step_it_explains(cores):
    """The compute and communication seconds of the why line add up to the winner's step less
    its optimizer: at least the pipeline part, at most the whole step (3 digits printed), on
    accelerators and on a host whose ranks time-share the cores."""
    import dataclasses
    import re

    from shardzoo.planner.report import why

    hw = HARDWARE["a100"] if not cores else dataclasses.replace(HARDWARE["a100"], host=TimeSharedCpu(cores=cores))
    plan = shardzoo.plan("gpt2", 8, 80, 16, 256, hardware=hw, top=None)
    found = re.search(r"~([\d.e+-]+) s compute and ~([\d.e+-]+) s communication", why(plan, plan[0]))
    total, step = float(found[1]) + float(found[2]), plan[0].step_seconds
    pipeline = step - max(r.step_seconds for r in plan[0].reports)
    assert 0.99 * pipeline <= total <= 1.01 * step


def test_a_model_run_by_transformers_code_holds_the_library_too(tmp_path):
    """A host's ``library_bytes`` (what building a transformers model adds to a rank, measured by
    calibration) counts in the peak of a model run by transformers' code, and only there."""
    import dataclasses

    from transformers import LlamaConfig

    from shardzoo.planner.api import price

    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                vocab_size=101, max_position_embeddings=64).save_pretrained(tmp_path)
    bare = HARDWARE["a100"]
    host = dataclasses.replace(bare, library_bytes=123 << 20)
    assert host.runtime_for(True) == bare.runtime_bytes + (123 << 20) and host.runtime_for(False) == bare.runtime_bytes
    peaks = {}
    for name, model in (("llama", str(tmp_path)), ("gpt2", "gpt2")):
        for hw in (bare, host):
            peaks[name, hw.library_bytes] = price(model, 2, 4, 32, "dp=2", hardware=hw).candidate.peak_bytes_per_rank
    assert peaks["llama", 123 << 20] - peaks["llama", 0] == 123 << 20
    assert peaks["gpt2", 123 << 20] == peaks["gpt2", 0]
