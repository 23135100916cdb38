"""Pipeline parallel (parallel.pp_size, pp_schedule, pp_microbatches, pp_stages_per_rank): the
layout's data-parallel degree, the rules by key, the stages cut from a model giving its own
logits, the memory per stage `plan` reports, and Megatron-LM's block of an Accelerate YAML
read onto the layout. The runs themselves: tests/test_pipeline_multiprocess.py."""

from __future__ import annotations

import json

import pytest
from conftest import cfg_of as shared_cfg_of
from conftest import problems_of, run_here

from overdrive.config import batch
from overdrive.resolving import resolve
from overdrive.errors import UserError
from overdrive.strategies import layout, pipeline

PP = ["checkpoint.enabled=false"]


def cfg_of(*cli: str):
    return shared_cfg_of(*[*PP, *cli])


def test_the_data_parallel_degree_is_the_world_over_the_pipeline_too():
    cfg = cfg_of("parallel.pp_size=2", "launch.num_processes=8", "training.gradient_accumulation_steps=2")
    lay = layout.layout(cfg)
    assert (lay.pp, lay.dp_replicate, lay.world) == (2, 4, 8) and lay.mesh == (("pp", 2), ("dp_replicate", 4))
    assert batch.data_parallel_degree(cfg) == 4 and not lay.is_nd  # Accelerate's ParallelismConfig is not needed
    assert "8 / (pp 2 x tp 1 x cp 1 x sp 1) = 4" in layout.summary(cfg)["text"]
    # Empty pp_microbatches: the step's micro-batches when there are pp_size of them, else one sample each.
    assert pipeline.microbatches(cfg) == 2
    assert pipeline.microbatches(cfg_of("parallel.pp_size=2", "launch.num_processes=2",
                                        "training.micro_batch_size=4")) == 4


@pytest.mark.parametrize("cli, key, text", [
    (["parallel.pp_size=3", "launch.num_processes=4"], "parallel.pp_size", "does not divide 4 processes"),
    (["parallel.pp_size=2", "parallel.pp_microbatches=1", "launch.num_processes=2"], "parallel.pp_microbatches",
     "at least as many microbatches as stages"),
    (["parallel.pp_size=2", "parallel.pp_microbatches=3", "launch.num_processes=2", "training.micro_batch_size=4"],
     "parallel.pp_microbatches", "do not split into 3 microbatches"),
    (["parallel.pp_size=2", "parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2", "launch.num_processes=2"],
     "parallel.pp_stages_per_rank", "gpipe runs one stage per rank"),
    (["parallel.pp_size=2", "parallel.pp_schedule=zbv_zero_bubble", "parallel.pp_stages_per_rank=3",
      "launch.num_processes=2"], "parallel.pp_stages_per_rank", "exactly 2 stages per rank"),
    (["parallel.pp_size=2", "parallel.strategy=deepspeed", "launch.num_processes=4"], "parallel.strategy",
     "which a stage does not hold"),
    (["parallel.pp_size=2", "parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=2",
      "launch.num_processes=8"], "parallel.dp_replicate_size", "HSDP beside stages"),
    (["parallel.pp_size=2", "launch.num_processes=2", "precision.mixed_precision=fp16"], "precision.mixed_precision",
     "loss scaler"),
])
def test_each_pipeline_rule_names_its_key(cli, key, text):
    rendered = problems_of(*cli)
    assert key in rendered and text in rendered, rendered


def test_a_split_that_leaves_a_stage_empty_or_does_not_divide_lists_the_ones_that_work():
    from transformers import GPT2Config, LlamaConfig

    four = LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False)
    uneven = cfg_of("parallel.pp_size=3", "launch.num_processes=6", "training.gradient_accumulation_steps=3")
    found = layout.model_problems(uneven, four)
    assert [p.key for p in found] == ["parallel.pp_size"]
    assert "4 decoder layers do not split evenly into 3 stages" in found[0].message
    assert "pp_size=2" in found[0].fix and "pp_size=2 x 2 stages per rank" in found[0].fix
    empty = cfg_of("parallel.pp_size=4", "parallel.pp_schedule=interleaved_1f1b", "launch.num_processes=4",
                   "training.gradient_accumulation_steps=4")
    assert "a stage would be empty" in layout.model_problems(empty, four)[0].message  # 8 stages, 4 layers
    tied = layout.model_problems(cfg_of("parallel.pp_size=2", "launch.num_processes=2",
                                        "training.gradient_accumulation_steps=2"), GPT2Config(n_layer=4))
    assert "ties its embedding" in tied[0].message


