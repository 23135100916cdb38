"""Vision-language fine-tuning (docs/vision.md): tiny Qwen2-VL and LLaVA models built from their
Transformers configs, coloured images whose answer is the colour.

Quick: the processor steps done without Qwen2-VL's processor class equal its own `__call__`; the
assistant-only labels with image tokens never in the loss; the three layouts give one encoding; a
row whose images and placeholders differ is refused by key with its row; what does not compose is
refused by key before anything launches; the vision tower and projector frozen, LoRA on the
language model. Slow: SFT in one process (the loss falls, the saved model and processor reload). The sharded layouts:
tests/test_vlm_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vlm_fixtures import (answer_accuracy, make_tiny_llava, make_tiny_qwen2_vl, make_tiny_qwen3_vl, make_vision_data,
                          processor_class_of)

from overdrive.errors import UserError


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm")
    make_tiny_qwen2_vl(root / "qwen")
    make_tiny_qwen3_vl(root / "qwen3")
    make_tiny_llava(root / "llava")
    for layout in ("messages", "sharegpt", "alpaca"):
        make_vision_data(root, rows=24, layout=layout)
    return root


def settled(work: Path, *items: str):
    from overdrive.resolving.resolve import resolve
    from overdrive.training.build import user_inputs

    return resolve([], cli=[f"model.name_or_path={work / 'qwen'}", f"data.source={work / 'messages.jsonl'}",
                            "data.format=chat", "data.max_length=64", "launch.use_cpu=true", *items],
                   env={}, accelerate_default=False, checks=user_inputs.check).config


def processor_for(work: Path, name: str):
    from overdrive.hf.vision_processor import load

    return load(settled(work, f"model.name_or_path={work / name}"), FAMILY[name])


FAMILY = {"qwen": "qwen2_vl", "qwen3": "qwen3_vl", "llava": "llava"}


@pytest.mark.parametrize("name", ["qwen", "qwen3"])
def test_qwen_processor_steps_equal_the_processors_own_call(work, name):
    """OwnQwenProcessor against Qwen2VLProcessor.__call__ and Qwen3VLProcessor.__call__ (AutoProcessor where
    torchvision exists; here its class built without the video processor it cannot build), and the model's own
    3-D rope positions."""
    import transformers
    from PIL import Image

    own, theirs = processor_for(work, name), processor_class_of(work / name)
    images = [Image.open(work / "images" / f"{i}.png").convert("RGB").resize((56 + 28 * i, 84)) for i in range(2)]
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}, {"type": "image"}]},
             {"role": "assistant", "content": "red"}]
    text = own.render(turns)
    mine, expected = own.encode(text, images), theirs(text=[text], images=images, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(mine[key], expected[key]), key
    model = transformers.AutoModelForImageTextToText.from_pretrained(work / name)
    rope = model.model.get_rope_index(mine["input_ids"], mine["mm_token_type_ids"], mine["image_grid_thw"])[0]
    assert torch.equal(rope, model.model.get_rope_index(expected["input_ids"], expected["mm_token_type_ids"],
                                                        expected["image_grid_thw"])[0])
    assert rope.shape[0] == 3 and not torch.equal(rope[1], rope[2])  # 3-D: height and width differ on image tokens


@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_only_the_answer_is_in_the_loss_and_image_tokens_never(work, name):
    from PIL import Image

    from overdrive.data.vision_samples import IGNORE, encode

    processor = processor_for(work, name)
    image = Image.open(work / "images" / "0.png").convert("RGB")
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "the answer is red"}]}]
    row = encode(processor, turns, [image], "row 1", 64)
    answer = row["input_ids"][row["labels"] != IGNORE]
    assert processor.tokenizer.convert_ids_to_tokens(answer.tolist()) == ["the", "answer", "is", "red", "<|im_end|>"]
    everything = encode(processor, turns, [image], "row 1", 64, train_on_prompt=True)
    image_tokens = torch.isin(everything["input_ids"], torch.tensor(processor.image_token_ids))
    assert image_tokens.sum() >= 4 and (everything["labels"][image_tokens] == IGNORE).all()
    assert (everything["labels"][~image_tokens] != IGNORE).all()
    with pytest.raises(UserError) as refused:  # never cut inside an image
        encode(processor, turns, [image], "row 1", 5)
    assert refused.value.problems[0].key == "data.max_length"


def test_trl_and_llama_factory_layouts_give_one_encoding(work):
    from overdrive.data.vision_samples import prepare

    processor = processor_for(work, "qwen")
    encoded = {layout: prepare(settled(work, f"data.source={work / (layout + '.jsonl')}",
                                       "data.validation_fraction=0"), processor).train
               for layout in ("messages", "sharegpt", "alpaca")}
    for layout in ("sharegpt", "alpaca"):
        for a, b in zip(encoded["messages"].rows, encoded[layout].rows):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), layout


def test_images_and_placeholders_that_differ_are_refused_by_key_with_the_row(work):
    rows = [json.loads(line) for line in (work / "sharegpt.jsonl").read_text().splitlines()]
    rows[2]["images"] = rows[2]["images"] * 2
    rows[4]["images"] = ["images/missing.png"]
    (work / "images" / "notes.png").write_text("not an image")  # found before launch, not mid-encoding
    rows[6]["images"] = ["images/notes.png"]
    bad = work / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as refused:
        settled(work, f"data.source={bad}")
    found = {(p.key, p.where) for p in refused.value.problems}
    assert {("data.images_column", f"{bad}:{line}") for line in (3, 5, 7)} <= found
    assert "does not open as an image" in refused.value.render()


def test_eval_prompts_with_images_are_read_from_their_files_directory_and_a_missing_one_refused(work):
    from overdrive.hf.generation import read_prompt_rows

    asked = work / "asked.jsonl"
    asked.write_text(json.dumps({"prompt": "what colour is it", "images": ["images/0.png"]}) + "\n"
                     + json.dumps({"prompt": "and this", "images": ["images/missing.png"]}) + "\n")
    rows = read_prompt_rows(str(asked))
    assert rows[0].images == (str(work / "images" / "0.png"),) and rows[1].place == f"{asked}:2"
    with pytest.raises(UserError) as refused:
        settled(work, f"eval.prompts={asked}")
    assert {(p.key, "missing.png" in p.message and f"{asked}:2" in p.message) for p in refused.value.problems} == {
        ("eval.prompts", True)}
    (work / "images" / "blank.png").write_bytes(b"")  # there, but no image: refused now, not at the first evaluation
    asked.write_text(json.dumps({"prompt": "and this", "images": ["images/blank.png"]}) + "\n")
    with pytest.raises(UserError) as refused:
        settled(work, f"eval.prompts={asked}")
    assert [(p.key, "does not open as an image" in p.message) for p in refused.value.problems] == [
        ("eval.prompts", True)]


@pytest.mark.parametrize("item,key", [
    ("preference.method=kto", "preference.method"), ("preference.precompute_reference=true",
                                                       "preference.precompute_reference"),
    ("parallel.tp_size=2", "parallel.tp_size"), ("parallel.pp_size=2", "parallel.pp_size"),
    ("training.loss_kernel=chunked", "training.loss_kernel"), ("compile.backend=inductor", "compile.backend"),
    ("training.activation_offloading=true", "training.activation_offloading"),
    ("checkpoint.async=true", "checkpoint.async"), ("eval.tasks=[hellaswag]", "eval.tasks"),
    ("data.format=text", "data.format")])
def test_what_does_not_compose_with_a_vlm_is_refused_by_key_before_anything_launches(item, key):
    from overdrive.resolving.resolve import resolve

    extra = {"preference.method=kto": ["data.format=preference"],
             "preference.precompute_reference=true": ["data.format=preference", "preference.method=dpo"],
             "parallel.tp_size=2": ["launch.num_processes=2"], "parallel.pp_size=2": ["launch.num_processes=2"]}
    with pytest.raises(UserError) as refused:
        resolve([], cli=["model.name_or_path=org/some-vlm", "model.vision.enabled=true", "data.format=chat", item,
                         *extra.get(item, [])], env={}, accelerate_default=False)
    assert key in {p.key for p in refused.value.problems}


def test_the_vision_tower_and_projector_are_frozen_and_lora_targets_the_language_model(work):
    from overdrive.training.build.model import build_model

    plain = build_model(settled(work, "model.vision.freeze=true"))
    trained = {n for n, p in plain.named_parameters() if p.requires_grad}
    assert trained and all(".visual." not in n for n in trained)
    both = build_model(settled(work, "model.vision.freeze=false", "model.vision.train_projector=true"))
    assert all(p.requires_grad for p in both.parameters())
    lora = build_model(settled(work, "peft.method=lora", "peft.r=4"))
    adapted = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert adapted and all("lora_" in n and "language_model" in n for n in adapted)
    projector = build_model(settled(work, "peft.method=lora", "peft.r=4", "model.vision.train_projector=true"))
    adapted = {n for n, p in projector.named_parameters() if p.requires_grad}
    assert any(".merger." in n for n in adapted) and not any(".blocks." in n for n in adapted)


def test_qwen3_vl_s_image_tokens_are_read_from_its_16_pixel_patches(work):
    """The estimate's image tokens: a 64x64 image (max_pixels) in 16-pixel patches is 16 patches, merged 2x2 into 4
    tokens: what the processor gives the tiny Qwen3-VL's rows."""
    from transformers import AutoConfig

    from overdrive.hf.vision_sizes import image_tokens

    tokens, patches, basis = image_tokens(AutoConfig.from_pretrained(work / "qwen3"), str(work / "qwen3"))
    assert (tokens, patches) == (4, 16) and "16-pixel patches" in basis


