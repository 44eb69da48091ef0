// 05_kv_cache — what the KV cache costs, and what paging and prefix sharing save.
//
//   05_kv_cache [-m PATH] [--requests N] [--block-size B] [--seed S] [-t THREADS]
//
// Three measurements on one model, each through the real KVCache (infer.hpp section 05) and Engine (section 06):
//   1. bytes per token: the formula, on this model and on the published shapes of well-known models;
//   2. contiguous vs paged: a workload of requests with mixed prompt lengths and output limits, and at every engine
//      step the memory a contiguous cache would reserve (each request's prompt + max_tokens, or a full context per
//      slot) against the blocks the paged cache actually holds, next to the tokens really stored;
//   3. prefix sharing: requests that share a system prompt, run with and without the prefix cache, with the hit rate
//      and the prefill work it saved.
// Without -m it uses the built-in demo model. Chapter 05 walks through it.
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>
#include <map>
#include <random>
#include <set>

namespace {

struct Options {
    std::string model_path;
    int requests = 24;
    int block_size = 16;
    uint64_t seed = 5;
    int threads = 0;
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"-m", "--requests", "--block-size", "--seed", "-t"}, {},
                     "usage: 05_kv_cache [-m PATH] [--requests N] [--block-size B] [--seed S] [-t THREADS]\n");
    Options options;
    options.model_path = line.text("-m");
    options.requests = static_cast<int>(line.integer("--requests", options.requests, 1, 4096));
    options.block_size = static_cast<int>(line.integer("--block-size", options.block_size, 1, 4096));
    options.seed = static_cast<uint64_t>(line.integer("--seed", 5, 0, std::numeric_limits<long long>::max()));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    return options;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// ---- 1. Bytes per token --------------------------------------------------------------------------------------------

void print_bytes_per_token(const infer::Model& model) {
    const infer::ModelConfig& c = model.config;
    std::printf("1. Bytes per token: 2 (K and V) × layers × KV heads × head size × bytes per number\n");
    std::printf("   this model: 2 × %d × %d × %d × 4 (f32) = %zu bytes per token; its %d-token context: %.2f MiB\n", c.n_layers,
                c.n_kv_heads, c.head_dim, infer::KVCache::bytes_per_token(c), c.context_length,
                mib(static_cast<double>(infer::KVCache::bytes_per_token(c)) * c.context_length));
    // Published shapes (config.json of each model), with K/V stored in 16-bit as GPU engines do.
    struct Shape {
        const char* name;
        int layers, kv_heads, head_dim, context;
    };
    const Shape shapes[] = {{"Llama 2 7B (no GQA)", 32, 32, 128, 4096},
                            {"Llama 3 8B (GQA, 8 KV heads)", 32, 8, 128, 8192},
                            {"Mistral 7B (GQA, 8 KV heads)", 32, 8, 128, 32768},
                            {"Qwen3 0.6B (GQA, 8 KV heads)", 28, 8, 128, 40960},
                            {"TinyLlama 1.1B (GQA, 4 KV heads)", 22, 4, 64, 2048}};
    std::printf("   %-34s %14s %16s\n", "published shape, 16-bit K/V", "KiB per token", "GiB per context");
    for (const Shape& s : shapes) {
        double per_token = 2.0 * s.layers * s.kv_heads * s.head_dim * 2;
        std::printf("   %-34s %14.0f %16.2f\n", s.name, per_token / 1024, per_token * s.context / (1024.0 * 1024 * 1024));
    }
}

// ---- 2. Contiguous vs paged ------------------------------------------------------------------------------------------

struct Workload {
    std::vector<std::vector<int>> prompts;
    std::vector<int> max_tokens;
};

// Prompts of 8–160 ids and output limits of 8–200 tokens; stopping at EOS (when the model emits it) makes the real
// lengths shorter than the limits, as in a real service.
Workload mixed_workload(const infer::Model& model, int count, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int vocab = model.config.vocab_size;
    const int context = model.config.context_length;
    Workload w;
    for (int i = 0; i < count; ++i) {
        int length = std::min(8 + static_cast<int>(rng() % 153), context / 2);
        std::vector<int> prompt{model.config.bos_id >= 0 ? model.config.bos_id : 1};
        while (static_cast<int>(prompt.size()) < length) prompt.push_back(3 + static_cast<int>(rng() % (vocab - 3)));
        w.prompts.push_back(prompt);
        w.max_tokens.push_back(std::min(8 + static_cast<int>(rng() % 193), context - length));
    }
    return w;
}

