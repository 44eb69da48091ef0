// 04_forward_pass — the same forward function in its two regimes: prefill (many tokens per call) and decode (one).
//
//   04_forward_pass [-m PATH] [--prompt-tokens N] [--decode-tokens N] [-t THREADS] [--cache-type f32|f16|bf16]
//
// Runs one prefill of N tokens through a Batch, a KVCache and a ForwardPass, then M one-token decode steps, and sets
// the time per token in each regime against the machine's memory bandwidth, measured in the same run with the same
// threads. Then it turns the last row of logits into tokens with each of the sampler's settings, and times the
// sampler against a decode step. Without -m it uses the built-in demo model. Chapter 04 walks through it.
#include "command_line.hpp"
#include "infer.hpp"
#include "measure.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
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
    infer::DType cache_type = infer::DType::F32;  // how the KV cache stores keys and values
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"-m", "--prompt-tokens", "--decode-tokens", "-t", "--cache-type"}, {},
                     "usage: 04_forward_pass [-m PATH] [--prompt-tokens N] [--decode-tokens N] [-t THREADS]"
                     " [--cache-type f32|f16|bf16]\n");
    Options options;
    options.model_path = line.text("-m");
    options.prompt_tokens = static_cast<int>(line.integer("--prompt-tokens", options.prompt_tokens, 1, 1'000'000));
    options.decode_tokens = static_cast<int>(line.integer("--decode-tokens", options.decode_tokens, 0, 1'000'000));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    options.cache_type = cache_type(line);
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

// A token as the vocabulary spells it, for the sampler's table (its id without a tokenizer).
std::string spelling(const std::optional<infer::Tokenizer>& tokenizer, int id) {
    if (!tokenizer) return "id " + std::to_string(id);
    return "\"" + tokenizer->token_text(id) + "\" (" + std::to_string(id) + ")";
}

// The distribution the logits stand for, at a temperature: softmax(logits / t), likeliest first.
std::vector<std::pair<double, int>> distribution(const std::vector<float>& logits, double temperature) {
    const double top = *std::max_element(logits.begin(), logits.end());
    std::vector<std::pair<double, int>> p;
    double total = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
        p.emplace_back(std::exp((logits[i] - top) / temperature), static_cast<int>(i));
        total += p.back().first;
    }
    for (auto& [probability, id] : p) probability /= total;
    std::sort(p.begin(), p.end(), std::greater<>());
    return p;
}

// Eight draws from the same logits with the given seed and llama.cpp's command-line defaults.
std::vector<int> draws(const std::vector<float>& logits, uint64_t seed) {
    infer::SamplingParams params;
    params.temperature = 0.8f;
    params.top_k = 40;
    params.top_p = 0.95f;
    params.min_p = 0.05f;
    params.seed = seed;
    infer::Sampler sampler(params, static_cast<int>(logits.size()));
    std::vector<int> ids;
    for (int i = 0; i < 8; ++i) {
        std::vector<float> row = logits;  // the sampler edits its input
        ids.push_back(sampler.sample(row));
    }
    return ids;
}

std::string joined(const std::vector<int>& ids) {
    std::string text;
    for (int id : ids) text += (text.empty() ? "" : " ") + std::to_string(id);
    return text;
}

