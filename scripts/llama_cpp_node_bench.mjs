// llama.cpp's speed on a GGUF file through node-llama-cpp (the Node binding that ships llama.cpp prebuilt, with one CPU
// library per x86-64 generation chosen at run time): for machines where llama.cpp's own llama-bench cannot be built.
// compare_llama_cpp.py --node-llama-cpp DIR runs it; by hand:
//
//   node scripts/llama_cpp_node_bench.mjs DIR MODEL.gguf PROMPT GENERATE THREADS REPEATS
//
// DIR is a folder where `npm install node-llama-cpp` was run. The prompt is the same ids infer generate is given in
// compare_llama_cpp.py, evaluated in one batch; then GENERATE tokens are generated greedily one at a time, the
// engine's own sampler picking each (what llama-bench's tg and infer's decode time: a forward pass and the logits of
// one token). Prefill tokens/s is the prompt over the time to the first generated token, decode tokens/s the tokens
// after it over their time, best of REPEATS runs. Prints one JSON line.
import path from "node:path";
import {pathToFileURL} from "node:url";

const [dir, modelPath, prompt = "128", generate = "64", threads = "2", repeats = "3"] = process.argv.slice(2);
if (!dir || !modelPath) {
    console.error("usage: node llama_cpp_node_bench.mjs NODE_MODULES_DIR MODEL.gguf [PROMPT] [GENERATE] [THREADS] [REPEATS]");
    process.exit(2);
}
const entry = pathToFileURL(path.join(dir, "node_modules", "node-llama-cpp", "dist", "index.js")).href;
const {getLlama, LlamaLogLevel} = await import(entry);
const P = Number(prompt), N = Number(generate);

const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, gpuLayers: 0, useMmap: false});
const ids = Array.from({length: P}, (_, i) => 3 + (i * 37) % 250);  // as compare_llama_cpp.py gives infer
let bestPrefill = 0, bestDecode = 0;
for (let run = 0; run < Number(repeats); ++run) {
    const context = await model.createContext({contextSize: P + N + 16, batchSize: P, threads: Number(threads), sequences: 1});
    const sequence = context.getSequence();
    const tokens = sequence.evaluate(ids, {temperature: 0});
    const start = performance.now();
    await tokens.next();  // the prompt, then the first generated token
    const first = performance.now();
    for (let i = 1; i < N; ++i) await tokens.next();
    const end = performance.now();
    await tokens.return();
    bestPrefill = Math.max(bestPrefill, P / ((first - start) / 1000));
    bestDecode = Math.max(bestDecode, (N - 1) / ((end - first) / 1000));
    await context.dispose();
}
console.log(JSON.stringify({model: modelPath, prompt: P, generate: N, threads: Number(threads),
                            prefill_tokens_per_second: bestPrefill, decode_tokens_per_second: bestDecode}));
await model.dispose();
await llama.dispose();
