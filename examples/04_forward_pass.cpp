// 04_forward_pass — the same forward function in its two regimes: prefill (many tokens per call) and decode (one).
//
//   04_forward_pass [-m PATH] [--prompt-tokens N] [--decode-tokens N] [-t THREADS]
//
// Runs one prefill of N tokens through a Batch, a KVCache and a ForwardPass, then M one-token decode steps, and sets
// the time per token in each regime against the machine's memory bandwidth, measured in the same run with the same
// threads. Without -m it uses the built-in demo model. Chapter 04 walks through it.
#include "command_line.hpp"
#include "infer.hpp"
#include "measure.hpp"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>

namespace {

struct Options {
    std::string model_path;  // empty: the built-in demo model
    int prompt_tokens = 128;
    int decode_tokens = 64;
    int threads = 0;  // 0: every core
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"-m", "--prompt-tokens", "--decode-tokens", "-t"}, {},
                     "usage: 04_forward_pass [-m PATH] [--prompt-tokens N] [--decode-tokens N] [-t THREADS]\n");
    Options options;
    options.model_path = line.text("-m");
    options.prompt_tokens = static_cast<int>(line.integer("--prompt-tokens", options.prompt_tokens, 1, 1'000'000));
    options.decode_tokens = static_cast<int>(line.integer("--decode-tokens", options.decode_tokens, 0, 1'000'000));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    return options;
}

// Multiply-adds in the matrices one token passes through, counted as 2 FLOPs each (attention's dot products over the
// cache grow with the position and are left out: at a few hundred positions they are a few percent).
double layer_flops_per_token(const infer::Model& model) {
    double elements = 0;
    for (const infer::LayerWeights& layer : model.layers)
        for (const infer::Tensor* t :
             {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down})
            elements += static_cast<double>(t->elements());
    return 2 * elements;
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    infer::Model model = model_or_demo(options.model_path);
    const infer::ModelConfig& c = model.config;
    const int N = options.prompt_tokens, M = options.decode_tokens, V = c.vocab_size;
    if (N + M > c.context_length)
        throw infer::Error("--prompt-tokens " + std::to_string(N) + " + --decode-tokens " + std::to_string(M) +
                           " exceed the model's context of " + std::to_string(c.context_length) + " tokens");

    infer::ThreadPool pool(options.threads);
    infer::ForwardPass forward(model, pool);
    // Sequence 0 is the one we time; sequence 1 holds a one-token warm-up, released before the timed runs.
    infer::KVCache cache(c, (N + M + 15) / 16 + 1, 16);
    infer::Batch batch;

    // Warm-up: the first call pays for page faults on the mapped weights and for growing the scratch buffers. Paying
    // them here keeps both timed regimes to the arithmetic and the memory traffic of a warm model.
    cache.reserve(1, 1);
    batch.add(1 % V, 0, 1, true);
    forward.forward(batch, cache);
    cache.release(1);

    // Prefill: the whole prompt in one call, so each weight row fetched from memory is multiplied against every prompt
    // token while it is still in cache: N tokens' worth of FLOPs for one read of the weights.
    cache.reserve(0, N + M);
    batch.clear();
    for (int i = 0; i < N; ++i) batch.add(i % V, i, 0, i == N - 1);  // any valid ids: the cost does not depend on them
    infer::Stopwatch clock;
    forward.forward(batch, cache);
    const double prefill_seconds = clock.seconds();

    // Decode: one token per call, each reading every weight again for a single multiply-add per weight.
    clock.restart();
    for (int j = 0; j < M; ++j) {
        batch.clear();
        batch.add((N + j) % V, N + j, 0, true);
        forward.forward(batch, cache);
    }
    const double decode_seconds = clock.seconds();

    measure::Bandwidth bandwidth = measure::memory_bandwidth(pool);

    const double bytes_per_token = static_cast<double>(model.weight_bytes_per_token());
    const double flops_per_token = layer_flops_per_token(model);
    const double head_flops = 2.0 * static_cast<double>(model.lm_head.elements());
    const double prefill_flops = N * flops_per_token + head_flops;  // logits for the last prompt token only
    const double decode_flops = M * (flops_per_token + head_flops);
    const double prefill_rate = N / prefill_seconds;
    const double decode_rate = M > 0 ? M / decode_seconds : 0;
    const double achieved = bytes_per_token * decode_rate;

    std::printf("model          %s (%s, %.2f M parameters, %s matrices)\n", model.source.c_str(), infer::format_name(model.format),
                static_cast<double>(model.parameter_count()) / 1e6, infer::dtype_name(model.layers.front().wq.dtype));
    std::printf("threads        %d\n\n", pool.size());
    std::printf("               %8s %12s %12s %12s\n", "tokens", "ms/token", "tokens/s", "GFLOP/s");
    std::printf("prefill        %8d %12.4f %12.1f %12.2f\n", N, 1e3 * prefill_seconds / N, prefill_rate,
                prefill_flops / prefill_seconds / 1e9);
    if (M > 0)
        std::printf("decode         %8d %12.4f %12.1f %12.2f\n", M, 1e3 * decode_seconds / M, decode_rate,
                    decode_flops / decode_seconds / 1e9);
    std::printf("\nprefill is %.1f× faster per token than decode\n\n", M > 0 ? prefill_rate / decode_rate : 0.0);

    std::printf("decode reads   %.3f MB of weights per step\n", bytes_per_token / 1e6);
    std::printf("achieved       %.2f GB/s  (bytes per step × decode tokens/s)\n", achieved / 1e9);
    std::printf("bandwidth      %.2f GB/s  (streaming read of %.0f MiB, %d threads, best of %d passes)\n",
                bandwidth.bytes_per_second / 1e9, static_cast<double>(bandwidth.buffer_bytes) / (1 << 20),
                bandwidth.threads, bandwidth.passes);
    std::printf("ratio          %.1f %% of the measured bandwidth\n", 100 * achieved / bandwidth.bytes_per_second);
    // FLOPs per weight byte read: 2 per weight per token over its bytes in decode, about N times that in prefill. A
    // step is memory-bound while this is below what the cores can compute per byte the memory delivers.
    std::printf("intensity      decode %.2f FLOP/byte, prefill %.1f FLOP/byte of weights read\n",
                (flops_per_token + head_flops) / bytes_per_token, prefill_flops / bytes_per_token);
    if (bytes_per_token < 64e6)
        std::printf("note           %.1f MB of weights likely stay in the CPU caches between steps, so decode\n"
                    "               here is limited by per-step overheads more than by DRAM; bench_decode uses\n"
                    "               a model of 0.4 GB per token\n",
                    bytes_per_token / 1e6);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
