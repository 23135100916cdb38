"""A tiny causal LM and a text data set, made on the spot (no hub access): what the Trainer
and TRL examples train in the tests."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

WORDS = "the a model trains on text data every step one two three four loss goes down slowly".split()


def make_text_data(path: Path, rows: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))}) + "\n")
    return path


def make_tiny_model(directory: Path) -> Path:
    """A 2-layer GPT-2 (hidden size 32) and a word-level tokenizer, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", bos_token="<eos>")
    import torch

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(vocab), n_positions=64,
                                       pad_token_id=0, eos_token_id=2, bos_token_id=2))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# A chat template without {% generation %} marks (the assistant's tokens are found prefix by
# prefix), and one with them (Transformers returns the assistant mask itself).
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")
CHAT_TEMPLATE_GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> {% generation %}"
                            "{{ m['content'] }} <eos> {% endgeneration %}{% else %}<{{ m['role'] }}> "
                            "{{ m['content'] }} <eos> {% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant> {% endif %}")
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
CHAT_WORDS = ["<system>", "<user>", "<assistant>", *LETTERS, "ok", "the", "answer", "is", "yes"]


def make_tiny_llama(directory: Path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0,
                    hidden_size: int = 32) -> Path:
    """A 2-layer Llama (hidden size 32 unless said) from LlamaConfig and a word-level tokenizer with a chat
    template (or none), saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(CHAT_WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", bos_token="<eos>")
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(vocab),
                                         max_position_embeddings=128, pad_token_id=0, eos_token_id=2,
                                         bos_token_id=2, tie_word_embeddings=False))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE (hidden size 32, 4 experts of width 16, top-2) with make_tiny_llama's word-level
    tokenizer, saved with save_pretrained."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    make_tiny_llama(directory, chat_template=None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    for stale in [*directory.glob("model*.safetensors"), directory / "config.json"]:
        stale.unlink()
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                       max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
                                       bos_token_id=2)).save_pretrained(directory)
    return directory


def make_chat_data(path: Path, rows: int = 64, seed: int = 0, answer: str = "the answer is yes",
                   prompt_letters: int = 12) -> Path:
    """Conversations whose prompts are random letters and whose answer is always the same."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(LETTERS) for _ in range(prompt_letters))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def make_preference_data(path: Path, rows: int = 64, seed: int = 0, prompt_letters: int = 6,
                         layout: str = "conversational") -> Path:
    """Pairs whose chosen answer is right (the prompt's first letter) and whose rejected one is
    constant: TRL's conversational layout (prompt, chosen, rejected as turns), or its standard one (text)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            letters = [rng.choice(LETTERS) for _ in range(prompt_letters)]
            prompt, chosen, rejected = " ".join(letters), f"the answer is {letters[0]}", "the answer is yes"
            if layout == "conversational":
                row = {"prompt": [{"role": "user", "content": prompt}],
                       "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]}
            else:
                row = {"prompt": prompt + " ", "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(row) + "\n")
    return path


def tree_hash(directory: Path) -> dict[str, str]:
    """Each file under `directory` by its sha256: what "left byte for byte" is checked against."""
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def write_letter_chat(path: Path, rows: int, seed: int = 0) -> Path:
    """A chat JSONL of `rows` conversations, a question and an answer of random letters each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            question = " ".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 6)))
            answer = " ".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 5)))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def make_student_and_teacher(root: Path) -> Path:
    """A small student and a wider teacher of the same tokenizer (`root/student`, `root/teacher`): the
    distillation tests' pair."""
    make_tiny_llama(root / "student", seed=0, hidden_size=32)
    make_tiny_llama(root / "teacher", seed=1, hidden_size=64)
    return root


class OneProcessAccelerator:
    """What the objectives and the sampler ask of an Accelerator, on one CPU process (no wrapping)."""

    is_main_process, process_index, num_processes = True, 0, 1

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    def unwrap_model(self, model):
        return model