void print_contiguous_vs_paged(const infer::Model& model, infer::ThreadPool& pool, const Options& options) {
    const infer::ModelConfig& c = model.config;
    const Workload w = mixed_workload(model, options.requests, options.seed);
    infer::EngineConfig config;
    config.block_size = options.block_size;
    config.scheduler.max_seqs = 8;
    config.prefix_caching = false;  // only what each sequence holds itself
    infer::Engine engine(model, pool, config);
    std::vector<int> ids;
    for (size_t i = 0; i < w.prompts.size(); ++i) {
        infer::SamplingParams params;
        params.temperature = 0;
        params.max_tokens = w.max_tokens[i];
        ids.push_back(engine.add_request(w.prompts[i], params));
    }
    // Per request: its prompt length and limit, and how many tokens it has generated so far (from the events).
    std::map<int, int> prompt_of, limit_of, generated_of;
    for (size_t i = 0; i < ids.size(); ++i) {
        prompt_of[ids[i]] = static_cast<int>(w.prompts[i].size());
        limit_of[ids[i]] = w.max_tokens[i];
    }
    std::set<int> running;
    double stored = 0, paged = 0, reserved = 0, full_context = 0;  // token-steps, summed over steps
    int steps = 0, finished_early = 0;
    while (engine.has_work()) {
        for (const infer::Event& e : engine.step()) {
            running.insert(e.request_id);
            generated_of[e.request_id] += static_cast<int>(e.token_ids.size());
            if (e.finished) {
                running.erase(e.request_id);
                finished_early += e.finish_reason == infer::FinishReason::Stop;
            }
        }
        if (running.empty()) continue;
        ++steps;
        paged += static_cast<double>(engine.cache().used_block_count()) * engine.cache().block_size();
        for (int id : running) {
            stored += prompt_of[id] + generated_of[id] - 1;  // the newest token's K/V come with the next step
            reserved += prompt_of[id] + limit_of[id];
        }
        full_context += static_cast<double>(running.size()) * c.context_length;
    }
    const double token_bytes = static_cast<double>(infer::KVCache::bytes_per_token(c));
    std::printf("\n2. Contiguous vs paged, %d requests (prompts 8-160 tokens, max_tokens 8-200, %d stopped at EOS),\n"
                "   averaged over %d engine steps with up to 8 running:\n",
                options.requests, finished_early, steps);
    std::printf("   %-44s %12s %10s %10s\n", "layout", "MiB held", "tokens", "waste");
    auto row = [&](const char* name, double token_steps) {
        double average = token_steps / std::max(steps, 1);
        std::printf("   %-44s %12.2f %10.0f %9.1f%%\n", name, mib(average * token_bytes), average,
                    100.0 * (1.0 - stored / std::max(token_steps, 1.0)));
    };
    row("K/V actually stored", stored);
    row("contiguous, one full context per slot", full_context);
    row("contiguous, prompt + max_tokens per request", reserved);
    char paged_name[64];
    std::snprintf(paged_name, sizeof paged_name, "paged, blocks of %d tokens", options.block_size);
    row(paged_name, paged);
}

// ---- 3. Prefix sharing -------------------------------------------------------------------------------------------------

void print_prefix_sharing(const infer::Model& model, infer::ThreadPool& pool, const Options& options) {
    std::mt19937_64 rng(options.seed + 1);
    const int vocab = model.config.vocab_size;
    const int system_length = std::min(96, model.config.context_length / 4);
    std::vector<int> system_prompt{model.config.bos_id >= 0 ? model.config.bos_id : 1};
    while (static_cast<int>(system_prompt.size()) < system_length) system_prompt.push_back(3 + static_cast<int>(rng() % (vocab - 3)));
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < options.requests; ++i) {
        std::vector<int> prompt = system_prompt;  // the shared instructions, then each user's own question
        int question = 8 + static_cast<int>(rng() % 24);
        for (int k = 0; k < question; ++k) prompt.push_back(3 + static_cast<int>(rng() % (vocab - 3)));
        prompts.push_back(prompt);
    }
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 8;
    std::printf("\n3. Prefix sharing: %d requests, each a %d-token system prompt + an 8-31 token question\n",
                options.requests, system_length);
    std::printf("   %-18s %14s %16s %14s %10s\n", "prefix cache", "prompt tokens", "cache hits", "prefilled", "seconds");
    std::vector<std::vector<int>> outputs[2];
    for (bool caching : {false, true}) {
        infer::EngineConfig config;
        config.block_size = options.block_size;
        config.prefix_caching = caching;
        config.scheduler.max_seqs = 4;  // the first requests fill the cache; the rest find it there
        infer::Engine engine(model, pool, config);
        infer::Stopwatch clock;
        for (const auto& result : engine.generate(prompts, params)) outputs[caching].push_back(result.generated_ids);
        const double seconds = clock.seconds();
        const infer::EngineTotals& t = engine.totals();
        std::printf("   %-18s %14lld %9lld (%4.1f%%) %14lld %10.3f\n", caching ? "on" : "off", static_cast<long long>(t.prompt_tokens),
                    static_cast<long long>(t.prefix_hit_tokens),
                    100.0 * static_cast<double>(t.prefix_hit_tokens) / static_cast<double>(std::max<int64_t>(t.prompt_tokens, 1)),
                    static_cast<long long>(t.prefill_tokens), seconds);
    }
    std::printf("   outputs identical with and without the cache: %s\n", outputs[0] == outputs[1] ? "yes" : "NO");
    if (outputs[0] != outputs[1]) throw infer::Error("prefix caching changed an output: that is a bug");
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    infer::Model model = model_or_demo(options.model_path);
    infer::ThreadPool pool(options.threads);
    print_bytes_per_token(model);
    print_contiguous_vs_paged(model, pool, options);
    print_prefix_sharing(model, pool, options);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "05_kv_cache: " << e.what() << '\n';
    return 1;
}
