#!/usr/bin/env python3
"""Prefill and decode speed of infer next to llama.cpp's, on the same GGUF files, threads and lengths, in one run.

    scripts/compare_llama_cpp.py --llama-bench PATH/llama-bench [--infer build/infer] [-t 2] [-p 128[,512...]] \
        [-n 64] [-r 3] MODEL.gguf [MODEL.gguf ...]
    scripts/compare_llama_cpp.py --node-llama-cpp DIR ...    (llama.cpp through its Node binding, see below)
    scripts/compare_llama_cpp.py --bf16-activations ...      (infer with llama.cpp's arithmetic for BF16 weights)
    scripts/compare_llama_cpp.py --sequences 16 --llama-batched-bench PATH/llama-batched-bench [...] MODEL.gguf ...
    scripts/compare_llama_cpp.py --sequences 16 --node-llama-cpp DIR [...] MODEL.gguf ...

For each file and prompt length P it runs `llama-bench -m FILE -t T -p P -n N -r R -mmp 0 -o json` (prompt processing
of P tokens, then generation of N tokens, each repeated R times, after llama-bench's warm-up) and `infer generate` on a
prompt of P token ids with N tokens generated, greedy, end-of-sequence ignored, the weights read into memory before
the clock starts (--no-mmap) and one untimed pass of the prompt first (--warmup: buffers touched and caches warm, as
after llama-bench's warm-up), R times, keeping infer's best run. It prints one table: tokens/s of each engine and
infer's ratio, with the CPU kernels infer chose. Run it on an idle machine; both engines are measured in the same run,
so the ratio holds even where the absolute figures drift. llama.cpp is not part of this project: build it yourself and
give the path of its llama-bench. Where it cannot be built, --node-llama-cpp DIR measures the llama.cpp that the
node-llama-cpp package ships prebuilt (run `npm install node-llama-cpp` in DIR): scripts/llama_cpp_node_bench.mjs
times the same prompt ids in one batch, then greedy generation one token at a time, best of R runs.

With --sequences S it measures the aggregate decode rate of S sequences decoding together instead: llama.cpp's
`llama-batched-bench -npp P -ntg N -npl S` (its S_TG: S × N generated tokens over their time) or, through the Node
binding, scripts/llama_cpp_node_batched.mjs; and `infer bench engine --batch S --input-len P --output-len N`, whose
mean time per output token (TPOT) gives S / TPOT tokens/s. Best of R runs each.

Both engines read the weights into memory instead of mapping the file (llama.cpp's tools -mmp 0 and --no-mmap, the
Node scripts useMmap: false, infer --no-mmap): a mapped file's 4 KB pages cost the prefill of either engine up to a
sixth on a 1.1B file (chapter 07, "Pages"), so a race with only one side mapped would time the pages.

Both engines keep the KV cache in the same type: --cache-type (default f16, llama.cpp's own default) goes to
llama.cpp's tools as -ctk/-ctv and to infer as --cache-type (whose default is f32). The Node binding keeps its
default, f16, so --node-llama-cpp takes no other.
"""
import argparse
import json
import os
import re
import subprocess
import sys


def llama_bench(binary, model, threads, prompt, generate, repeats, cache_type):
    command = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(generate), "-r", str(repeats),
               "-ctk", cache_type, "-ctv", cache_type, "-mmp", "0", "-o", "json"]
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


def llama_batched_bench(binary, model, threads, sequences, prompt, generate, repeats, cache_type):
    command = [binary, "-m", model, "-t", str(threads), "-c", str(sequences * (prompt + generate) + 64), "-b", "2048",
               "-ub", "512", "-npp", str(prompt), "-ntg", str(generate), "-npl", str(sequences), "-ctk", cache_type,
               "-ctv", cache_type, "--no-mmap", "--output-format", "jsonl"]
    best = 0.0
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        lines = [line for line in (done.stdout + "\n" + done.stderr).splitlines() if '"speed_tg"' in line]
        if not lines:
            sys.exit(f"llama-batched-bench printed no JSON line with speed_tg; its output ended: {done.stdout[-300:]!r}")
        best = max(best, json.loads(lines[-1][lines[-1].index("{"):])["speed_tg"])
    return best


def node_llama_cpp_batched(folder, model, threads, sequences, prompt, generate, repeats, cache_type):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_node_batched.mjs")
    command = ["node", script, folder, model, str(sequences), str(prompt), str(generate), str(threads)]
    best = 0.0
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        try:
            best = max(best, json.loads(done.stdout.strip().splitlines()[-1])["decode_tokens_per_second"])
        except (json.JSONDecodeError, IndexError, KeyError) as error:
            sys.exit(f"llama_cpp_node_batched.mjs printed no JSON ({error}); its output began: {done.stdout[:200]!r}")
    return best