def test_qwen3_vl_s_projector_is_its_merger_and_deepstack_mergers_and_its_tower_stays_frozen(work):
    """Qwen3-VL's `visual` holds its blocks, its merger and `deepstack_merger_list` (mergers of earlier blocks'
    features, added to the language model's first layers): the mergers are the projector."""
    from overdrive.training.build.model import build_model

    projector = build_model(settled(work, f"model.name_or_path={work / 'qwen3'}", "peft.method=lora", "peft.r=4",
                                    "model.vision.train_projector=true"))
    adapted = {n for n, p in projector.named_parameters() if p.requires_grad}
    assert any(".visual.merger." in n for n in adapted) and any(".visual.deepstack_merger_list." in n for n in adapted)
    assert not any(".visual.blocks." in n or "patch_embed" in n or "pos_embed" in n for n in adapted)
    assert any("lora_" in n and "language_model" in n for n in adapted)


RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0", "peft.method=lora", "peft.r=8",
       "peft.alpha=16", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
       "training.log_every_steps=1", "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]",
       "logging.progress=false", "checkpoint.enabled=false"]


def train(work: Path, out: str, *extra: str):
    import sys

    from checkpoint_probe import run

    done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'qwen'}",
                f"data.source={work / 'messages.jsonl'}", f"data.cache_dir={work / 'cache'}", *RUN,
                f"output_dir={work / out}", *extra], cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_sft_in_one_process_learns_the_colour_and_saves_what_from_pretrained_reloads(work):
    """SFT of the language model of a tiny Qwen2-VL (its vision tower and projector frozen): the loss falls and the
    greedy answer about 30 held-out images names their colour far above chance (1 in 3); the vision tower is
    unchanged byte for byte, and changes when `model.vision.freeze=false`; the model and the processor's files reload; `overdrive generate --image` answers about an image (a missing
    one refused by --image). The adapter's save and reload: tests/test_vlm_layouts.py."""
    import sys

    import transformers
    from checkpoint_probe import losses, run

    done = train(work, "one", "training.max_steps=30", "training.micro_batch_size=4", "peft.method=none")
    assert "vision-language model (Qwen2VLForConditionalGeneration)" in done.stdout
    curve = losses(work / "one")
    assert curve[30] < 0.6 * curve[1], curve
    held_out = make_vision_data(work / "held-out", rows=30, layout="messages", seed=1)  # other images, never trained on
    untrained, trained = answer_accuracy(work / "qwen", held_out), answer_accuracy(work / "one", held_out)
    print(f"held-out accuracy: {untrained:.3f} before, {trained:.3f} after 30 steps")
    assert untrained <= 0.5 and trained >= 0.9, (untrained, trained)
    saved = work / "one" / "model"
    model = transformers.AutoModelForImageTextToText.from_pretrained(saved)
    base = transformers.AutoModelForImageTextToText.from_pretrained(work / "qwen")
    before, after = base.state_dict(), model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if ".visual." in k)  # frozen: unchanged
    assert not all(torch.equal(before[k], after[k]) for k in before if "language_model" in k)
    train(work, "unfrozen", "training.max_steps=2", "training.micro_batch_size=4", "peft.method=none",
          "model.vision.freeze=false")
    moved = transformers.AutoModelForImageTextToText.from_pretrained(work / "unfrozen" / "model").state_dict()
    assert not all(torch.equal(before[k], moved[k]) for k in before if ".visual.blocks." in k)
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved)
    image_processor = transformers.AutoImageProcessor.from_pretrained(saved)
    assert tokenizer.chat_template and image_processor.merge_size == 2
    asked = run([sys.executable, "-m", "overdrive.cli", "generate", str(work / "one"), "what colour is it", "--image",
                 str(work / "images" / "0.png"), "--json", "--max-new-tokens", "6"], cwd=work, timeout=300)
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert json.loads(asked.stdout.strip().splitlines()[-1])["answer"].startswith("the answer is"), asked.stdout
    refused = run([sys.executable, "-m", "overdrive.cli", "generate", str(work / "one"), "what", "--image",
                   str(work / "images" / "missing.png")], cwd=work, timeout=300)
    assert refused.returncode == 2 and "--image" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_qlora_quantizes_the_language_model_and_leaves_the_tower_and_projector_as_they_were(work, name):
    """bitsandbytes' CPU backend: 4-bit layers in the language model only; the tower and projector keep their weights
    byte for byte (Transformers 5 matches a skipped module's name from the start of its path: `model.visual...`)."""
    import bitsandbytes
    import transformers

    from overdrive.hf.vision import part_of
    from overdrive.training.build.model import build_model

    model = build_model(settled(work, f"model.name_or_path={work / name}", "peft.method=qlora", "peft.r=4"))
    quantized = {n.replace("base_model.model.", "", 1) for n, m in model.named_modules()
                 if isinstance(m, bitsandbytes.nn.Linear4bit)}
    assert quantized and {part_of(n) for n in quantized} == {"language"}, sorted(quantized)[:5]
    base = transformers.AutoModelForImageTextToText.from_pretrained(work / name).state_dict()
    kept = {n.replace("base_model.model.", "", 1).replace(".base_layer", ""): p
            for n, p in model.named_parameters() if part_of(n.replace("base_model.model.", "", 1)) != "language"}
    assert kept and all(torch.equal(base[n], p) for n, p in kept.items())