// The sampler layer on one row of logits: what each setting keeps, what seeds do, and what it costs.
void show_sampler(const infer::Model& model, const std::vector<float>& logits, double decode_step_seconds) {
    std::optional<infer::Tokenizer> tokenizer;
    if (infer::has_tokenizer(model)) tokenizer = infer::tokenizer_for(model);
    const auto p = distribution(logits, 1.0);
    std::printf("\nsampler        on the next token's logits, V = %zu\n", logits.size());
    std::printf("  greedy       %s, p = %.3f (temperature 0: always this one)\n", spelling(tokenizer, p[0].second).c_str(), p[0].first);
    std::printf("  next         %s, p = %.3f;  %s, p = %.3f\n", spelling(tokenizer, p[1].second).c_str(), p[1].first,
                spelling(tokenizer, p[2].second).c_str(), p[2].first);
    for (double t : {0.5, 1.0, 1.5}) {
        auto q = distribution(logits, t);
        double entropy = 0;
        for (auto [probability, id] : q)
            if (probability > 0) entropy -= probability * std::log(probability);
        std::printf("  temperature  %.1f: the likeliest token has p = %.3f, entropy %.2f nats\n", t, q[0].first, entropy);
    }
    // Truncation at temperature 1: how many candidates each rule leaves, and the share of the mass they hold.
    auto kept = [&](size_t n) {
        double mass = 0;
        for (size_t i = 0; i < n; ++i) mass += p[i].first;
        return mass;
    };
    size_t top_k = std::min<size_t>(40, p.size());
    size_t top_p = 0;
    for (double mass = 0; top_p < p.size() && mass < 0.95; ++top_p) mass += p[top_p].first;
    size_t min_p = 0;
    while (min_p < p.size() && p[min_p].first >= 0.05 * p[0].first) ++min_p;
    std::printf("  top-k 40     keeps %zu tokens, %.1f %% of the probability\n", top_k, 100 * kept(top_k));
    std::printf("  top-p 0.95   keeps %zu tokens, %.1f %%\n", top_p, 100 * kept(top_p));
    std::printf("  min-p 0.05   keeps %zu tokens (p >= 0.05 × %.3f), %.1f %%\n", min_p, p[0].first, 100 * kept(min_p));

    // A repetition penalty divides a positive logit of every token already seen: strong enough, greedy moves on.
    infer::SamplingParams greedy;
    greedy.temperature = 0;
    greedy.repetition_penalty = 1.3f;
    {
        infer::Sampler sampler(greedy, static_cast<int>(logits.size()));
        const int seen[] = {p[0].second};
        sampler.set_prompt(seen);
        std::vector<float> row = logits;
        std::printf("  repetition   1.3, with %s already in the text: greedy picks %s instead\n",
                    spelling(tokenizer, p[0].second).c_str(), spelling(tokenizer, sampler.sample(row)).c_str());
    }
    std::printf("  seed 7       %s\n", joined(draws(logits, 7)).c_str());
    std::printf("  seed 7 again %s  (the same: a run can be repeated)\n", joined(draws(logits, 7)).c_str());
    std::printf("  seed 8       %s\n", joined(draws(logits, 8)).c_str());

    // Cost: a sample is one pass over V, plus a partial sort of what top-k keeps.
    auto time_sampling = [&](const infer::SamplingParams& params) {
        infer::Sampler sampler(params, static_cast<int>(logits.size()));
        std::vector<float> row;
        const int rounds = 200;
        infer::Stopwatch clock;
        for (int i = 0; i < rounds; ++i) {
            row = logits;
            sampler.sample(row);
        }
        return clock.seconds() / rounds;
    };
    infer::SamplingParams defaults;
    defaults.temperature = 0.8f;
    defaults.top_k = 40;
    defaults.top_p = 0.95f;
    defaults.min_p = 0.05f;
    defaults.seed = 1;
    greedy.repetition_penalty = 1;
    const double greedy_seconds = time_sampling(greedy), default_seconds = time_sampling(defaults);
    std::printf("  cost         %.1f µs greedy, %.1f µs with temperature, top-k, top-p and min-p; a decode step: %.1f µs\n",
                greedy_seconds * 1e6, default_seconds * 1e6, decode_step_seconds * 1e6);
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
    infer::KVCache cache(c, (N + M + 15) / 16 + 1, 16, options.cache_type);
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
    std::vector<float> last_logits;
    clock.restart();
    for (int j = 0; j < M; ++j) {
        batch.clear();
        batch.add((N + j) % V, N + j, 0, true);
        std::span<const float> logits = forward.forward(batch, cache);
        if (j == M - 1) last_logits.assign(logits.begin(), logits.end());
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
    // The sampler's demo reads the logits after a real sentence when the model has a tokenizer (the timed prompt's
    // ids are arbitrary, and so is what follows them).
    if (infer::has_tokenizer(model)) {
        std::vector<int> ids = infer::tokenizer_for(model).encode("Once upon a time, there was a little");
        if (static_cast<int>(ids.size()) <= N + M) {
            cache.release(0);
            cache.reserve(2, static_cast<int>(ids.size()));
            batch.clear();
            for (size_t i = 0; i < ids.size(); ++i) batch.add(ids[i], static_cast<int>(i), 2, i + 1 == ids.size());
            std::span<const float> logits = forward.forward(batch, cache);
            last_logits.assign(logits.begin(), logits.end());
            std::printf("\nprompt         \"Once upon a time, there was a little\" (%zu tokens)", ids.size());
        }
    }
    if (!last_logits.empty()) show_sampler(model, last_logits, decode_seconds / M);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
