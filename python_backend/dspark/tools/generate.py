"""`dspark generate`: stream a continuation of --prompt through the speculative engine loop
(default model SmolLM2-135M-Instruct with its shipped drafter, if any); prints τ and tokens/s
on stderr. With --drafter none it is plain decoding through the same loop.
`--chat "message"` sends a user message through the model's chat template instead and prints
the assistant's reply (it stops at the template's end-of-turn token, <|im_end|> for SmolLM2)."""

from __future__ import annotations

import argparse
import sys
import time

from dspark import wiring
from dspark.runtime.chat import ChatTemplate
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.text import IncrementalDetokenizer, encode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Once upon a time", help="text to continue")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="a user message, rendered with the model's chat template (replaces --prompt)")
    p.add_argument("--system", default=None, help="with --chat: a system message (default: the template's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    wiring.add_arguments(p, capacity=1, max_seq_len=4096)


def main(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        spec = wiring.from_args(args)
        if args.chat is not None and not args.chat.strip():
            raise ValueError("--chat: the message is empty")
        template = None if args.chat is None else ChatTemplate.from_folder(wiring.model_folder(spec.model))
        engine = wiring.build_engine(spec)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = engine.target
    if target.tokenizer is None:
        print(f"error: model {spec.model} has no tokenizer.json", file=sys.stderr)
        return 2
    stop_ids = None  # the model's eos ids
    if template is not None:
        prompt, stop_ids = chat_prompt(template, target, args.chat, args.system)
    else:
        prompt = encode(target.tokenizer, args.prompt)
    if not prompt:
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    if len(prompt) > target.max_seq_len:
        print(f"error: the prompt is {len(prompt)} tokens, longer than --max-seq-len {target.max_seq_len}",
              file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(target.tokenizer, prompt_ids=prompt)

    def stream(_rid: str, ids: list[int], finished: bool, _reason: str | None) -> None:
        sys.stdout.write(detok.push(ids) + (detok.finish() if finished else ""))
        sys.stdout.flush()

    t0 = time.perf_counter()
    req = engine.add_request(prompt, args.max_tokens, params, stop_token_ids=stop_ids, on_tokens=stream)
    engine.run_until_done()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    n = len(req.output)
    policy = engine.policy.name if engine.policy is not None else "none"
    drafter = "none" if engine.drafter is None else (
        spec.drafter if spec.drafter != "auto" else str(wiring.drafter_folder(spec).name))
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, τ={req.tau:.2f}, drafter {drafter}, "
          f"policy {policy}, prompt {len(prompt)} tokens]", file=sys.stderr)
    return 0


def chat_prompt(template: ChatTemplate, target, message: str, system: str | None = None,
                ) -> tuple[list[int], list[int]]:
    """(prompt ids of the rendered chat, stop ids = the model's eos ids + the end-of-turn token)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": message}]
    text = template.render(messages, add_generation_prompt=True)
    ids = encode(target.tokenizer, text, add_special_tokens=False)  # the template wrote the specials
    stops = list(target.eos_token_ids)
    end_of_turn = target.tokenizer.token_to_id(template.special_tokens.get("eos_token", "<|im_end|>"))
    if end_of_turn is not None and end_of_turn not in stops:
        stops.append(end_of_turn)
    return ids, stops