def infer_engine(binary, model, threads, sequences, prompt, generate, repeats, cache_type, bf16_activations):
    command = [binary, "bench", "engine", "-m", model, "-t", str(threads), "--batch", str(sequences), "--input-len",
               str(prompt), "--output-len", str(generate), "--cache-type", cache_type, "--no-mmap"]
    environment = dict(os.environ, INFER_BF16_ACTIVATIONS="1" if bf16_activations else "0")
    best = 0.0
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True, env=environment)
        if done.returncode != 0:
            sys.exit(f"infer bench engine failed on {model} ({done.returncode}):\n{done.stderr[-2000:]}")
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
                for line in done.stdout.splitlines() if line.startswith("|")]
        if len(rows) < 3 or "TPOT mean ms" not in rows[0]:
            sys.exit(f"infer bench engine printed no table with a TPOT column for {model}:\n{done.stdout[-2000:]}")
        best = max(best, sequences * 1000.0 / float(rows[2][rows[0].index("TPOT mean ms")]))
    return best


def infer_generate(binary, model, threads, prompt, generate, repeats, extra):
    ids = ",".join(str(3 + (i * 37) % 250) for i in range(prompt))  # valid in any vocabulary of 253 ids or more
    command = [binary, "generate", "-m", model, "-t", str(threads), "--prompt-ids", ids, "-n", str(generate),
               "--temp", "0", "--ignore-eos", "--no-mmap", "--warmup"] + extra
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
    baseline.add_argument("--llama-batched-bench", help="path of llama.cpp's llama-batched-bench (with --sequences)")
    parser.add_argument("--infer", default="build/infer", help="path of the infer program (default: build/infer)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt", default="128", help="prompt tokens (llama-bench's pp), a comma-separated list")
    parser.add_argument("-n", "--generate", type=int, default=64, help="generated tokens (llama-bench's tg)")
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument("--bf16-activations", action="store_true",
                        help="infer multiplies BF16 weights by activations rounded to bf16, as llama.cpp does")
    parser.add_argument("--sequences", type=int, metavar="S",
                        help="measure the aggregate decode rate of S sequences decoding together instead")
    parser.add_argument("--cache-type", choices=["f16", "bf16", "f32"], default="f16",
                        help="the KV cache's type in both engines (default f16, llama.cpp's default)")
    options = parser.parse_args()
    if options.node_llama_cpp and options.cache_type != "f16":
        sys.exit(f"--cache-type {options.cache_type}: the Node binding keeps its default f16 cache; use llama.cpp's tools")
    if options.sequences is not None and options.sequences < 1:
        sys.exit(f"--sequences: expected a positive count, got {options.sequences}")
    if options.llama_batched_bench and options.sequences is None:
        sys.exit("--llama-batched-bench measures with --sequences S only")
    if options.sequences is not None and options.llama_bench:
        sys.exit("--sequences needs --llama-batched-bench or --node-llama-cpp, not llama-bench")

    try:
        prompts = [int(p) for p in options.prompt.split(",")]
    except ValueError:
        sys.exit(f"-p: expected prompt lengths like 128,512, got {options.prompt!r}")
    if any(p < 1 for p in prompts):
        sys.exit(f"-p: prompt lengths must be positive, got {options.prompt!r}")

    if options.sequences is not None:
        return compare_sequences(options, prompts)
    print(f"{options.threads} threads, {options.generate} generated, KV cache {options.cache_type}; tokens/s")
    header = (f"{'model':40} {'prompt':>6} {'prefill llama.cpp':>18} {'infer':>9} {'ratio':>7} "
              f"{'decode llama.cpp':>17} {'infer':>9} {'ratio':>7}  infer ran on")
    print(header)
    print("-" * len(header))
    for model in options.models:
        for prompt in prompts:
            if options.llama_bench:
                theirs = llama_bench(options.llama_bench, model, options.threads, prompt, options.generate, options.repeats,
                                     options.cache_type)
            else:
                theirs = node_llama_cpp(options.node_llama_cpp, model, options.threads, prompt, options.generate,
                                        options.repeats)
            ours = infer_generate(options.infer, model, options.threads, prompt, options.generate, options.repeats,
                                  ["--cache-type", options.cache_type] +
                                  (["--bf16-activations"] if options.bf16_activations else []))
            name = model if len(model) <= 40 else "..." + model[-37:]
            print(f"{name:40} {prompt:6} {theirs[0]:18.1f} {ours[0]:9.1f} {ours[0] / theirs[0]:6.2f}x "
                  f"{theirs[1]:17.1f} {ours[1]:9.1f} {ours[1] / theirs[1]:6.2f}x  {ours[2]}", flush=True)


def compare_sequences(options, prompts):
    print(f"{options.sequences} sequences decoding together, {options.threads} threads, {options.generate} generated "
          f"each, KV cache {options.cache_type}; aggregate decode tokens/s")
    header = f"{'model':40} {'prompt':>6} {'llama.cpp':>10} {'infer':>9} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for model in options.models:
        for prompt in prompts:
            arguments = (model, options.threads, options.sequences, prompt, options.generate, options.repeats,
                         options.cache_type)
            if options.llama_batched_bench:
                theirs = llama_batched_bench(options.llama_batched_bench, *arguments)
            else:
                theirs = node_llama_cpp_batched(options.node_llama_cpp, *arguments)
            ours = infer_engine(options.infer, *arguments, options.bf16_activations)
            name = model if len(model) <= 40 else "..." + model[-37:]
            print(f"{name:40} {prompt:6} {theirs:10.1f} {ours:9.1f} {ours / theirs:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
