"""N-D layouts (parallel.dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size): the rules
by key, Accelerate's YAML and variables read as they are, the files written back, and what the
GPU-only axes (CP, SP) hand to Accelerate, checked on this CPU machine. The runs themselves:
tests/test_parallelism_multiprocess.py."""

from __future__ import annotations

import pytest
from conftest import cfg_of, problems_of
from conftest import run_cli

from overdrive.config import batch
from overdrive.resolving import resolve
from overdrive.errors import UserError
from overdrive.interop import writing as export
from overdrive.strategies import accelerator_kwargs, cpu, layout

LLAMA = ["model.architecture.model_type=llama", "model.architecture.num_attention_heads=8",
         "model.architecture.num_key_value_heads=2"]


def test_the_rest_of_the_world_is_the_data_parallel_degree():
    lay = layout.layout(cfg_of("parallel.strategy=fsdp", "parallel.tp_size=2", "launch.num_processes=8"))
    assert (lay.dp_replicate, lay.dp_shard, lay.tp) == (1, 4, 2) and lay.data_parallel == 4
    assert lay.mesh == (("dp_shard", 4), ("tp", 2))
    hsdp = layout.layout(cfg_of("parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "launch.num_processes=8"))
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 4) and hsdp.is_nd
    ddp = cfg_of("parallel.tp_size=2", "launch.num_processes=2")
    assert batch.data_parallel_degree(ddp) == 1 and layout.layout(ddp).mesh == (("tp", 2),)
    plain = cfg_of("parallel.strategy=fsdp", "launch.num_processes=4")
    assert not layout.layout(plain).is_nd and layout.parallelism_kwargs(plain) is None


@pytest.mark.parametrize("cli, key, text", [
    (["parallel.strategy=fsdp", "parallel.dp_shard_size=3", "launch.num_processes=4"], "parallel.dp_shard_size",
     "= 3, but there are 4 processes"),
    (["parallel.tp_size=3", "launch.num_processes=4"], "parallel.tp_size", "does not divide 4 processes"),
    (["parallel.strategy=ddp", "parallel.tp_size=2", "launch.num_processes=4"], "parallel.tp_size", "DDP x TP"),
    (["parallel.strategy=ddp", "parallel.cp_size=2", "launch.num_processes=2"], "parallel.cp_size", "needs parallel.strategy=fsdp"),
    (["parallel.strategy=fsdp", "parallel.sp_size=2", "launch.num_processes=2"], "parallel.sp_size", "needs parallel.strategy=deepspeed"),
    (["parallel.strategy=deepspeed", "parallel.tp_size=2", "launch.num_processes=2"], "parallel.tp_size", "DeepSpeed takes only sp_size"),
    (["parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=1", "launch.num_processes=2"],
     "parallel.dp_replicate_size", "plain data parallel"),
    (["parallel.strategy=fsdp", "parallel.cp_size=2", "data.max_length=30", "launch.num_processes=2"], "data.max_length",
     "2 x cp_size = 4"),
    (["parallel.strategy=deepspeed", "parallel.sp_size=4", "data.max_length=30", "launch.num_processes=4"],
     "data.max_length", "does not divide by parallel.sp_size 4"),
    (["parallel.strategy=fsdp", "parallel.fsdp.version=1", "parallel.tp_size=2", "launch.num_processes=4"],
     "parallel.fsdp.version", "needs FSDP2"),
])
def test_each_rule_names_its_key_and_where_it_was_set(cli, key, text):
    rendered = problems_of(*cli)
    assert key in rendered and text in rendered, rendered
    assert "[cli " in rendered  # where the value came from


def test_every_layout_problem_at_once():
    rendered = problems_of("parallel.strategy=ddp", "parallel.cp_size=2", "parallel.sp_size=2", "launch.num_processes=4")
    assert "parallel.cp_size" in rendered and "parallel.sp_size" in rendered and "mutually exclusive" in rendered


def test_model_shape_rules_name_tp_and_sp():
    from transformers import GPT2Config, LlamaConfig

    cfg = cfg_of("parallel.strategy=ddp", "parallel.tp_size=4", "launch.num_processes=4")
    found = layout.model_problems(cfg, LlamaConfig(num_attention_heads=8, num_key_value_heads=2))
    assert [p.key for p in found] == ["parallel.tp_size"] and "2 KV heads" in found[0].message
    no_plan = layout.model_problems(cfg_of("parallel.tp_size=2", "launch.num_processes=2"), GPT2Config(n_head=4))
    assert no_plan[0].key == "parallel.tp_size" and "no tensor-parallel plan" in no_plan[0].message
    sp = cfg_of("parallel.strategy=deepspeed", "parallel.sp_size=4", "launch.num_processes=4")
    assert layout.model_problems(sp, LlamaConfig(num_attention_heads=6, hidden_size=384))[0].key == "parallel.sp_size"


ACCELERATE_ND = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
"""


def test_accelerate_yaml_parallelism_block_is_read_as_it_is(tmp_path):
    path = tmp_path / "nd.yaml"
    path.write_text(ACCELERATE_ND)
    resolved = resolve([path], env={})
    p = resolved.config.parallel
    assert (p.strategy, p.dp_replicate_size, p.dp_shard_size, p.tp_size, p.cp_size) == ("fsdp", 2, 2, 2, 1)
    assert str(resolved.origins["parallel.tp_size"]) == f"file {path}:12"
    assert str(resolved.origins["parallel.dp_replicate_size"]) == f"file {path}:10"
    # A size the block leaves out is Accelerate's 1, not "the rest of the world": 1 x 1 x 2 != 4,
    # which Accelerate refuses too.
    path.write_text(ACCELERATE_ND.replace("  parallelism_config_dp_shard_size: 2\n", "")
                    .replace("num_processes: 8", "num_processes: 4").replace("replicate_size: 2", "replicate_size: 1"))
    with pytest.raises(UserError) as error:
        resolve([path], env={})
    assert "parallel.dp_shard_size: dp_replicate 1 x dp_shard 1 x tp 2" in error.value.render()
    path.write_text(ACCELERATE_ND + "  parallelism_config_tp_sise: 2\n")
    with pytest.raises(UserError) as error:
        resolve([path], env={})
    assert "parallelism_config.parallelism_config_tp_sise" in error.value.render()
    assert "did you mean `parallelism_config_tp_size`" in error.value.render()


def test_the_variables_accelerate_reads():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2",
           "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_CP_BACKEND": "torch",
           "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    resolved = resolve([], cli=["launch.num_processes=4"], env=env)
    assert (resolved.config.parallel.dp_shard_size, resolved.config.parallel.tp_size) == (2, 2)
    assert str(resolved.origins["parallel.tp_size"]) == "env PARALLELISM_CONFIG_TP_SIZE"
    # Without the switch Accelerate ignores them, and so does overdrive (saying so).
    quiet = resolve([], env={"PARALLELISM_CONFIG_TP_SIZE": "2"})
    assert quiet.config.parallel.tp_size == 1
    assert any("ACCELERATE_USE_PARALLELISM_CONFIG" in w.message for w in quiet.warnings)


@pytest.mark.parametrize("cli", [
    ["parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.tp_size=2", "launch.num_processes=8"],
    ["parallel.strategy=fsdp", "parallel.cp_size=2", "parallel.cp_comm_strategy=alltoall", "launch.num_processes=4"],
    ["parallel.strategy=deepspeed", "parallel.sp_size=2", "launch.num_processes=4", "data.max_length=512"],
])
def test_export_writes_a_block_accelerate_launch_accepts_and_reads_back(cli, tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg = cfg_of(*cli)
    export.write(cfg, tmp_path / "acc.yaml")
    args = launch_command_parser().parse_args(["--config_file", str(tmp_path / "acc.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_parallelism_config
    env = prepare_multi_gpu_env(args)  # the variables its workers get
    lay = layout.layout(cfg)
    expected = layout.parallelism_kwargs(cfg)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert env["PARALLELISM_CONFIG_TP_SIZE"] == str(lay.tp) and env["PARALLELISM_CONFIG_CP_SIZE"] == str(lay.cp)
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == str(expected["dp_shard_size"])
    if lay.cp > 1:
        assert env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] == "alltoall"
    back = resolve([tmp_path / "acc.yaml"], env={}).config
    assert layout.layout(back) == layout.layout(cfg)
    assert back.parallel.cp_comm_strategy == cfg.parallel.cp_comm_strategy


def test_gpu_only_axes_hand_accelerate_their_parallelism_config():
    """CP and SP do not run on CPU: on GPUs (described, not faked) this is what Accelerate gets."""
    cfg = cfg_of("parallel.strategy=fsdp", "parallel.cp_size=2", "launch.num_processes=16",
                 "launch.num_machines=2", "launch.main_process_ip=10.0.0.1", "precision.mixed_precision=bf16")
    pc = accelerator_kwargs(cfg, 16, gpus=8)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.cp_size, pc.tp_size) == (1, 8, 2, 1)
    assert pc.cp_handler.cp_comm_strategy == "allgather" and pc.cp_backend == "torch"
    assert pc._get_mesh() == (("dp_shard", "cp"), (8, 2))
    sp = cfg_of("parallel.strategy=deepspeed", "parallel.sp_size=4", "launch.num_processes=8",
                "data.max_length=4096", "parallel.sp_attn_implementation=flash_attention_2")
    pc = accelerator_kwargs(sp, 8, gpus=8)["parallelism_config"]
    assert (pc.sp_size, pc.sp_backend, pc.dp_shard_size, pc.data_parallel_size) == (4, "deepspeed", 2, 2)
    assert pc.sp_handler.sp_seq_length == 4096 and pc.sp_handler.sp_attn_implementation == "flash_attention_2"
    # On CPU processes: refused by key before anything starts, and no ParallelismConfig is passed.
    assert [p.key for p in cpu.problems(cfg, gpus=0)] == ["parallel.cp_size"]
    assert "parallelism_config" not in accelerator_kwargs(cfg_of("parallel.tp_size=2", "launch.num_processes=2",
                                                                 "launch.use_cpu=true"), 2)


@pytest.mark.slow
def test_slurm_writes_a_context_parallel_job_and_cpu_refuses_it(tmp_path):
    job = ["configs/fsdp.yaml", *LLAMA, "parallel.cp_size=2", "launch.num_machines=2", "launch.num_processes=16",
           "launch.gpus_per_machine=8", "launch.main_process_ip=10.0.0.1", "precision.mixed_precision=bf16",
           "data.max_length=1024"]
    from conftest import REPO

    done = run_cli("slurm", *job, "-o", str(tmp_path / "cp.sbatch"), cwd=REPO)
    assert done.returncode == 0, done.stderr
    script = (tmp_path / "cp.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and '"cp_size": 2' in script
    here = run_cli("train", "configs/fsdp.yaml", *LLAMA, "parallel.cp_size=2", "launch.num_processes=2",
                   "launch.use_cpu=true", "data.max_length=64", f"output_dir={tmp_path / 'out'}", cwd=REPO)
    assert here.returncode == 2 and "parallel.cp_size" in here.stderr and "Traceback" not in here.stderr


LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
             "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "num_hidden_layers": 80, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "vocab_size": 32000,
             "tie_word_embeddings": False}


def test_tensor_parallel_divides_the_model_states_as_the_published_formula():
    """ZeRO paper sec. 3.1 with Megatron's TP in front: 16 * Psi / (tp x shard ranks) per device
    for mixed-precision Adam, when the plan splits every matrix (as Llama's does)."""
    from overdrive.memory import Setup, estimate
    from overdrive.memory.shape import ModelShape

    h, f, v, layers = 64, 128, 256, 2
    block = [(3 * h, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]  # qkv, o, gate, up, down, norms
    shapes = tuple(block * layers + [(v, h), (h,), (v, h)])
    splits = tuple([0, 1, 0, 0, 1, -1, -1] * layers + [0, -1, 0])
    shape = ModelShape(name="toy", model_type="llama", params=sum(a * (b[0] if b else 1) for a, *b in shapes),
                       param_shapes=shapes, layers=layers, hidden=h, heads=4, kv_heads=4, intermediate=f, vocab=v,
                       block_params=sum(a * (b[0] if b else 1) for a, *b in block), root_params=2 * v * h + h,
                       largest_module_params=v * h, autocast_params=0, mlp="gated", norm="rmsnorm",
                       tp_split=splits, block_tp_split_params=sum(a * b[0] for a, *b in block if b))
    whole = estimate(shape, Setup(devices=8, precision="bf16", seq_len=64), ("fsdp2",)).rows[0]
    tp = estimate(shape, Setup(devices=8, precision="bf16", seq_len=64, tp=2), ("fsdp2",)).rows[0]
    states = lambda row: row.params_bytes + row.grads_bytes + row.optimizer_bytes  # noqa: E731
    norms = 2 * layers * h + h  # kept whole on every tp rank
    assert states(whole) == 16 * shape.params / 8
    assert states(tp) == 16 * ((shape.params - norms) / 2 + norms) / 4
    assert tp.activations_full_bytes < whole.activations_full_bytes
    hsdp = estimate(shape, Setup(devices=8, precision="bf16", seq_len=64, dp_replicate=2), ("fsdp2",)).rows[0]
    assert states(hsdp) == 16 * shape.params / 4  # replicas hold copies: sharded over 4
    cp = estimate(shape, Setup(devices=8, precision="bf16", seq_len=64, cp=2), ("fsdp2",)).rows[0]
    assert states(cp) == states(whole) and cp.activations_full_bytes < whole.activations_full_bytes


@pytest.mark.slow
def test_estimate_70b_on_64_gpus_tp8_by_dp_shard8(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    done = run_cli("estimate", str(path), "--devices", "64", "--tp", "8", "--seq-len", "4096", "--gpu-memory", "80",
                   "--strategies", "fsdp2", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    row, psi = data["rows"][0], data["parameters"]
    assert data["layout"] == {"dp_replicate": 1, "tp": 8, "cp": 1, "sp": 1, "shard_ranks": 8}
    published = 16 * psi / 64  # ZeRO paper's mixed-precision Adam, split 8 x 8
    assert abs(row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"] - published) / published < 1e-3
    # Korthikanti et al. eq. 2 with tensor parallel, flash attention (no s x s term): s*b*h*(10 + 24/t) per layer.
    s, h, t = 4096, 8192, 8
    korthikanti = s * h * (10 + 24 / t) * 80
    layers = next(term["bytes"] for term in row["terms"] if "layers' saved tensors" in term["what"])
    assert 1.0 < layers / korthikanti < 2.0  # SwiGLU and fp32 RMSNorm inputs keep more than GPT's GeLU/LayerNorm


def test_launch_flags_carry_the_layout_accelerate_launch_accepts():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg = cfg_of("parallel.strategy=fsdp", "parallel.tp_size=2", "launch.num_processes=4")
    flags = export.accelerate_flags(cfg)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*flags, "train.py"]))
    env = prepare_multi_gpu_env(args)
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_TP_SIZE"]) == ("2", "2")
    # DDP x TP: Accelerate's launcher takes the block from a YAML only, so no flags for it.
    assert "--use_parallelism_config" not in export.accelerate_flags(cfg_of("parallel.tp_size=2", "launch.num_processes=2"))


def test_the_wizard_asks_for_the_layout_under_fsdp(tmp_path):
    from overdrive.wizard import files as wizard_files
    from overdrive.wizard import questions as wizard

    ask = wizard.Asker(preset={"machine_type": "gpu", "num_processes": "8", "mixed_precision": "bf16",
                               "strategy": "fsdp", "tp_size": "2", "dp_replicate_size": "2"}, interactive=False)
    a = wizard.ask_all(ask, {})
    run = wizard_files.run_config(a)
    assert run["parallel"]["tp_size"] == 2 and run["parallel"]["dp_replicate_size"] == 2
    bad = wizard.Asker(preset={"num_processes": "8", "strategy": "fsdp", "tp_size": "3"}, interactive=False)
    with pytest.raises(UserError) as error:
        wizard.ask_all(bad, {})
    assert "--tp-size" in error.value.render() and "does not divide 8" in error.value.render()


def test_resume_routes_between_layouts():
    from overdrive.checkpoint import fingerprint as fp

    dump = cfg_of  # a checkpoint's config is compared as a RunConfig (read back: config/stored.py)
    tp2 = dump("parallel.tp_size=2", "launch.num_processes=2", "training.micro_batch_size=8")
    one = dump("launch.num_processes=1", "training.micro_batch_size=8")
    to_one = fp.compare(tp2, one)
    assert to_one.route.how == "dcp" and not to_one.refusal and to_one.accumulation is None  # same global batch
    assert [c.kind for c in to_one.changes if c.key == "parallel.tp_size"] == ["harmless"]
    into_tp = fp.compare(one, tp2)
    assert into_tp.route.how == "refused" and "Possible moves" in into_tp.refusal
    assert [c.key for c in into_tp.of("layout")] == ["parallel.tp_size"]  # the refusal names it
    hsdp = dump("parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=2",
                "launch.num_processes=4", "training.micro_batch_size=2")
    fsdp4 = dump("parallel.strategy=fsdp", "launch.num_processes=4", "training.micro_batch_size=2")
    moved = fp.compare(hsdp, fsdp4)
    assert moved.route.how == "dcp" and not moved.refusal and not moved.of("layout")


def test_sequence_parallel_is_refused_for_overdrives_own_loop():
    sp = cfg_of("parallel.strategy=deepspeed", "parallel.sp_size=2", "launch.num_processes=2")
    found = layout.loop_problems(sp)
    assert [p.key for p in found] == ["parallel.sp_size"] and "overdrive launch" in found[0].fix
    assert layout.loop_problems(cfg_of("parallel.strategy=ddp", "parallel.tp_size=2", "launch.num_processes=2")) == []