def test_stages_cut_from_a_model_give_its_own_logits():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from overdrive.training.step.pipeline_stage import cut

    torch.manual_seed(0)
    models = [LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, vocab_size=64,
                                           num_attention_heads=4, num_key_value_heads=2)),
              GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=64, tie_word_embeddings=False,
                                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0))]
    ids = torch.randint(0, 64, (2, 12))
    for model in models:
        model.eval()
        whole, names = model(ids).logits, set(model.state_dict())
        stages = cut(model, pipeline.layer_split(4, 2), [0, 1])
        hidden = ids
        for stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, whole)
        # The stages' weights under the whole model's names, every one once.
        assert set(stages[0].model_state_dict()) | set(stages[1].model_state_dict()) == names


def test_bubble_fraction_of_the_schedules():
    assert pipeline.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert pipeline.bubble_fraction(4, 8, per_rank=2) == pytest.approx(3 / 19)
    assert pipeline.bubble_fraction(1, 8) == 0


def test_plan_json_reports_memory_per_stage():
    done = run_here("plan", "model.architecture.model_type=llama", "model.architecture.num_hidden_layers=4",
                   "model.architecture.tie_word_embeddings=false", "parallel.pp_size=2", "launch.num_processes=2",
                   "training.gradient_accumulation_steps=4", "checkpoint.enabled=false", "--json")
    assert done.returncode == 0, done.stderr
    stages = json.loads(done.stdout)["pipeline"]
    assert stages["bubble_fraction"] == pytest.approx(1 / 5) and stages["schedule"] == "1f1b"
    first, last = stages["ranks"]
    assert [first["stages"], last["stages"]] == [[0], [1]]
    # 1F1B: the first stage keeps pp_size microbatches in flight, the last one.
    assert (first["microbatches_in_flight"], last["microbatches_in_flight"]) == (2, 1)
    assert first["model_state_bytes"] > 0 and last["activations_bytes"] > 0


MEGATRON = """\
compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
megatron_lm_config:
  megatron_lm_gradient_clipping: 0.5
  megatron_lm_num_micro_batches: 4
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: false
  megatron_lm_sequence_parallelism: false
  megatron_lm_tp_degree: 2
  megatron_lm_use_distributed_optimizer: false
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""


def test_megatron_lm_yaml_is_read_onto_tp_and_pp_with_its_file_in_the_origin(tmp_path):
    path = tmp_path / "megatron.yaml"
    path.write_text(MEGATRON)
    resolved = resolve([path], cli=PP + ["model.architecture.model_type=llama"], env={})
    p = resolved.config.parallel
    assert (p.strategy, p.tp_size, p.pp_size, p.pp_microbatches) == ("ddp", 2, 2, 4)
    assert resolved.config.training.gradient_clipping == 0.5
    assert str(resolved.origins["parallel.tp_size"]) == f"file {path}:9"
    assert str(resolved.origins["parallel.pp_size"]) == f"file {path}:6"
    # What Megatron does that has no counterpart here is refused by its own key.
    path.write_text(MEGATRON.replace("sequence_parallelism: false", "sequence_parallelism: true"))
    with pytest.raises(UserError) as error:
        resolve([path], cli=PP, env={})
    assert "megatron_lm_config.megatron_lm_sequence_parallelism" in error.value.render()


def test_export_writes_the_megatron_block_back_as_accelerate_reads_it(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from overdrive.interop import writing as export

    cfg = cfg_of("parallel.pp_size=2", "parallel.tp_size=2", "launch.num_processes=8",
                 "training.gradient_accumulation_steps=4", "model.architecture.model_type=llama")
    export.write(cfg, tmp_path / "acc.yaml")
    args = launch_command_parser().parse_args(["--config_file", str(tmp_path / "acc.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_megatron_lm and (args.megatron_lm_tp_degree, args.megatron_lm_pp_degree) == (2, 2)
    back = resolve([tmp_path / "acc.yaml"], cli=PP + ["model.architecture.model_type=llama"], env={}).config.parallel
    assert (back.tp_size, back.pp_size, back.pp_microbatches) == (2, 2, 4)


def test_every_megatron_key_accelerate_launches_with_is_read_or_refused_by_name():
    """Accelerate's own launcher arguments (`--megatron_lm_*`) are the names a YAML may carry."""
    from accelerate.commands.launch import launch_command_parser

    from overdrive.interop import megatron_reading as m

    names = {a.dest for a in launch_command_parser()._actions if a.dest.startswith("megatron_lm_")}
    known = set(m.MEGATRON_KEYS) | set(m.MEGATRON_REFUSED) | set(m.MEGATRON_AS_IS)
    assert names and names <= known, names - known
