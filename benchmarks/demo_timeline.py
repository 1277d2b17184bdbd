"""The demo on a backend, token by token, in one process: its first run, a warm run's time to the
first token, and greedy DSpark against plain greedy (issues 17, 18).

On CUDA, MLX compiles each custom-kernel variant with NVRTC in every new process (it writes only
its own kernels to MLX_PTX_CACHE_DIR), so one process does all of it and pays that once:
  1. cold: plain greedy, then DSpark greedy, on prompt 0 (each token's time as it comes: a log cut
     short by a time limit still shows where the time went);
  2. warm: the same two again; their first tokens are a warm process's time to first token;
  3. agreement: plain and DSpark greedy on prompts 1..P, where they first differ.
Prompts are random ids (as `mlx_dsv41.warmup` uses), --prompt-tokens long. `--stacks S` prints
every thread's Python stack every S seconds (faulthandler; it walks the running thread's frames
and once crashed the process on the H200, so use it only to find where a run stalls).

    python benchmarks/demo_timeline.py [--tokens 16] [--prompt-tokens 40] [--prompts 4] [--stacks 60]
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per run")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the agreement phase")
    parser.add_argument("--stacks", type=float, default=0.0, help="seconds between stack dumps (0: none)")
    a = parser.parse_args()
    if a.tokens < 1 or a.prompt_tokens < 1 or a.prompts < 0 or a.stacks < 0:
        parser.error("--tokens and --prompt-tokens must be >= 1, --prompts and --stacks >= 0")
    if a.stacks > 0:
        faulthandler.dump_traceback_later(a.stacks, repeat=True, file=sys.stderr)
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(f"{time.perf_counter() - t0:8.2f} s  {text}", flush=True)

    import mlx.core as mx
    import numpy as np

    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo
    from mlx_dsv41.kernels import backend
    from mlx_dsv41.speculative import stream_generate

    say(f"MLX {mx.__version__}, backend {backend()}")
    model, tokenizer = mlx_dsv41.load(ensure_demo())
    say("demo loaded")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.args.vocab_size - 300, a.prompt_tokens).tolist() for _ in range(a.prompts + 1)]

    def generate(label: str, prompt, draft, verbose: bool) -> tuple[list[int], float]:
        start, last, tokens, first = time.perf_counter(), None, [], 0.0
        for r in stream_generate(model, tokenizer, prompt, a.tokens, draft=draft):
            now = time.perf_counter()
            first = first or now - start
            tokens.append(r.token)
            if verbose:
                say(f"{label}: token {len(tokens)} after {1e3 * (now - (last or start)):.1f} ms")
            last = now
        say(f"{label}: {len(tokens)} tokens in {time.perf_counter() - start:.2f} s, first after {first:.3f} s")
        return tokens, first

    for phase in ("cold", "warm"):
        plain, _ = generate(f"{phase} plain", prompts[0], 0, phase == "cold")
        drafted, _ = generate(f"{phase} dspark", prompts[0], None, phase == "cold")
        say(f"{phase}: DSpark == plain greedy: {drafted == plain}")
    same = 0
    for i, prompt in enumerate(prompts[1:], 1):
        plain, _ = generate(f"prompt {i} plain", prompt, 0, False)
        drafted, _ = generate(f"prompt {i} dspark", prompt, None, False)
        at = next((j for j, (x, y) in enumerate(zip(plain, drafted)) if x != y), None)
        same += drafted == plain
        say(f"prompt {i}: " + ("identical" if drafted == plain else f"first difference at token {at}"))
    say(f"agreement: {same} of {a.prompts} prompts identical (greedy DSpark against plain greedy)")


if __name__ == "__main__":
    main()
