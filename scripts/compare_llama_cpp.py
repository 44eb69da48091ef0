#!/usr/bin/env python3
"""Prefill and decode speed of infer next to llama.cpp's, on the same GGUF files, threads and lengths, in one run.

    scripts/compare_llama_cpp.py --llama-bench PATH/llama-bench [--infer build/infer] [-t 2] [-p 128[,512...]] \
        [-n 64] [-r 3] MODEL.gguf [MODEL.gguf ...]
    scripts/compare_llama_cpp.py --node-llama-cpp DIR ...    (llama.cpp through its Node binding, see below)
    scripts/compare_llama_cpp.py --bf16-activations ...      (infer with llama.cpp's arithmetic for BF16 weights)

For each file and prompt length P it runs `llama-bench -m FILE -t T -p P -n N -r R -o json` (prompt processing of P
tokens, then generation of N tokens, each repeated R times, after llama-bench's warm-up) and `infer generate` on a
prompt of P token ids with N tokens generated, greedy, end-of-sequence ignored, the weights read into memory before
the clock starts (--no-mmap: no page faults inside the prefill, as llama-bench's warm-up ensures), R times, keeping
infer's best run. It prints one table: tokens/s of each engine and infer's ratio, with the CPU kernels infer chose. Run it on an idle machine; both engines are measured in the same run, so
the ratio holds even where the absolute figures drift. llama.cpp is not part of this project: build it yourself and
give the path of its llama-bench. Where it cannot be built, --node-llama-cpp DIR measures the llama.cpp that the
node-llama-cpp package ships prebuilt (run `npm install node-llama-cpp` in DIR): scripts/llama_cpp_node_bench.mjs
times the same prompt ids in one batch, then greedy generation one token at a time, best of R runs.
"""
import argparse
import json
import os
import re
import subprocess
import sys


def llama_bench(binary, model, threads, prompt, generate, repeats):
    command = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(generate), "-r", str(repeats),
               "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    try:
        records = json.loads(done.stdout)
    except json.JSONDecodeError as error:
        sys.exit(f"llama-bench printed no JSON ({error}); its output began: {done.stdout[:200]!r}")
    prefill = [r["avg_ts"] for r in records if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    decode = [r["avg_ts"] for r in records if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not prefill or not decode:
        sys.exit(f"llama-bench's JSON has no pp{prompt} or tg{generate} record for {model}")
    return prefill[0], decode[0]


def node_llama_cpp(folder, model, threads, prompt, generate, repeats):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_node_bench.mjs")
    command = ["node", script, folder, model, str(prompt), str(generate), str(threads), str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    try:
        record = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as error:
        sys.exit(f"llama_cpp_node_bench.mjs printed no JSON ({error}); its output began: {done.stdout[:200]!r}")
    return record["prefill_tokens_per_second"], record["decode_tokens_per_second"]


def infer_generate(binary, model, threads, prompt, generate, repeats, extra):
    ids = ",".join(str(3 + (i * 37) % 250) for i in range(prompt))  # valid in any vocabulary of 253 ids or more
    command = [binary, "generate", "-m", model, "-t", str(threads), "--prompt-ids", ids, "-n", str(generate),
               "--temp", "0", "--ignore-eos", "--no-mmap"] + extra
    best_prefill = best_decode = 0.0
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"infer generate failed on {model} ({done.returncode}):\n{done.stderr[-2000:]}")
        found = re.search(r"prefill: ([\d.]+) tokens/s\s+decode: ([\d.]+) tokens/s(?:\s+\((.*)\))?", done.stderr)
        if not found:
            sys.exit(f"infer generate printed no speed line for {model}:\n{done.stderr[-2000:]}")
        best_prefill = max(best_prefill, float(found.group(1)))
        best_decode = max(best_decode, float(found.group(2)))
        where = found.group(3) or "cpu"
    return best_prefill, best_decode, where


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="MODEL.gguf")
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--llama-bench", help="path of llama.cpp's llama-bench")
    baseline.add_argument("--node-llama-cpp", metavar="DIR", help="a folder where `npm install node-llama-cpp` was run")
    parser.add_argument("--infer", default="build/infer", help="path of the infer program (default: build/infer)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt", default="128", help="prompt tokens (llama-bench's pp), a comma-separated list")
    parser.add_argument("-n", "--generate", type=int, default=64, help="generated tokens (llama-bench's tg)")
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument("--bf16-activations", action="store_true",
                        help="infer multiplies BF16 weights by activations rounded to bf16, as llama.cpp does")
    options = parser.parse_args()

    try:
        prompts = [int(p) for p in options.prompt.split(",")]
    except ValueError:
        sys.exit(f"-p: expected prompt lengths like 128,512, got {options.prompt!r}")
    if any(p < 1 for p in prompts):
        sys.exit(f"-p: prompt lengths must be positive, got {options.prompt!r}")

    print(f"{options.threads} threads, {options.generate} generated; tokens/s")
    header = (f"{'model':40} {'prompt':>6} {'prefill llama.cpp':>18} {'infer':>9} {'ratio':>7} "
              f"{'decode llama.cpp':>17} {'infer':>9} {'ratio':>7}  infer ran on")
    print(header)
    print("-" * len(header))
    for model in options.models:
        for prompt in prompts:
            if options.llama_bench:
                theirs = llama_bench(options.llama_bench, model, options.threads, prompt, options.generate, options.repeats)
            else:
                theirs = node_llama_cpp(options.node_llama_cpp, model, options.threads, prompt, options.generate,
                                        options.repeats)
            ours = infer_generate(options.infer, model, options.threads, prompt, options.generate, options.repeats,
                                  ["--bf16-activations"] if options.bf16_activations else [])
            name = model if len(model) <= 40 else "..." + model[-37:]
            print(f"{name:40} {prompt:6} {theirs[0]:18.1f} {ours[0]:9.1f} {ours[0] / theirs[0]:6.2f}x "
                  f"{theirs[1]:17.1f} {ours[1]:9.1f} {ours[1] / theirs[1]:6.2f}x  {ours[2]}", flush=True)


if __name__ == "__main__":
    main()
