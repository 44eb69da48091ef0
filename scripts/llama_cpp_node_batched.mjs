// llama.cpp's aggregate decode rate with S sequences decoding together (what llama-batched-bench's S_TG column
// measures), through node-llama-cpp where llama.cpp's own tools cannot be built. compare_llama_cpp.py --sequences S
// --node-llama-cpp DIR runs it; by hand:
//
//   node scripts/llama_cpp_node_batched.mjs DIR MODEL.gguf SEQUENCES PROMPT GENERATE THREADS
//
// Each of the S sequences of one context gets its own prompt of PROMPT token ids, then generates GENERATE tokens
// greedily. The binding batches what its sequences have pending into one decode call per step, as batched-bench does.
// Decode tokens/s is S × (GENERATE − 1) over the time from the moment every sequence has its first token to the last
// token. Prints one JSON line.
import path from "node:path";
import {pathToFileURL} from "node:url";

const [dir, modelPath, sequences = "16", prompt = "128", generate = "64", threads = "2"] = process.argv.slice(2);
if (!dir || !modelPath) {
    console.error("usage: node llama_cpp_node_batched.mjs NODE_MODULES_DIR MODEL.gguf [SEQUENCES] [PROMPT] [GENERATE] [THREADS]");
    process.exit(2);
}
const entry = pathToFileURL(path.join(dir, "node_modules", "node-llama-cpp", "dist", "index.js")).href;
const {getLlama, LlamaLogLevel} = await import(entry);
const S = Number(sequences), P = Number(prompt), N = Number(generate);

const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, gpuLayers: 0, useMmap: false});
const context = await model.createContext({contextSize: S * (P + N + 16), batchSize: 512, threads: Number(threads),
                                           sequences: S});
// Different ids per sequence, valid in any vocabulary of 253 ids or more.
const ids = (s) => Array.from({length: P}, (_, i) => 3 + ((i + 7 * s) * 37) % 250);
let started = 0, allStarted = 0;
const begin = performance.now();
await Promise.all(Array.from({length: S}, async (_, s) => {
    const tokens = context.getSequence().evaluate(ids(s), {temperature: 0});
    await tokens.next();  // the prompt, then the first generated token
    if (++started === S) allStarted = performance.now();
    for (let i = 1; i < N; ++i) await tokens.next();
    await tokens.return();
}));
const end = performance.now();
console.log(JSON.stringify({model: modelPath, sequences: S, prompt: P, generate: N, threads: Number(threads),
                            prefill_seconds: (allStarted - begin) / 1000,
                            decode_tokens_per_second: S * (N - 1) / ((end - allStarted) / 1000)}));
process.exit(0);
