"""`overdrive generate RUN_OR_MODEL [PROMPT]`: a finished run's model (`runs/x` means
`runs/x/model`), a saved model or an adapter on its base answers PROMPT through its chat
template, the tokens printed as they come. Without PROMPT on a terminal: one prompt after
another until an empty line or end of input; without PROMPT and with input piped in
(`echo hi | overdrive generate runs/x`), that input is the prompt. Temperature 0 (the default) is greedy decoding.
A vision-language model (or an adapter on one) answers about the images given with `--image`, through its processor
and chat template (hf/vision_generate.py)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="RUN_OR_MODEL",
                        help="a run's output_dir, a save_pretrained directory, an adapter directory, or a hub name")
    parser.add_argument("prompt", metavar="PROMPT", nargs="?",
                        help="what to answer (default: the input piped in, or ask on the terminal)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy, the most likely token each step (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default: 1)")
    parser.add_argument("--seed", type=int, help="seed of the sampling, for answers that repeat")
    parser.add_argument("--device", help="where the model runs (default: cuda when there is one, else cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32",
                        help="dtype the model is loaded in (default: float32)")
    parser.add_argument("--base", metavar="MODEL", help="an adapter's base model (default: its adapter_config.json's)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image the question is about (a vision-language model; repeat for several)")
    parser.add_argument("--json", action="store_true",
                        help="print {prompt, answer, tokens} as JSON instead of streaming the text")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from overdrive.console import is_interactive
    from overdrive.errors import Problem, UserError
    from overdrive.hf.benchmarks import default_device
    from overdrive.hf.generation import Sampling, generated_ids
    from overdrive.hf.saved_model import Loaded, load

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError(Problem("--max-new-tokens" if args.max_new_tokens < 1 else
                                "--temperature" if args.temperature < 0 else "--top-p",
                                "out of range", fix="--max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1"))
    if args.prompt is None and not is_interactive(sys.stdin):
        # Piped or redirected input is the prompt, read before the model loads (an empty one is refused now).
        piped = sys.stdin.read().strip() if sys.stdin is not None else ""
        if not piped:
            raise UserError(Problem("PROMPT", "no prompt given, the input piped in is empty, and there is no terminal "
                                    "to ask on", fix='give the prompt: overdrive generate RUN_OR_MODEL "your prompt" '
                                    '(or pipe it in: echo "your prompt" | overdrive generate RUN_OR_MODEL)'))
        args.prompt = piped
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    from overdrive.hf import vision_generate

    images = vision_generate.open_images(args.image)  # read before the model loads: a wrong path fails at once
    device = args.device or default_device()
    vision_loaded = vision_generate.load(args.target, args.base, args.dtype, device)
    loaded: "vision_generate.LoadedVision | Loaded"
    if vision_loaded is None:
        if images:
            raise UserError(Problem("--image", f"{args.target} is not a vision-language model: it takes no images",
                                    fix="drop --image, or give a vision-language model's run or directory"))
        loaded = load(args.target, dtype=args.dtype, device=device, base=args.base)
    else:
        loaded = vision_loaded

    def new_ids(prompt: str, streamer=None) -> list[int]:
        if isinstance(loaded, vision_generate.LoadedVision):
            return vision_generate.generated_ids(loaded, prompt, images, sampling, streamer)
        return generated_ids(loaded.model, loaded.tokenizer, prompt, sampling, streamer=streamer)
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)

    def answer(prompt: str) -> None:
        if args.json:
            ids = new_ids(prompt)
            print(json.dumps({"prompt": prompt, "answer": loaded.tokenizer.decode(ids, skip_special_tokens=True),
                              "tokens": ids}))
            return
        from transformers import TextStreamer

        # Each token printed as it comes; the prompt (and its template) left out.
        new_ids(prompt, TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True))

    if args.prompt is not None:
        answer(args.prompt)
        return 0
    print(f"{loaded.what}: type a prompt, an empty line or Ctrl-D to leave", file=sys.stderr)
    while True:
        try:
            prompt = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not prompt.strip():
            return 0
        answer(prompt)
